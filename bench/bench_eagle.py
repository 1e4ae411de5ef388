"""EAGLE drafting on held-out prompts: accepted length, speed against AR, equality with AR.

Held-out prompts are loadtest's built-in ones plus `bench/data/heldout_prompts.jsonl`, none of
them from the generator the shipped head was trained on. `--prompt-set training` takes as many
prompts from that generator instead (`stride.train.prompts.builtin_prompts`, seed 0): the gap
between the two accepted lengths is how far the head falls off outside its training prompts;
`--prompt-set FILE` reads a JSONL file (`bench/data/test_prompts.jsonl`: a second held-out set).
Every request decodes greedily, or with `--temperature`, request i seeded with i; each
configuration's outputs are compared with AR's token for token (exact in fp32 where greedy, and
for sampled trees, whose tokens are the target's seeded draws; bf16 may differ by rounding).
Two parts:

- acceptance: all prompts at once, each configuration's mean accepted length: tokens committed
  per verification pass that checked drafts (the accepted drafts plus the target's own token);
- speed: at each concurrency, the first `c` prompts in flight at once, output tok/s (prefill
  included) against AR run before and after in the same process; on a GPU `--busy` adds each
  one's share of wall time with a kernel running (a profiled run of its own, every kernel an
  event: use a few prompts): below 1, the device waited for the host. The prompts run in
  groups of `c` (all in flight at once, the next group after the last ends), or with
  `--closed-loop` as `stride serve` sees traffic: `c` in flight, each end followed by an arrival.

On a GPU it then times one device cycle (its CUDA graph replayed alone, `--context` tokens in)
of chains and of trees of 64 and 128 verified rows (and of each "tree N dD kK" configuration
named) at batch 1, 2, 4 and 8, against one plain decode step (the decode graph) at the same
batch and context: `--cycles-only` does just that.

    python bench/bench_eagle.py --device cpu --concurrency 1 --json eagle-cpu.json
    python bench/bench_eagle.py --device cuda --concurrency 1 8 64 --json eagle-h100.json
    python bench/bench_eagle.py --device cuda --cycles-only --json eagle-cycles.json
    python bench/bench_eagle.py --device cuda --concurrency 1 8 --configs "tree 32 d4 k8"
    python bench/bench_eagle.py --device cpu --temperature 0.7 --configs "chain K=5" "tree 64"
    python bench/bench_eagle.py --device cuda --concurrency 8 --speed-prompts 32 --closed-loop
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.prompts import BUILTIN_PROMPTS  # noqa: E402
from stride.decoders import draw_kernels  # noqa: E402
from stride.decoders.registry import DecodersConfig, build_decoders  # noqa: E402
from stride.decoders.speculative import draws  # noqa: E402
from stride.decoders.speculative.device_tree import TreeShape  # noqa: E402
from stride.engine.config import EngineConfig  # noqa: E402
from stride.engine.engine import Engine  # noqa: E402
from stride.engine.sequence import SamplingParams  # noqa: E402
from stride.scheduler.core import EngineCore  # noqa: E402
from stride.scheduler.outputs import GenerateRequest  # noqa: E402
from stride.scheduler.policy import SchedulerConfig  # noqa: E402
from stride.train.data import render  # noqa: E402
from stride.train.prompts import builtin_prompts, read_prompts  # noqa: E402

HELDOUT = Path(__file__).parent / "data" / "heldout_prompts.jsonl"
CONFIGS = {
    "chain K=4": {"num_speculative_tokens": 4, "adaptive": False},
    "chain K=5": {"num_speculative_tokens": 5, "adaptive": False},
    "chain K=6": {"num_speculative_tokens": 6, "adaptive": False},
    "tree 16": {"num_speculative_tokens": 5, "tree_nodes": 16, "tree_topk": 4, "adaptive": False},
    "tree 32": {"num_speculative_tokens": 6, "tree_nodes": 32, "tree_topk": 6, "adaptive": False},
    "tree 64": {"num_speculative_tokens": 7, "tree_nodes": 64, "tree_topk": 8, "adaptive": False},
    "tree 128": {
        "num_speculative_tokens": 8, "tree_nodes": 128, "tree_topk": 10, "adaptive": False
    },
    "chain K=1": {"num_speculative_tokens": 1, "adaptive": False},
    "chain K=2": {"num_speculative_tokens": 2, "adaptive": False},
    "chain K=3": {"num_speculative_tokens": 3, "adaptive": False},
    "default": {},  # what {"draft": "eagle"} gets: adaptive, the loop policy's choice on a GPU
}


def named(name: str) -> str:
    """A configuration's name, checked: one of `CONFIGS`, or "tree N dD kK" (N drafts, D levels,
    K children per expanded node, not adaptive), which it adds to `CONFIGS` and `SHAPES`."""
    if name not in CONFIGS:
        parts = name.split()
        if (len(parts) != 4 or parts[0] != "tree" or not parts[1].isdigit()
                or not re.fullmatch(r"d\d+", parts[2]) or not re.fullmatch(r"k\d+", parts[3])):
            raise argparse.ArgumentTypeError(f"{name!r}: one of {list(CONFIGS)} or 'tree N dD kK'")
        nodes, depth, topk = int(parts[1]), int(parts[2][1:]), int(parts[3][1:])
        CONFIGS[name] = {"num_speculative_tokens": depth, "tree_nodes": nodes, "tree_topk": topk,
                         "adaptive": False}  # fmt: skip
        SHAPES[name] = TreeShape.of(nodes, depth, topk)
    return name


def run(
    core: EngineCore,
    prompts: list[list[int]],
    tokens: int,
    decoder: str,
    options: dict,
    temperature: float = 0.0,
    in_flight: int | None = None,
):
    """All prompts in flight at once, or `in_flight` of them, each request's end followed by
    the next one's arrival (a closed loop of users, as `stride serve` sees them); (seconds,
    outputs, summed decoder stats). Sampled (`temperature`): request i seeded with i."""
    todo = list(enumerate(prompts))

    def arrive() -> None:
        i, p = todo.pop(0)
        params = SamplingParams(max_tokens=tokens, temperature=temperature,
                                seed=i if temperature else None)  # fmt: skip
        core.add(GenerateRequest(str(i), p, params, decoder, {"draft": "eagle", **options}
                                 if decoder == "speculative" else {}))  # fmt: skip

    for _ in range(min(in_flight or len(todo), len(todo))):
        arrive()
    outs: dict[str, list[int]] = {}
    stats = {"drafts": 0, "accepted_tokens": 0, "draft_tokens": 0, "forward_passes": 0}
    sync = torch.cuda.synchronize if core.engine.device.type == "cuda" else lambda: None
    sync()
    start = time.perf_counter()
    while core.has_work:
        for out in core.step():
            outs.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                for key in stats:
                    stats[key] += out.decoder_stats.get(key, 0)
                if todo:
                    arrive()
    sync()
    return time.perf_counter() - start, outs, stats


def timed(
    core,
    groups: list[list[list[int]]],
    tokens: int,
    decoder: str,
    options: dict,
    temperature: float = 0.0,
):
    """Each group of prompts in flight at once, one group after another: (tok/s, outputs, the
    summed stats)."""
    seconds, made, outs = 0.0, 0, []
    stats = {"drafts": 0, "accepted_tokens": 0}
    for group in groups:
        secs, out, st = run(core, group, tokens, decoder, options, temperature)
        seconds += secs
        made += sum(map(len, out.values()))
        outs.append(out)
        for key in stats:
            stats[key] += st[key]
    return made / seconds, outs, stats


def policy_view(core: EngineCore) -> dict:
    """What the speculative policies know after a run, per batch-size bucket (`costs.bucket`):
    the plain step the loop is priced against, the host's share beside the device time of
    bursts in a row, and each loop shape's measured cycle (ms, and tokens per sequence): where
    an adaptive request's choices come from."""
    spec = core.decoders.decoders["speculative"]
    view: dict = {}
    for key, timings in sorted(spec.policy.seen.timings.items()):
        if timings.plain_s is not None:
            view.setdefault(f"bucket {key}", {})["plain_ms"] = round(timings.plain_s * 1e3, 3)
    for key, share in sorted(spec.loop.host_share.items()):
        view.setdefault(f"bucket {key}", {})["host_share"] = round(share, 3)
    for (key, shape), rate in sorted(spec.loop.rates.items(), key=lambda kv: kv[0][0]):
        name = f"chain K={shape.depth}" if shape.is_chain else f"tree {shape.nodes} rows"
        view.setdefault(f"bucket {key}", {})[name] = {
            "cycle_ms": round(rate.seconds * 1e3, 3), "tokens": round(rate.tokens, 2)}  # fmt: skip
    return view


