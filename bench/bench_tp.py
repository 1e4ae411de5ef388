"""Tensor parallelism on one host: decode speed by number of ranks, against the aggregate roofline.

For each size in `--tp`, one engine over random weights of a real shape (`EngineConfig.
random_weights`: each rank draws only its own share, so a 70B shape needs no checkpoint):
  - decode tokens/s at each batch size of `--batches` (128 prompt tokens, `--new` new, greedy),
    and at batch 1 its speedup over the first size of `--tp` (e.g. TP=2 against TP=1);
  - the share of the aggregate memory roofline at batch 1: bytes a token reads (every rank's
    weights, plus the K/V it attends) x tokens/s over `tp` x one card's bandwidth (the engine's
    start-up copy measurement, and the datasheet's when the card is known);
  - the collectives' share of a batch-1 decode step: rank 0's all-reduce (and all-gather and
    broadcast) time over the wall time of a profiled run (torch.profiler: NCCL kernels on a GPU,
    the c10d ops on the CPU, a smoke test only: gloo waits for its peers outside them);
  - with `--timeline` (GPU): rank 0's batch-1 decode step by kernel kind, in µs a step. Kernels
    overlap under programmatic dependent launch (each starts early and waits for the one before),
    so every instant is charged to the oldest kernel running then, and to "idle" where none runs.
Every number is printed and written to `--json` as it comes.

    python bench/bench_tp.py --shape llama-8b --tp 1,2 --batches 1 --json tp-8b.json
    python bench/bench_tp.py --shape llama-70b --tp 4 --batches 1,64 --json tp-70b.json
    python bench/bench_tp.py --device cpu --shape tiny --tp 1,2 --batches 1,4 --new 16  # seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
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
    reduce = gather = other = 0.0
    for event in prof.key_averages():
        name = event.key.lower()
        if core.engine.device.type == "cuda":
            if "nccl" not in name:
                continue
            seconds = getattr(event, "self_device_time_total", 0) / 1e6
        else:
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
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name.lower())
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
    )
    first = next((i for i, k in enumerate(kernels) if "gemv" in k[2]), 0)  # (fused decode)
    steps = rate["tokens"] - 1  # (from the first decode step on: the prompt's pass is eager)
    return {kind: round(us / steps, 1) for kind, us in charge(kernels[first:]).items()}


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


def bench(shape: str, tp: int, path: Path, base: dict) -> None:
    dtype = "bfloat16" if ARGS.device == "cuda" else "float32"
    config = EngineConfig(
        model=str(path), device=ARGS.device, dtype=dtype, random_weights=True,
        tensor_parallel_size=tp, max_model_len=gpu.PROMPT + ARGS.new + 16,
    )  # fmt: skip
    start = time.perf_counter()
    engine = Engine(config)
    record(f"{shape}/tp{tp}/start_s", round(time.perf_counter() - start, 1))
    core = EngineCore(engine)
    vocab = SHAPES[shape]["vocab_size"]
    try:
        gpu.run_core(core, gpu.prompts(2, vocab, seed=3), new=8)  # warm-up
        for batch in ARGS.batches:
            rate = gpu.run_core(core, gpu.prompts(batch, vocab, seed=batch), new=ARGS.new)
            record(f"{shape}/tp{tp}/batch{batch}_decode_tok_s", round(rate["decode_tok_s"], 1))
            if batch != 1:
                continue
            tok_s = rate["decode_tok_s"]
            if base:
                record(f"{shape}/tp{tp}/batch1_speedup_vs_tp{base['tp']}",
                       round(tok_s / base["tok_s"], 3))  # fmt: skip
            else:
                base.update(tp=tp, tok_s=tok_s)
            s = engine.shape  # the whole model, every rank's share
            context = gpu.PROMPT + ARGS.new // 2  # the mean context a decode token attends
            per_token = s.layer_bytes + s.head_bytes + context * s.kv_bytes_per_token
            record(f"{shape}/tp{tp}/batch1_roofline_measured_bw",
                   round(per_token * tok_s / engine.peaks.bandwidth, 3))  # fmt: skip
            card = card_bandwidth()
            if card is not None:
                record(f"{shape}/tp{tp}/batch1_roofline_datasheet",
                       round(per_token * tok_s / (tp * card), 3))  # fmt: skip
            if tp > 1:
                for key, value in collective_share(core, vocab).items():
                    record(f"{shape}/tp{tp}/batch1_{key}", value)
            if ARGS.timeline:
                record(f"{shape}/tp{tp}/batch1_step_us", step_timeline(core, vocab))
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
        bench(ARGS.shape, tp, path, base)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama-8b", choices=sorted(SHAPES))
    parser.add_argument("--tp", default="1,2", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--batches", default="1", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--new", default=128, type=int, help="new tokens per request")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="write every number here as it comes")
    parser.add_argument("--timeline", action="store_true", help="GPU: the batch-1 step by kernel")
    ARGS = parser.parse_args()
    gpu.ARGS = ARGS  # (bench_gpu's helpers read its ARGS.device)
    main()
