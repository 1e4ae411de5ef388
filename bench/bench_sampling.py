"""The cost of sampling: greedy against sampled decoding, in one run.

At each concurrency (default 1, 64 and 256), the same prompts decode the same number of tokens
(`ignore_eos`) under each variant of the sampling settings, and output tok/s is compared with
greedy's. Sampled rows with nothing that needs the host between two tokens are drawn on the
device (bursts, one launch in flight; on the GPU in `draw_kernels`, logprobs included), so what
is measured is the draw's device time and the host's work per step around it.

- `greedy`: temperature 0;
- `temperature`: temperature 1, seeded (Gumbel noise over the whole vocabulary);
- `top-k-top-p`: temperature 1, top-k 50, top-p 0.95, seeded (the 50 best columns only);
- `unseeded`: as `top-k-top-p`, unseeded (a random seed per sequence);
- `top-p`: temperature 1, top-p 0.95, seeded (no top-k: what it keeps may go past the draw
  kernels' candidates);
- `logprobs`: as `top-k-top-p`, with 5 logprobs per token (taken with the draw);
- `penalties`: as `top-k-top-p`, with presence and frequency penalties of 0.5 (added on the
  device, each row's tokens counted there);
- `logit-bias`: as `top-k-top-p`, with 16 tokens' logits lowered by 5 (added on the device
  before the draw).

    python bench/bench_sampling.py --device cuda --json OUT  # the default model
    python bench/bench_sampling.py --device cuda --shape smollm2-135m  # its shape, random weights
    python bench/bench_sampling.py --device cpu --shape tiny --concurrency 1,4 --new 16  # a check
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_gpu as gpu  # noqa: E402
from bench_engine import decode, prompts  # noqa: E402
from bench_tp import model_dir  # noqa: E402

from stride.engine.config import EngineConfig  # noqa: E402
from stride.engine.engine import Engine  # noqa: E402
from stride.engine.sequence import SamplingParams  # noqa: E402
from stride.scheduler.core import EngineCore  # noqa: E402

TOP = {"temperature": 1.0, "top_k": 50, "top_p": 0.95}
VARIANTS = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 1.0, "seed": 0},
    "top-k-top-p": {**TOP, "seed": 0},
    "unseeded": TOP,
    "top-p": {"temperature": 1.0, "top_p": 0.95, "seed": 0},
    "logprobs": {**TOP, "seed": 0, "logprobs": 5},
    "penalties": {**TOP, "seed": 0, "presence_penalty": 0.5, "frequency_penalty": 0.5},
    "logit-bias": {**TOP, "seed": 0, "logit_bias": {token: -5.0 for token in range(100, 116)}},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model directory, hub id or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--shape", choices=sorted(gpu.SHAPES), help="random weights of a shape")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", default="1,64,256")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="of: " + ", ".join(VARIANTS))
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--new", type=int, default=128, help="new tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds of all; each's best")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    engine = Engine(
        EngineConfig(
            model=str(model_dir(args.shape)) if args.shape else args.model,
            random_weights=args.shape is not None,
            device=args.device,
            dtype=args.dtype,
            kv_cache_memory=None,
            enable_prefix_caching=False,  # every run pays for its own prefills
        )
    )
    core = EngineCore(engine)
    vocab = engine.hf_config.vocab_size
    variants = args.variants.split(",")
    print(f"model {engine.name} on {engine.device} ({engine.dtype}), vocabulary {vocab}, "
          f"prompt {args.prompt}, new {args.new}")  # fmt: skip

    results = []
    for c in (int(c) for c in args.concurrency.split(",")):
        batch = prompts(c, args.prompt, vocab, seed=c)
        row: dict[str, float | int] = {"concurrency": c}
        params = {n: SamplingParams(max_tokens=args.new, ignore_eos=True, **VARIANTS[n])
                  for n in variants}  # fmt: skip
        for name in variants:
            decode(core, batch[:2], replace(params[name], max_tokens=4))  # warm-up
        best: dict[str, float] = {}
        for _ in range(args.repeats):  # the variants in turn: a drifting machine moves all alike
            for name in variants:
                tokens, seconds = decode(core, batch, params[name])
                if tokens != c * args.new:
                    raise RuntimeError(f"{name}: {tokens} tokens, not {c * args.new}")
                best[name] = min(best.get(name, seconds), seconds)
        for name in variants:
            row[f"{name}_tok_s"] = round(c * args.new / best[name], 1)
        line = f"concurrency {c:3d}:"
        for name in variants:
            tok_s = row[f"{name}_tok_s"]
            if "greedy" in variants and name != "greedy":
                row[f"{name}_vs_greedy"] = round(tok_s / row["greedy_tok_s"], 4)
                line += f" {name} {tok_s:9.1f} ({row[f'{name}_vs_greedy']:.2f}x),"
            else:
                line += f" {name} {tok_s:9.1f},"
        results.append(row)
        print(line.rstrip(",") + " tok/s", flush=True)

    if args.json:
        cuda = engine.device.type == "cuda"
        out = {
            "bench": "sampling",
            "model": engine.name,
            "device": str(engine.device),
            "gpu": torch.cuda.get_device_name(engine.device) if cuda else None,
            "dtype": str(engine.dtype),
            "torch": torch.__version__,
            "prompt": args.prompt,
            "new": args.new,
            "repeats": args.repeats,
            "variants": {name: VARIANTS[name] for name in variants},
            "results": results,
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
