"""The cost of structured outputs: constrained against unconstrained decoding, in one run.

At each concurrency (default 1 and 64) and temperature (greedy, and sampled), the same prompts
decode the same number of tokens free, then constrained to each JSON schema (llguidance's token
mask applied in the batched sampler). Each schema is an object holding a list of strings with
at least `--new` items, so the output cannot end early and every run makes exactly the same
count of tokens: output tok/s compares like with like. Two kinds of string:

- `strings`: free strings, llguidance's fast case: a string's mask comes mostly from slices of
  the vocabulary computed once per tokenizer;
- `bounded`: strings of at most 12 characters (`maxLength`, as a pydantic `constr(max_length=)`
  sends): near its bound a string's mask walks the whole token trie.

Free requests may take the device's bursts; constrained ones join them where their draws can
be checked token by token as they commit (greedy, or sampled without truncation:
`sampling.checked_alone`), each refused token dropped with what launches in flight made from
it, and replaced by the token the mask allows alone where the grammar forces text, else drawn
again under the mask; a token that broke the grammar would fail its request, and the run.
Grammars are compiled once, before timing (`compile_ms`); the repeats take the kinds in turn,
so that a machine that drifts (single runs here last a fraction of a second) slows every kind
alike, and each kind's best run is reported. Each run also counts its engine steps
(`<kind>_steps`, the last repeat's): what refused tokens cost in steps, apart from what each
step costs the host. `--profile` runs each kind once more at the last concurrency under
cProfile: its launches by kind (decode bursts, forwards) and its costliest functions by own
time (`--sort cumulative`: by time under them), where a GPU's wait for the device shows as
the synchronising call's.

    python bench/bench_constrained.py --model ./SmolLM2-135M-Instruct.Q4_1.gguf --json OUT
    python bench/bench_constrained.py --device cpu --concurrency 1,4 --new 16  # a quick check
    python bench/bench_constrained.py --device cuda --concurrency 64 --temperatures 0 --profile
    python bench/bench_constrained.py --device cuda --concurrency 64 --profile --sort cumulative
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import decode, prompts  # noqa: E402

from stride.engine.config import EngineConfig  # noqa: E402
from stride.engine.engine import Engine  # noqa: E402
from stride.engine.sequence import Constraint, SamplingParams  # noqa: E402
from stride.scheduler.core import EngineCore  # noqa: E402

STRINGS = {"strings": {"type": "string"}, "bounded": {"type": "string", "maxLength": 12}}


def schema(new: int, kind: str) -> Constraint:
    """An object holding a list of `kind` strings, with more items than `new` tokens can
    write: the grammar never lets the output end early."""
    notes = {"type": "array", "items": STRINGS[kind], "minItems": new}
    spec = {"type": "object", "properties": {"notes": notes}, "required": ["notes"]}
    return Constraint("json_schema", json.dumps(spec))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model directory, hub id or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", default="1,64")
    parser.add_argument("--temperatures", default="0,1", help="0: greedy")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--new", type=int, default=128, help="new tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each; the best")
    parser.add_argument("--schemas", default=",".join(STRINGS), help="of: " + ", ".join(STRINGS))
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--profile", action="store_true", help="cProfile a run of each kind")
    parser.add_argument("--sort", default="tottime", help="the profile's order (pstats key)")
    parser.add_argument("--lines", type=int, default=20, help="the profile's lines")
    args = parser.parse_args()

    engine = Engine(
        EngineConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            kv_cache_memory=None,
            enable_prefix_caching=False,  # free and constrained runs pay for their own prefills
        )
    )
    core = EngineCore(engine)
    vocab = engine.hf_config.vocab_size
    constraints = {kind: schema(args.new, kind) for kind in args.schemas.split(",")}
    compile_ms = {}
    for kind, constraint in constraints.items():
        t0 = time.perf_counter()
        core.intake.grammars.matcher(constraint)  # (the first waits for the tokenizer's trie)
        compile_ms[kind] = round((time.perf_counter() - t0) * 1e3, 1)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    print(f"model {engine.name} on {engine.device} ({engine.dtype}), prompt {args.prompt}, "
          f"new {args.new}, grammars compiled in {compile_ms} ms")  # fmt: skip

    steps = [0]  # engine steps so far: a refused token costs its row steps, not only time
    step = core.step

    def counted() -> list:
        steps[0] += 1
        return step()

    core.step = counted
    results = []
    for temperature in temperatures:
        for c in concurrencies:
            batch = prompts(c, args.prompt, vocab, seed=c)
            row = {"concurrency": c, "temperature": temperature}
            kinds = {name: SamplingParams(max_tokens=args.new, temperature=temperature, seed=0,
                                          ignore_eos=True, constraint=given)
                     for name, given in (("free", None), *constraints.items())}  # fmt: skip
            for params in kinds.values():
                decode(core, batch[:2], replace(params, max_tokens=4))  # warm-up
            best: dict[str, float] = {}
            for _ in range(args.repeats):  # the kinds in turn: a drift of the machine hits all
                for name, params in kinds.items():
                    before = steps[0]
                    tokens, seconds = decode(core, batch, params)
                    if tokens != c * args.new:
                        raise RuntimeError(f"{name}: {tokens} tokens, not {c * args.new}")
                    best[name] = min(best.get(name, seconds), seconds)
                    row[f"{name}_steps"] = steps[0] - before  # (the last repeat's)
            for name, seconds in best.items():
                row[f"{name}_tok_s"] = round(c * args.new / seconds, 1)
            line = f"temperature {temperature:g}, concurrency {c:3d}: free {row['free_tok_s']:9.1f}"
            for kind in constraints:
                row[f"{kind}_slowdown"] = round(row["free_tok_s"] / row[f"{kind}_tok_s"] - 1, 4)
                line += (f", {kind} {row[f'{kind}_tok_s']:9.1f} ({row[f'{kind}_slowdown']:+.1%}, "
                         f"{row[f'{kind}_steps']} steps against {row['free_steps']})")  # fmt: skip
            results.append(row)
            print(line + " tok/s", flush=True)
        if args.profile:
            for name, given in (("free", None), *constraints.items()):
                params = SamplingParams(max_tokens=args.new, temperature=temperature, seed=0,
                                        ignore_eos=True, constraint=given)  # fmt: skip
                label = f"temperature {temperature:g}, {c} streams, {name}"
                profile(core, batch, params, label, args.sort, args.lines)

    if args.json:
        cuda = engine.device.type == "cuda"
        out = {
            "bench": "constrained",
            "model": engine.name,
            "device": str(engine.device),
            "gpu": torch.cuda.get_device_name(engine.device) if cuda else None,
            "dtype": str(engine.dtype),
            "torch": torch.__version__,
            "prompt": args.prompt,
            "new": args.new,
            "repeats": args.repeats,
            "schemas": {kind: json.loads(c.spec) for kind, c in constraints.items()},
            "compile_ms": compile_ms,
            "results": results,
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


def profile(
    core: EngineCore,
    batch: list[list[int]],
    params: SamplingParams,
    label: str,
    sort: str = "tottime",
    lines: int = 20,
) -> None:
    """One run of `batch` under cProfile: its launches by kind and sequences, and the first
    `lines` functions in `sort`'s order."""
    runner = core.engine.runner
    launches: Counter = Counter()
    plain = {"decode_steps": runner.decode_steps, "forward": runner.forward}

    def counting(kind: str):
        def launch(rows, *args, **kwargs):
            launches[kind] += 1
            launches[f"{kind} sequences"] += len(rows)
            return plain[kind](rows, *args, **kwargs)

        return launch

    runner.decode_steps, runner.forward = counting("decode_steps"), counting("forward")
    profiler = cProfile.Profile()
    try:
        profiler.enable()
        tokens, seconds = decode(core, batch, params)
        profiler.disable()
    finally:
        runner.decode_steps, runner.forward = plain["decode_steps"], plain["forward"]
    print(f"profile, {label}: {tokens} tokens in {seconds:.3f} s, launches {dict(launches)}")
    pstats.Stats(profiler).sort_stats(sort).print_stats(lines)


if __name__ == "__main__":
    main()