def speed(
    core,
    encoded,
    conc: int,
    tokens: int,
    requests: int,
    configs: list[str],
    busy: bool = False,
    temperature: float = 0.0,
    closed: bool = False,
) -> dict:
    """Output tok/s of each configuration against AR at `conc`, AR timed before and after each
    configuration and each compared with the mean of the two beside it (a machine whose speed
    drifts within a run moves both alike); with `busy`, also the share of a further run's wall
    time in which the GPU runs a kernel. `closed`: c in flight, an arrival at each end (`run`)."""
    runs = max(1, requests // conc)
    groups = [[encoded[(r * conc + i) % len(encoded)] for i in range(conc)] for r in range(runs)]
    prompts = [p for group in groups for p in group]

    def measure(decoder: str, options: dict, t: float = temperature):
        if closed:
            secs, outs, stats = run(core, prompts, tokens, decoder, options, t, conc)
            return sum(map(len, outs.values())) / secs, [outs], stats
        return timed(core, groups, tokens, decoder, options, t)

    first, ref, _ = measure("ar", {})
    ars, rows, shares = [first], {}, {}
    for name in configs:  # each run once untimed: its graphs captured, its policy settled
        measure("speculative", CONFIGS[name])
        rows[name] = measure("speculative", CONFIGS[name])
        if busy:
            shares[name] = busy_share(lambda n=name: measure("speculative", CONFIGS[n], 0.0))
        ars.append(measure("ar", {})[0])
    base = sum(ars) / len(ars)
    entry: dict = {"concurrency": conc, "ar_tok_s": round(base, 1), "configs": {}}
    if busy:
        entry["ar_gpu_busy"] = busy_share(lambda: measure("ar", {}, 0.0))
        print(f"c={conc} ar: gpu_busy {entry['ar_gpu_busy']}", flush=True)
    for i, (name, (rate, outs, stats)) in enumerate(rows.items()):
        beside = (ars[i] + ars[i + 1]) / 2
        entry["configs"][name] = {
            "tok_s": round(rate, 1),
            "ar_tok_s": round(beside, 1),
            "speedup": round(rate / beside, 3),
            "accepted_length": round(accepted_length(stats), 3),
            "same_as_ar": all(o == r for o, r in zip(outs, ref, strict=True)),
        }
        if busy:
            entry["configs"][name]["gpu_busy"] = shares[name]
        print(f"c={conc} {name}: {entry['configs'][name]}", flush=True)
    if any(CONFIGS[name].get("adaptive", True) for name in configs):
        entry["policy"] = policy_view(core)  # (after every configuration: a shared policy)
        print(f"c={conc} policy: {entry['policy']}", flush=True)
    return entry


def busy_share(work) -> float:
    """The share of `work()`'s wall time in which some kernel runs on the GPU (below 1: the
    device waits for the host), from a profile of its CUDA activity (which slows the host a
    little: a run of its own, not a timed one)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        start = time.perf_counter()
        work()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type.name == "CUDA")  # fmt: skip
    return round(busy_us(spans) / 1e6 / wall, 3)


def busy_us(spans: list[tuple[float, float]]) -> float:
    """The length of the union of sorted (start, end) intervals: the device's busy µs."""
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


# Device cycles timed: chains, and trees of 64 and 128 verified rows (the root and 63 or 127
# drafts) at the depth and width of the "tree 64" and "tree 128" configurations.
SHAPES = {
    "chain K=3": TreeShape.chain(3),
    "sampled chain K=3": TreeShape.chain(3, sampled=True),  # temperature (and min-p) alone
    "sampled chain K=3, top-k": TreeShape.chain(3, True, draw_kernels.TOP_MAX),
    "sampled chain K=3, top-p": TreeShape.chain(3, True, draws.RANK_ALL),
    "chain K=5": TreeShape.chain(5),
    "tree 64 rows": TreeShape.of(63, 7, 8),
    "tree 128 rows": TreeShape.of(127, 8, 10),
    "sampled tree 64 rows": TreeShape.of(63, 7, 8, sampled=True),
    "sampled tree 64 rows, top-p": TreeShape.of(63, 7, 8, True, draws.RANK_ALL),
}


def cycle_costs(core: EngineCore, context: int) -> dict:
    """GPU ms of one plain decode step and of one cycle of each of `SHAPES` (graphs replayed
    alone, `context` tokens in), and each cycle's cost in plain steps, at batch 1, 2, 4, 8."""
    cycles = core.decoders["speculative"].eagle.cycles
    graphs = core.engine.runner.graphs
    bs = core.engine.cache.block_size
    out: dict = {}
    for b in (1, 2, 4, 8):
        width = -(-(context + 1) // bs)
        tables = [list(range(1 + i * width, 1 + (i + 1) * width)) for i in range(b)]
        graphs.run([1] * b, [context] * b, [context + 1] * b, tables)  # packs the inputs
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            graphs.replay(b)
        end.record()
        end.synchronize()
        plain = start.elapsed_time(end) / 50
        entry = {"plain step": round(plain, 3)}
        for name, shape in SHAPES.items():
            ms = cycles.replay_ms(b, shape, context)
            entry[name] = round(ms, 3)
            entry[f"{name} / plain"] = round(ms / plain, 2)
        out[f"batch {b}"] = entry
        print(f"GPU ms per cycle, batch {b}, context {context}: {entry}", flush=True)
    return out


def cycle_profile(core: EngineCore, context: int, repeats: int = 5) -> dict:
    """Where a batch-1 cycle's GPU time goes: the kernels of `repeats` graph replays of each of
    `SHAPES` (torch.profiler), the 12 costliest by total time, and kernels per cycle."""
    from torch.profiler import ProfilerActivity, profile

    cycles = core.decoders["speculative"].eagle.cycles
    out: dict = {}
    for name, shape in SHAPES.items():
        cycles.replay_ms(1, shape, context, repeats=1)  # (captured before profiling)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            cycles.replay_ms(1, shape, context, repeats=repeats)
        kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
        count = sum(e.count for e in kernels) / (repeats + 1)  # (replay_ms replays once more)
        top = {e.key[:80]: round(e.self_device_time_total / 1e3 / (repeats + 1), 4)
               for e in kernels[:12]}  # fmt: skip
        out[name] = {"kernels per cycle": round(count), "ms per cycle, costliest": top}
        print(f"batch 1, {name}: {round(count)} kernels a cycle; ms a cycle: {top}", flush=True)
    return out


def accepted_length(stats: dict) -> float:
    """Tokens per verification pass that checked drafts (each commits its accepted + 1)."""
    return (stats["accepted_tokens"] + stats["drafts"]) / max(stats["drafts"], 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="target (default: the embedded SmolLM2-135M)")
    ap.add_argument("--draft-head", default=None, help="EAGLE head (default: the shipped one)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1])
    ap.add_argument("--speed-prompts", type=int, default=8, help="requests per speed run")
    ap.add_argument(
        "--configs",
        nargs="+",
        type=named,
        default=list(CONFIGS),
        help="names of CONFIGS, or 'tree N dD kK' (its cycle is timed too)",
    )
    ap.add_argument("--skip-acceptance", action="store_true")
    ap.add_argument("--busy", action="store_true", help="GPU: share of a run with a kernel running")
    ap.add_argument("--closed-loop", action="store_true",
                    help="speed: c in flight, an arrival at each end")  # fmt: skip
    ap.add_argument("--cycles-only", action="store_true", help="GPU: time device cycles only")
    ap.add_argument("--context", type=int, default=512, help="cycle timing: tokens in context")
    ap.add_argument("--profile", action="store_true", help="with --cycles-only: kernels per cycle")
    ap.add_argument("--prompt-set", default="heldout",
                    help="heldout, training, or a JSONL file of prompts")  # fmt: skip
    ap.add_argument("--kv-gib", type=float, default=2.0)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample (request i seeded with i); 0: greedy")  # fmt: skip
    ap.add_argument(
        "--fused-decode-steps",
        type=int,
        default=None,
        help="passes per host sync (1: no device cycles; default: the server's)",
    )
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args()

    engine = Engine(
        EngineConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            kv_cache_memory=int(args.kv_gib * (1 << 30)),
            enable_prefix_caching=False,  # each configuration pays for its own prefills
        )
    )
    decoders = build_decoders(engine, DecodersConfig(draft_head=args.draft_head))
    # Room for every prompt's whole tree in one step: a tighter token budget would shrink the
    # trees of the sequences scheduled last, and the acceptance measured with them.
    scheduler = SchedulerConfig(
        fused_decode_steps=args.fused_decode_steps, max_num_batched_tokens=16384
    )
    core = EngineCore(engine, scheduler, decoders)
    tok = engine.tokenizer
    prompts = [[{"role": "user", "content": p}] for p in BUILTIN_PROMPTS] + read_prompts(HELDOUT)
    if args.prompt_set == "training":
        prompts = builtin_prompts(len(prompts), seed=0)
    elif args.prompt_set != "heldout":
        prompts = read_prompts(Path(args.prompt_set))
    encoded = [render(tok, p) for p in prompts]
    card = (
        torch.cuda.get_device_name(engine.device)
        if engine.device.type == "cuda"
        else f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"
    )
    result: dict = {
        "card": card,
        "date": date.today().isoformat(),
        "command": "python bench/bench_eagle.py " + " ".join(sys.argv[1:]),
        "model": engine.name,
        "dtype": str(engine.dtype),
        "tokens": args.tokens,
        "prompts": len(encoded),
        "prompt_set": args.prompt_set,
        "temperature": args.temperature,
    }
    print(f"{engine.name} on {card}, {engine.dtype}: {len(encoded)} {args.prompt_set} prompts")
    run(core, encoded[:2], 8, "speculative", CONFIGS["chain K=5"])  # warm-up
    if not args.skip_acceptance and not args.cycles_only:
        t = args.temperature
        _, ref, _ = run(core, encoded, args.tokens, "ar", {}, t)
        result["acceptance"] = {}
        for name in args.configs:
            _, outs, stats = run(core, encoded, args.tokens, "speculative", CONFIGS[name], t)
            same = sum(outs[k] == ref[k] for k in ref)
            entry = {"accepted_length": round(accepted_length(stats), 3), "same_as_ar": same,
                     "drafts": stats["drafts"]}  # fmt: skip
            result["acceptance"][name] = entry
            print(f"acceptance {name}: {entry}", flush=True)
    if not args.cycles_only:
        result["speed"] = [
            speed(core, encoded, conc, args.tokens, args.speed_prompts, args.configs,
                  args.busy and engine.device.type == "cuda", args.temperature,
                  args.closed_loop)  # fmt: skip
            for conc in args.concurrency
        ]
    # The device's share of a cycle (the rest is the host's). Not after `--busy`'s profiled runs,
    # after which it has ended in a device-side assert (BENCHMARKS: "Cycles per burst").
    if engine.device.type == "cuda" and not args.busy:
        result["cycle_gpu_ms"] = cycle_costs(core, args.context)
        if args.profile:
            result["cycle_profile"] = cycle_profile(core, args.context)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
