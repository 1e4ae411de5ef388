"""The roofline count (`stride.engine.roofline`) against what `bench_gpu.py` measures, on one GPU.

For each model shape (random bf16 weights of the real shapes, built as `bench_gpu.py` builds
them), on the same card and in one run of the engine:
  - batch 1, 128 prompt tokens, 128 new, greedy: the achieved bandwidth as `bench_gpu.py`
    reports it (weight bytes read per token x decode tokens/s) and as the roofline metrics do
    (bytes counted per step over step wall time, Prometheus' rate over rate), and their ratio;
  - batches of 1 ... 256 concurrent requests (128 in, 128 out): arithmetic intensity (FLOPs per
    byte read), achieved bandwidth and FLOP/s, and their shares of the device's peaks (measured
    when the engine starts: a copy and a bf16 matmul).
Every number is printed and written to `--json` as it comes (card, date, command first).

    python bench/bench_roofline.py --shapes smollm2-135m,llama-8b --json roofline.json
    python bench/bench_roofline.py --device cpu --shapes tiny --batches 1,4   # a smoke test
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_gpu as gpu  # noqa: E402  (same folder: the shapes and the engine over them)

from stride.engine.roofline import StepLoad  # noqa: E402
from stride.engine.sequence import SamplingParams  # noqa: E402
from stride.scheduler.core import EngineCore  # noqa: E402
from stride.scheduler.outputs import GenerateRequest  # noqa: E402

RESULTS: dict = {}
AGREE = 0.10  # the roofline's bandwidth and bench_gpu's agree within this share


def record(key: str, value) -> None:
    RESULTS[key] = value
    print(f"{key}: {value}", flush=True)
    if ARGS.json:
        Path(ARGS.json).write_text(json.dumps(RESULTS, indent=1))


def run(core: EngineCore, prompts: list[list[int]], new: int) -> dict:
    """Every prompt at once, stepped to the end as the server's loop does: the decode tokens/s
    `bench_gpu.run_core` reports, and the sums of the steps' loads and wall times."""
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        core.add(GenerateRequest(f"r{i}-{t0}", ids, params))
    tokens, first = 0, None
    total = StepLoad()
    seconds = 0.0
    while core.has_work:
        start = time.perf_counter()
        outs = core.step()
        seconds += time.perf_counter() - start
        load = core.stats().load
        for field in ("passes", "decode_rows", "prefill_tokens", "read_bytes", "flops"):
            setattr(total, field, getattr(total, field) + getattr(load, field))
        tokens += sum(len(out.token_ids) for out in outs)
        if first is None and tokens:
            first = (time.perf_counter(), tokens)
    end = time.perf_counter()
    return {
        "decode_tok_s": (tokens - first[1]) / (end - first[0]),
        "tok_s": tokens / (end - t0),
        "read_bytes": total.read_bytes,
        "flops": total.flops,
        "step_seconds": seconds,
        "passes": total.passes,
        "decode_rows": total.decode_rows,
        "prefill_tokens": total.prefill_tokens,
    }


def bench_shape(shape: str) -> None:
    config = gpu.llama_config(shape)
    hf = gpu.random_hf_model(config)
    _, per_token = gpu.weight_bytes(hf)  # what bench_gpu.py multiplies decode tok/s by
    record(f"{shape}/bench_gpu_bytes_read_per_token", per_token)
    vocab = config.vocab_size
    state = hf.state_dict()
    del hf
    gpu.free_gpu()
    engine = gpu.stride_engine(state, config, gpu.word_tokenizer(vocab))
    peaks = engine.peaks
    record(f"{shape}/peaks", {"bandwidth_GBps": round(peaks.bandwidth / 1e9, 1),
                              "TFLOPs": round(peaks.flops / 1e12, 2)})  # fmt: skip
    shape_ = engine.shape
    weights = shape_.layer_bytes + shape_.head_bytes
    record(f"{shape}/roofline_weight_bytes_per_pass", weights)
    core = EngineCore(engine)
    run(core, gpu.prompts(4, vocab, seed=2), new=16)  # warm-up (graphs, kernels)

    b1 = run(core, gpu.prompts(1, vocab), gpu.NEW)
    measured = per_token * b1["decode_tok_s"]
    reported = b1["read_bytes"] / b1["step_seconds"]
    record(f"{shape}/batch1", {
        "decode_tok_s": round(b1["decode_tok_s"], 1),
        "bench_gpu_bandwidth_GBps": round(measured / 1e9, 1),
        "roofline_bandwidth_GBps": round(reported / 1e9, 1),
        "ratio": round(reported / measured, 4),
        "agree_within_10pct": abs(reported / measured - 1) <= AGREE,
        "share_of_peak_bandwidth": round(reported / peaks.bandwidth, 4),
        # What the count has beyond bench_gpu's weights: the K/V read (and the prefill pass).
        "kv_share_of_bytes": round(1 - weights * b1["passes"] / b1["read_bytes"], 4),
    })  # fmt: skip

    intensity = []
    for n in ARGS.batches:
        r = run(core, gpu.prompts(n, vocab, seed=n), gpu.NEW)
        intensity.append(r["flops"] / r["read_bytes"])
        bandwidth, flops = r["read_bytes"] / r["step_seconds"], r["flops"] / r["step_seconds"]
        record(f"{shape}/batch{n}_roofline", {
            "tok_s": round(r["tok_s"], 1),
            "intensity_flop_per_byte": round(intensity[-1], 3),
            "achieved_bandwidth_GBps": round(bandwidth / 1e9, 1),
            "achieved_TFLOPs": round(flops / 1e12, 3),
            "share_of_peak_bandwidth": round(bandwidth / peaks.bandwidth, 4),
            "share_of_peak_flops": round(flops / peaks.flops, 4),
            "roof_TFLOPs": round(min(peaks.flops, intensity[-1] * peaks.bandwidth) / 1e12, 3),
            "passes": r["passes"],
        })  # fmt: skip
    record(f"{shape}/intensity_grows_with_batch", all(
        a < b for a, b in zip(intensity, intensity[1:], strict=False)))  # fmt: skip
    del core, engine
    gpu.free_gpu()


def main() -> None:
    name = torch.cuda.get_device_name() if ARGS.device == "cuda" else "cpu"
    record("card", name)
    record("date", time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    record("command", " ".join(["python", *sys.argv]))
    record("versions", {"torch": torch.__version__})
    for shape in filter(None, ARGS.shapes.split(",")):
        bench_shape(shape)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="smollm2-135m,llama-8b")
    parser.add_argument("--json", help="write every result here as it is measured")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of the script")
    parser.add_argument(
        "--batches",
        default=[1, 8, 32, 64, 128, 256],
        type=lambda t: [int(x) for x in t.split(",")],
        help="concurrent requests per intensity run",
    )
    ARGS = parser.parse_args()
    gpu.ARGS = argparse.Namespace(device=ARGS.device, json=None)  # what its builders read
    main()
