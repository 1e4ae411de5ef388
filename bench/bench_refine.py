"""Refinement (Jacobi, lookahead, introspective) against plain greedy AR on the default model.

For code-like and free-text chat prompts, and held-out chat prompts (loadtest's built-in ones
plus `bench/data/heldout_prompts.jsonl`, none from the training prompt generator), at each
concurrency (requests in flight at once), every decoder generates the same greedy
continuations (with `--repeats N`, N rounds of every decoder in turn, each one's best round
reported: one wave of 64 short requests lasts a fraction of a second on a GPU, and single runs
there move by ±10 %); the script reports output tok/s, tokens committed per forward pass (what
refinement buys; the prompt's pass included), the speed-up over AR measured in the same process,
and whether the outputs equal AR's token for token (exact in fp32; bf16 may differ).
`introspective` needs a MASK-slot adapter: the one shipped for the model, or `--mask-adapter`.

    python bench/bench_refine.py                      # CPU, fp32, small
    python bench/bench_refine.py --device cuda --prompts 8 --tokens 128 --json out.json
    python bench/bench_refine.py --device cuda --dtype bfloat16 --kinds heldout --prompts 64 \
        --tokens 128 --concurrency 1,8,64 --decoders ar,jacobi,lookahead --repeats 3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from itertools import product
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.prompts import BUILTIN_PROMPTS  # noqa: E402
from stride.decoders.autoregressive import Autoregressive  # noqa: E402
from stride.decoders.base import DecodersConfig  # noqa: E402
from stride.decoders.refine import Refine  # noqa: E402
from stride.engine.config import EngineConfig  # noqa: E402
from stride.engine.engine import Engine  # noqa: E402
from stride.engine.sequence import SamplingParams  # noqa: E402
from stride.scheduler.core import EngineCore  # noqa: E402
from stride.scheduler.outputs import GenerateRequest  # noqa: E402
from stride.train.prompts import read_prompts  # noqa: E402

HELDOUT = Path(__file__).parent / "data" / "heldout_prompts.jsonl"

PROMPTS = {
    "code": [
        "Write a Python function that checks whether a string is a palindrome.",
        "Write a Python class for a stack with push, pop and peek methods.",
        "Write a JavaScript function that returns the sum of an array of numbers.",
        "Write a Python function that computes the n-th Fibonacci number iteratively.",
        "Write a SQL query that selects the ten most recent orders from a table orders.",
        "Write a Python function that reads a CSV file and returns a list of dicts.",
        "Write a C function that reverses a linked list.",
        "Write a Python function that counts the words in a text file.",
    ],
    "text": [
        "Tell me a short story about a lighthouse keeper.",
        "Explain why the sky is blue to a ten-year-old.",
        "What are three tips for staying focused while studying?",
        "Describe a walk through a forest in autumn.",
        "What is the difference between weather and climate?",
        "Write a short letter thanking a friend for their help.",
        "Give me a recipe idea for a quick vegetarian dinner.",
        "Why do cats purr?",
    ],
    "heldout": BUILTIN_PROMPTS + [m[-1]["content"] for m in read_prompts(HELDOUT)],
}
DECODERS = {
    "ar": ("ar", {}),
    "jacobi": ("refine", {"method": "jacobi"}),  # default options: refines where it pays
    "jacobi-w8": ("refine", {"method": "jacobi", "window": 8}),  # refines every step
    "lookahead": ("refine", {"method": "lookahead"}),
    "lookahead-wide": (
        "refine",
        {"method": "lookahead", "window": 8, "ngram": 5, "candidates": 8},
    ),
    "introspective": ("refine", {"method": "introspective"}),  # the adapter's k slots
    "introspective-k2": ("refine", {"method": "introspective", "slots": 2}),  # fewer rows a pass
    "introspective-k3": ("refine", {"method": "introspective", "slots": 3}),
    "introspective-k4": ("refine", {"method": "introspective", "slots": 4}),
}


def chat_ids(engine: Engine, text: str) -> list[int]:
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    return ids if isinstance(ids, list) else ids["input_ids"]


def sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def run_wave(core: EngineCore, requests: list[GenerateRequest]) -> tuple[dict, int, int]:
    """All requests at once, to the end: outputs, and the sums of output tokens and passes."""
    for r in requests:
        core.add(r)
    tokens: dict[str, list[int]] = {}
    passes = 0
    while core.has_work:
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                passes += out.decoder_stats["forward_passes"]
    return tokens, sum(map(len, tokens.values())), passes


def bench(engine: Engine, refine: Refine, kind: str, decoder: str, concurrency: int, args):
    core = EngineCore(engine, decoders={"ar": Autoregressive(), "refine": refine})
    name, options = DECODERS[decoder]
    count = max(args.prompts, concurrency)  # at least one full wave
    prompts = [chat_ids(engine, p) for p in PROMPTS[kind][:count]]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=args.ignore_eos)
    outputs: dict[str, list[int]] = {}
    total_tokens = total_passes = 0
    sync(engine)
    start = time.perf_counter()
    for w in range(0, len(prompts), concurrency):
        wave = [
            GenerateRequest(f"{kind}{w + i}", p, params, name, dict(options))
            for i, p in enumerate(prompts[w : w + concurrency])
        ]
        got, n_tokens, n_passes = run_wave(core, wave)
        outputs.update(got)
        total_tokens += n_tokens
        total_passes += n_passes
    sync(engine)
    elapsed = time.perf_counter() - start
    return {
        "kind": kind,
        "decoder": decoder,
        "concurrency": concurrency,
        "tokens": total_tokens,
        "seconds": round(elapsed, 3),
        "tok_s": round(total_tokens / elapsed, 1),
        "tokens_per_pass": round(total_tokens / max(total_passes, 1), 3),
        "outputs": outputs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--prompts",
        type=int,
        default=4,
        help="prompts per kind (code, text: at most 8; heldout: 70; at least the concurrency)",
    )
    ap.add_argument("--kinds", default="code,text", help="of code, text, heldout")
    ap.add_argument("--mask-adapter", default=None, help="default: the one shipped, if any")
    ap.add_argument("--tokens", type=int, default=48, help="max new tokens per request")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--decoders", default="ar,jacobi,lookahead,lookahead-wide")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--repeats", type=int, default=1, help="timed rounds of all; each's best")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    engine = Engine(
        EngineConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            enable_prefix_caching=False,  # each decoder pays for its own prefills
        )
    )
    card = torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu"
    print(f"# {engine.name} on {card}, {engine.dtype}, torch {torch.__version__}")
    levels = [int(c) for c in args.concurrency.split(",")]
    decoders = args.decoders.split(",")
    refine = Refine.from_config(engine, DecodersConfig(mask_adapter=args.mask_adapter))
    warm = argparse.Namespace(**{**vars(args), "prompts": 1})  # one wave
    for kind, conc, decoder in product(args.kinds.split(","), levels, decoders):
        bench(engine, refine, kind, decoder, conc, warm)  # each shape it will time, untimed
    results = []
    header = "kind  conc  decoder          tok/s   tokens/pass  speed-up  same-as-AR"
    print(header)
    for kind in args.kinds.split(","):
        for conc in levels:
            best: dict[str, dict] = {}
            for _ in range(args.repeats):  # the decoders in turn: a drifting machine moves all
                for decoder in decoders:
                    r = bench(engine, refine, kind, decoder, conc, args)
                    if decoder not in best or r["tok_s"] > best[decoder]["tok_s"]:
                        best[decoder] = r
            base = best[decoders[0]]
            for decoder in decoders:
                r = best[decoder]
                r["speedup"] = round(r["tok_s"] / base["tok_s"], 2)
                same = sum(r["outputs"][k] == base["outputs"][k] for k in base["outputs"])
                r["same_as_ar"] = f"{same}/{len(base['outputs'])}"
                print(
                    f"{kind:5} {conc:4}  {decoder:15} {r['tok_s']:7.1f}"
                    f"  {r['tokens_per_pass']:11.2f}  {r['speedup']:7.2f}x  {r['same_as_ar']}",
                    flush=True,
                )
                results.append(r)
    if args.json:
        meta = {"model": engine.name, "card": card, "dtype": str(engine.dtype), "args": vars(args)}
        for r in results:
            r.pop("outputs")
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
