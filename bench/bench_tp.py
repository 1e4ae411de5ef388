"""Tensor parallelism on one host: decode speed by number of ranks, against the aggregate roofline.

For each size in `--tp`, one engine over random weights of a real shape (`EngineConfig.
random_weights`: each rank draws only its own share, so a 70B shape needs no checkpoint):
  - decode tokens/s at each batch size of `--batches` (128 prompt tokens, `--new` new, greedy),
    and at batch 1 its speedup over the first size of `--tp` (e.g. TP=2 against TP=1);
  - the share of the aggregate memory roofline at batch 1: bytes a token reads (every rank's
    weights, plus the K/V it attends) x tokens/s over `tp` x one card's bandwidth (the engine's
    start-up copy measurement, and the datasheet's when the card is known);
  - the collectives' share of a batch-1 decode step: rank 0's all-reduce (and all-gather and
    broadcast) time over the wall time of a profiled run (torch.profiler: on a GPU the NCCL
    kernels and the peer sum, each instant charged as `--timeline` charges it; on the CPU the
    c10d ops, a smoke test only: gloo waits for its peers outside them);
  - with `--timeline` (GPU): rank 0's batch-1 decode step by kernel kind, in µs a step. Kernels
    overlap under programmatic dependent launch (each starts early and waits for the one before),
    so every instant is charged to the oldest kernel running then, and to "idle" where none runs;
  - with `--serve` (the last size of `--tp`, the first of `--all-reduce`): `stride serve` on the
    same shape and random weights, `--serve-requests` requests one after another over HTTP, and
    the share of the aggregate measured bandwidth its roofline metrics (`/metrics`) report for
    them, beside the bench's own at batch 1.
Each size past 1 runs with each mode of `--all-reduce` (auto: decode-sized sums over peer
memory, `stride/engine/collectives.py`; nccl). Every number is printed and written to `--json`
as it comes.

    python bench/bench_tp.py --shape llama-8b --tp 1,2 --all-reduce auto,nccl --json tp-8b.json
    python bench/bench_tp.py --shape llama-70b --tp 4 --batches 1,8,64 --serve --json tp-70b.json
    python bench/bench_tp.py --device cpu --shape tiny --tp 1,2 --batches 1,4 --new 16  # seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_gpu as gpu  # noqa: E402  (same folder: the shapes, prompts and the step loop)

from stride.engine.config import EngineConfig  # noqa: E402
from stride.engine.engine import Engine  # noqa: E402
from stride.scheduler.core import EngineCore  # noqa: E402

SHAPES = {
    **gpu.SHAPES,
    "llama-70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
}
RESULTS: dict = {}


def record(key: str, value) -> None:
    RESULTS[key] = value
    print(f"{key}: {value}", flush=True)
    if ARGS.json:
        Path(ARGS.json).write_text(json.dumps(RESULTS, indent=1))


def model_dir(shape: str) -> Path:
    """A directory with the shape's config and a word tokenizer, and no weights."""
    gpu.SHAPES.setdefault(shape, SHAPES[shape])  # (llama_config reads bench_gpu's table)
    path = Path(tempfile.mkdtemp(prefix=f"stride-tp-{shape}-"))
    gpu.llama_config(shape).save_pretrained(path)
    gpu.word_tokenizer(SHAPES[shape]["vocab_size"]).save_pretrained(path)
    return path


def card_bandwidth() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((bw for card, bw in gpu.PEAK_BANDWIDTH.items() if card in name), None)


def collective_share(core: EngineCore, vocab: int) -> dict:
    """Rank 0's time in collectives over the wall time of a batch-1 run, profiled."""
    activities = [ProfilerActivity.CPU]
    if core.engine.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        gpu.run_core(core, gpu.prompts(1, vocab, seed=7), new=ARGS.new)
        gpu.sync()
        wall = time.perf_counter() - t0
    if core.engine.device.type == "cuda":
        spent = charge(cuda_kernels(prof))  # µs
        reduce = (spent.get("all_reduce", 0.0) + spent.get("peer_sum", 0.0)) / 1e6
        gather = spent.get("all_gather", 0.0) / 1e6
        other = spent.get("other_collectives", 0.0) / 1e6
    else:
        reduce = gather = other = 0.0
        for event in prof.key_averages():
            name = event.key.lower()
            if not name.startswith("c10d::"):  # (gloo's wait for its peers is not in them)
                continue
            seconds = event.self_cpu_time_total / 1e6
            if "allreduce" in name:
                reduce += seconds
            elif "allgather" in name:
                gather += seconds
            else:
                other += seconds
    return {
        "all_reduce_share": round(reduce / wall, 4),
        "all_gather_share": round(gather / wall, 4),
        "other_collectives_share": round(other / wall, 4),
    }


