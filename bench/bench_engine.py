"""Stride's engine against transformers `generate` on the same model and machine, in one run.

Prints output tok/s at batch 1 and at 64 concurrent requests for both. Stride gets every request
at once and steps its continuous-batching loop until all finish; transformers gets the same
prompts as one padded batch. Greedy, fixed length (EOS ignored), so both do the same work.

    python bench/bench_engine.py                      # the default model, CPU here
    python bench/bench_engine.py --device cuda --new 128 --prompt 128
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stride.engine.config import EngineConfig  # noqa: E402
from stride.engine.engine import Engine  # noqa: E402
from stride.engine.gguf_file import transformers_kwargs  # noqa: E402
from stride.engine.sequence import SamplingParams  # noqa: E402
from stride.scheduler.core import EngineCore  # noqa: E402
from stride.scheduler.outputs import GenerateRequest  # noqa: E402


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode(core: EngineCore, batch: list[list[int]], params: SamplingParams) -> tuple[int, float]:
    """All of `batch` at once, stepped to the end: (output tokens, seconds). Seeded requests
    get seed + i (as a request's `n` choices do)."""
    sync(core.engine.device)
    t0 = time.perf_counter()
    for i, ids in enumerate(batch):
        mine = params if params.seed is None else replace(params, seed=params.seed + i)
        core.add(GenerateRequest(f"r{i}-{t0}", ids, mine))
    tokens = 0
    while core.has_work:
        for out in core.step():
            if out.error is not None:
                raise RuntimeError(f"request failed: {out.error}")
            tokens += len(out.token_ids)
    sync(core.engine.device)
    return tokens, time.perf_counter() - t0


def stride_tok_s(core: EngineCore, batch: list[list[int]], new: int) -> float:
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, ids in enumerate(batch):
        core.add(GenerateRequest(f"r{i}-{t0}", ids, params))
    tokens = 0
    while core.has_work:
        tokens += sum(len(out.token_ids) for out in core.step())
    return tokens / (time.perf_counter() - t0)


def hf_tok_s(model, batch: list[list[int]], new: int, device: torch.device) -> float:
    ids = torch.tensor(batch, device=device)
    kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    sync(device)
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
    sync(device)
    return (out.shape[1] - ids.shape[1]) * len(batch) / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model directory, hub id or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--new", type=int, default=32, help="new tokens per request")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument(
        "--threads", type=int, help="CPU threads (on a busy machine 1 beats oversubscription)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    engine = Engine(
        EngineConfig(model=args.model, device=args.device, dtype=args.dtype, kv_cache_memory=None)
    )
    device, vocab = engine.device, engine.hf_config.vocab_size
    core = EngineCore(engine)
    stride_tok_s(core, prompts(2, 8, vocab, seed=0), 4)  # warm-up

    from transformers import AutoModelForCausalLM

    kwargs = transformers_kwargs(engine.path)
    hf = AutoModelForCausalLM.from_pretrained(engine.path, **kwargs, dtype=engine.dtype)
    hf = hf.to(device).eval()
    hf.generation_config.eos_token_id = None
    with torch.inference_mode():
        hf_tok_s(hf, prompts(1, 8, vocab, seed=0), 4, device)  # warm-up

        print(
            f"model {engine.name} on {device} ({engine.dtype}), prompt {args.prompt}, "
            f"new {args.new}, torch {torch.__version__}, {torch.get_num_threads()} threads"
        )
        print(f"{'':12}{'batch 1':>12}{f'{args.concurrency} concurrent':>18}  (output tok/s)")
        rows = {}
        for name, fn in (
            ("stride", lambda b: stride_tok_s(core, b, args.new)),
            ("transformers", lambda b: hf_tok_s(hf, b, args.new, device)),
        ):
            one = fn(prompts(1, args.prompt, vocab, seed=1))
            many = fn(prompts(args.concurrency, args.prompt, vocab, seed=2))
            rows[name] = (one, many)
            print(f"{name:12}{one:12.1f}{many:18.1f}", flush=True)
        s, t = rows["stride"], rows["transformers"]
        print(f"{'speed-up':12}{s[0] / t[0]:11.2f}x{s[1] / t[1]:17.2f}x")


if __name__ == "__main__":
    main()