KINDS = {  # kernel kinds of a decode step, by a piece of their names (the first that matches)
    "all_reduce": "allreduce",
    "peer_sum": "_peer_sum_kernel",
    "all_gather": "allgather",
    "other_collectives": "nccl",
    "gemv": "gemv",
    "attention": "_decode_kernel",
    "attention_merge": "_merge_kernel",
    "gemm": "nvjet",
    "add": "functor_add",
}


def step_timeline(core: EngineCore, vocab: int, new: int = 64) -> dict:
    """Rank 0's decode step at batch 1, µs per token by kernel kind (see the module docstring)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        rate = gpu.run_core(core, gpu.prompts(1, vocab, seed=11), new=new)
        gpu.sync()
    kernels = cuda_kernels(prof)
    first = next((i for i, k in enumerate(kernels) if "gemv" in k[2]), 0)  # (fused decode)
    steps = rate["tokens"] - 1  # (from the first decode step on: the prompt's pass is eager)
    return {kind: round(us / steps, 1) for kind, us in charge(kernels[first:]).items()}


def cuda_kernels(prof) -> list[tuple[float, float, str]]:
    """A profile's GPU kernels: (start, end in µs, lower-case name), sorted by start."""
    return sorted(
        (e.time_range.start, e.time_range.end, e.name.lower())
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
    )


def charge(kernels: list[tuple[float, float, str]]) -> dict[str, float]:
    """Time by kernel kind, each instant charged to the oldest kernel running (`kernels`:
    (start, end, lower-case name), sorted by start), "idle" where none runs; largest first."""
    edges = sorted({t for start, end, _ in kernels for t in (start, end)})
    spent: dict[str, float] = {}
    running: list[tuple[float, float, str]] = []
    i = 0
    for a, b in zip(edges, edges[1:], strict=False):
        while i < len(kernels) and kernels[i][0] <= a:
            running.append(kernels[i])
            i += 1
        running = [k for k in running if k[1] > a]
        name = running[0][2] if running else ""  # (the oldest: appended in start order)
        kind = next((k for k, piece in KINDS.items() if piece in name), "other") if name else "idle"
        spent[kind] = spent.get(kind, 0.0) + b - a
    return dict(sorted(spent.items(), key=lambda kv: -kv[1]))


def label(shape: str, tp: int, mode: str, what: str = "") -> str:
    """The keys' prefix of a run: llama-8b/tp2, llama-8b/tp2_nccl, llama-8b/serve_tp2."""
    return f"{shape}/{what}tp{tp}" + ("" if mode == "auto" or tp == 1 else f"_{mode}")


def bench(shape: str, tp: int, mode: str, path: Path, base: dict) -> None:
    dtype = "bfloat16" if ARGS.device == "cuda" else "float32"
    config = EngineConfig(
        model=str(path), device=ARGS.device, dtype=dtype, random_weights=True,
        tensor_parallel_size=tp, all_reduce=mode, max_model_len=gpu.PROMPT + ARGS.new + 16,
    )  # fmt: skip
    start = time.perf_counter()
    engine = Engine(config)
    key = label(shape, tp, mode)
    record(f"{key}/start_s", round(time.perf_counter() - start, 1))
    core = EngineCore(engine)
    vocab = SHAPES[shape]["vocab_size"]
    try:
        gpu.run_core(core, gpu.prompts(2, vocab, seed=3), new=8)  # warm-up
        for batch in ARGS.batches:
            rate = gpu.run_core(core, gpu.prompts(batch, vocab, seed=batch), new=ARGS.new)
            record(f"{key}/batch{batch}_decode_tok_s", round(rate["decode_tok_s"], 1))
            if batch != 1:
                continue
            tok_s = rate["decode_tok_s"]
            if base:
                record(f"{key}/batch1_speedup_vs_tp{base['tp']}",
                       round(tok_s / base["tok_s"], 3))  # fmt: skip
            else:
                base.update(tp=tp, tok_s=tok_s)
            s = engine.shape  # the whole model, every rank's share
            context = gpu.PROMPT + ARGS.new // 2  # the mean context a decode token attends
            per_token = s.layer_bytes + s.head_bytes + context * s.kv_bytes_per_token
            record(f"{key}/batch1_read_gb_s", round(per_token * tok_s / 1e9, 1))
            record(f"{key}/peak_bandwidth_gb_s", round(engine.peaks.bandwidth / 1e9, 1))
            record(f"{key}/batch1_roofline_measured_bw",
                   round(per_token * tok_s / engine.peaks.bandwidth, 3))  # fmt: skip
            card = card_bandwidth()
            if card is not None:
                record(f"{key}/batch1_roofline_datasheet",
                       round(per_token * tok_s / (tp * card), 3))  # fmt: skip
            if tp > 1:
                for name, value in collective_share(core, vocab).items():
                    record(f"{key}/batch1_{name}", value)
            if ARGS.timeline:
                record(f"{key}/batch1_step_us", step_timeline(core, vocab))
    finally:
        if engine.workers is not None:
            engine.workers.close()
        del core, engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main() -> None:
    record("command", " ".join(sys.argv))
    record("date", time.strftime("%Y-%m-%d %H:%M:%S"))
    if torch.cuda.is_available():
        record("card", f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}")
    path = model_dir(ARGS.shape)
    base: dict = {}
    for tp in ARGS.tp:
        for mode in ARGS.all_reduce if tp > 1 else ["auto"]:
            bench(ARGS.shape, tp, mode, path, base)
    if ARGS.serve:
        serve(ARGS.shape, ARGS.tp[-1], ARGS.all_reduce[0], path)


def serve(shape: str, tp: int, mode: str, path: Path) -> None:
    """`stride serve` on `path`, requests one at a time, and what its roofline metrics say."""
    port = 8124
    cmd = [sys.executable, "-m", "stride", "serve", "--model", str(path), "--port", str(port),
           "--load-format", "dummy", "--tensor-parallel-size", str(tp), "--all-reduce", mode,
           "--device", ARGS.device, "--max-model-len", str(gpu.PROMPT + ARGS.new + 16),
           "--log-level", "warning"]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    server = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"stride serve exited with {server.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1.0)
        key = label(shape, tp, mode, "serve_")
        record(f"{key}/start_s", round(time.perf_counter() - start, 1))
        vocab = SHAPES[shape]["vocab_size"]
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        ask(url, model, gpu.prompts(1, vocab, seed=3)[0])  # warm-up
        before = roofline(url)
        t0, tokens = time.perf_counter(), 0
        for ids in gpu.prompts(ARGS.serve_requests, vocab, seed=5):
            tokens += ask(url, model, ids)
        elapsed = time.perf_counter() - t0
        record(f"{key}/tok_s_one_at_a_time", round(tokens / elapsed, 1))
        after = roofline(url)
        read = after["read_bytes"] - before["read_bytes"]
        seconds = after["step_seconds"] - before["step_seconds"]
        share = read / seconds / after["peak_bandwidth"]
        record(f"{key}/read_gb_s", round(read / seconds / 1e9, 1))
        record(f"{key}/step_share_of_wall", round(seconds / elapsed, 3))
        record(f"{key}/peak_bandwidth_gb_s", round(after["peak_bandwidth"] / 1e9, 1))
        record(f"{key}/roofline_measured_bw", round(share, 3))
        bench_share = RESULTS.get(f"{label(shape, tp, mode)}/batch1_roofline_measured_bw")
        if bench_share:
            record(f"{key}/roofline_over_bench", round(share / bench_share, 3))
    finally:
        server.terminate()
        server.wait(120)


def ask(url: str, model: str, ids: list[int]) -> int:
    """One greedy completion of `--new` tokens for prompt `ids`; the tokens it made."""
    body = {"model": model, "prompt": ids, "max_tokens": ARGS.new, "temperature": 0.0,
            "ignore_eos": True}  # fmt: skip
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


def roofline(url: str) -> dict[str, float]:
    """The server's roofline counters (summed over decoders) and its bandwidth peak."""
    names = {
        "stride_engine_read_bytes": "read_bytes",
        "stride_engine_step_seconds": "step_seconds",
        "stride_device_peak_bandwidth_bytes_per_second": "peak_bandwidth",
    }
    found = dict.fromkeys(names.values(), 0.0)
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name in names:
                found[names[name]] += sample.value
    return found


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES))
    parser.add_argument("--tp", default="1,2", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--batches", default="1", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--new", default=128, type=int, help="new tokens per request")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="write every number here as it comes")
    parser.add_argument("--timeline", action="store_true", help="GPU: the batch-1 step by kernel")
    parser.add_argument("--all-reduce", default="auto", type=lambda s: s.split(","),
                        help="all-reduce modes each size past 1 runs with: auto,nccl")  # fmt: skip
    parser.add_argument("--serve", action="store_true",
                        help="also through `stride serve` at the last size of --tp")  # fmt: skip
    parser.add_argument("--serve-requests", default=8, type=int)
    ARGS = parser.parse_args()
    gpu.ARGS = ARGS  # (bench_gpu's helpers read its ARGS.device)
    main()
