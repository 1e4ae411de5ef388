"""Where a run's wall time goes: the engine's main host calls, the device's kernels, and the
device's idle time laid at the door of the host call that was open then.

A run is timed without a profiler first (`--repeats` times), then once more under
`torch.profiler` with the engine's main calls labelled (`LABELS`: a step, its schedule,
proposal, launches and commit, the EAGLE loop's bursts and the head's catch-up, graph replays,
grammar masks and checks). From that run: the device's busy time (the union of its kernels),
each labelled call's host time and count, and every gap between kernels credited to the
innermost labelled call open at its middle ("(none)": between calls). `--timeline FILE` writes
the last run's host calls and the device's busy spans (kernels less than 5 µs apart merged) in
µs from its start, one per line (`H name start duration`, `G start duration`), sorted by start.
The profiler slows the host: the shares, not the profiled wall time, carry over.

Workloads:

- `eagle`: held-out chat prompts, `ar` and a fixed EAGLE chain of `--k` drafts (greedy), the
  engine as `stride serve` builds it (prefix caching on, default budgets); `--concurrency` in
  flight, in groups, or with `--closed-loop` an arrival at each end (`bench_eagle.run`);
- `constrained`: `bench_constrained`'s random-token prompts at `--concurrency`, free and under
  its JSON schemas (`strings`, `bounded`), greedy, every request making `--tokens` tokens.

    python bench/bench_timeline.py --workload eagle --concurrency 8 --prompts 32 --closed-loop
    python bench/bench_timeline.py --workload constrained --concurrency 64 --timeline t.txt
"""

from __future__ import annotations

import argparse
import bisect
import functools
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_constrained  # noqa: E402
import bench_eagle  # noqa: E402
from bench_engine import decode, prompts  # noqa: E402

from stride.decoders import grammar  # noqa: E402
from stride.decoders.speculative import bursts, cycles, eagle  # noqa: E402
from stride.engine import runner  # noqa: E402
from stride.engine.config import EngineConfig  # noqa: E402
from stride.engine.engine import Engine  # noqa: E402
from stride.engine.sequence import SamplingParams  # noqa: E402
from stride.scheduler import core, decoder_set, executor, policy  # noqa: E402
from stride.train.data import render  # noqa: E402
from stride.train.prompts import read_prompts  # noqa: E402

LABELS = [  # (owner, attribute, label)
    (core.EngineCore, "step", "core.step"),
    (core.EngineCore, "_apply", "core.apply"),
    (core.EngineCore, "_finish", "core.finish"),
    (policy.Scheduler, "schedule", "scheduler.schedule"),
    (decoder_set.DecoderSet, "propose", "decoders.propose"),
    (executor.Executor, "_launch_forward", "executor.launch_forward"),
    (executor.Executor, "_launch_burst", "executor.launch_burst"),
    (executor.Executor, "_finish", "executor.finish"),
    (runner.ModelRunner, "forward", "runner.forward"),
    (runner.ModelRunner, "decode_steps", "runner.decode_steps"),
    (torch.cuda.CUDAGraph, "replay", "graph.replay"),
    (eagle.EagleDrafter, "_catch_up", "head.catch_up"),
    (eagle.EagleDrafter, "draft", "head.draft_host"),
    (cycles.EagleCycles, "run", "cycles.run"),
    (cycles.EagleCycles, "resume", "cycles.resume"),
    (bursts._EagleBurst, "commits", "burst.commits"),
    (grammar, "mask_logits", "grammar.mask_logits"),
    (grammar.Matcher, "take", "grammar.take"),
]
LABEL_NAMES = {label for _, _, label in LABELS}
MANY = {"core.apply", "grammar.take"}  # per sequence: counted, but left out of the timeline


def label_calls() -> None:
    """Each of `LABELS` runs inside a profiler range of its label."""
    for owner, name, label in LABELS:
        setattr(owner, name, _labelled(getattr(owner, name), label))


def _labelled(call, label: str):
    @functools.wraps(call)
    def labelled(*args, **kwargs):
        with record_function(label):
            return call(*args, **kwargs)

    return labelled


def profiled(work, device: torch.device, timeline: Path | None) -> dict:
    """One run of `work()` under the profiler: busy, host and idle time by labelled call."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        sync()
        start = time.perf_counter()
        work()
        sync()
        wall = time.perf_counter() - start
    events = prof.events()
    t0 = min(e.time_range.start for e in events)
    calls = [e for e in events if e.device_type.name == "CPU" and e.name in LABEL_NAMES]
    kernels = sorted(
        (e.time_range.start - t0, e.time_range.end - t0)
        for e in events
        if e.device_type.name == "CUDA" and e.name not in LABEL_NAMES  # (not the annotations)
    )
    busy, spans = bench_eagle.busy_us(kernels), []
    for a, b in kernels:  # (kernels less than 5 µs apart: one span)
        if spans and a <= spans[-1][1] + 5:
            spans[-1][1] = max(spans[-1][1], b)
        else:
            spans.append([a, b])
    calls.sort(key=lambda e: e.time_range.start)
    starts = [e.time_range.start for e in calls]

    def innermost(t: float) -> str:
        """The labelled call open at `t` that began last (the calls nest on one thread)."""
        i = bisect.bisect_right(starts, t) - 1
        while i >= 0 and calls[i].time_range.end < t:
            if calls[i].name == "core.step":  # (a step that ended holds every call before it)
                return "(none)"
            i -= 1
        return calls[i].name if i >= 0 else "(none)"

    idle: dict[str, float] = {}
    for (_, a), (b, _) in zip(spans, spans[1:], strict=False):  # each gap between spans
        name = innermost(t0 + (a + b) / 2)
        idle[name] = idle.get(name, 0.0) + (b - a) / 1e3
    host: dict[str, float] = {}
    counts: dict[str, int] = {}
    for e in calls:
        host[e.name] = host.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3
        counts[e.name] = counts.get(e.name, 0) + 1
    if timeline is not None:
        lines = [
            (
                e.time_range.start - t0,
                f"H {e.name} {e.time_range.start - t0:.0f} {e.time_range.elapsed_us():.0f}",
            )
            for e in calls
            if e.name not in MANY
        ]
        lines += [(a, f"G {a:.0f} {b - a:.0f}") for a, b in spans]
        timeline.write_text("".join(line + "\n" for _, line in sorted(lines)))

    def by_time(d: dict[str, float]) -> dict[str, float]:
        return {k: round(v, 2) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}

    return {"profiled_wall_ms": round(wall * 1e3, 1), "busy_ms": round(busy / 1e3, 1),
            "idle_ms_by_call": by_time(idle), "host_ms_by_call": by_time(host),
            "calls": counts}  # fmt: skip


def eagle_runs(args) -> dict:
    engine = Engine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype))
    engine_core = core.EngineCore(engine)  # (the shipped head drafts `eagle`)
    chats = [[{"role": "user", "content": p}] for p in bench_eagle.BUILTIN_PROMPTS]
    chats += read_prompts(bench_eagle.HELDOUT)
    encoded = [render(engine.tokenizer, c) for c in chats][: args.prompts]
    c = args.concurrency
    groups = [encoded[i : i + c] for i in range(0, len(encoded), c)]
    chain = {"num_speculative_tokens": args.k, "adaptive": False}
    runs = {"ar": ("ar", {}), f"chain K={args.k}": ("speculative", chain)}

    def run(decoder: str, options: dict) -> float:
        if args.closed_loop:
            return bench_eagle.run(engine_core, encoded, args.tokens, decoder, options, 0.0, c)[0]
        return sum(bench_eagle.run(engine_core, g, args.tokens, decoder, options)[0]
                   for g in groups)  # fmt: skip

    return measured(engine, runs, run, args)


def constrained_runs(args) -> dict:
    engine = Engine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                 enable_prefix_caching=False))  # fmt: skip
    engine_core = core.EngineCore(engine)
    batch = prompts(args.concurrency, 64, engine.hf_config.vocab_size, seed=args.concurrency)
    runs = {"free": None}
    for kind in bench_constrained.STRINGS:
        runs[kind] = bench_constrained.schema(args.tokens, kind)
        engine_core.intake.grammars.matcher(runs[kind])  # (compiled before timing)

    def run(constraint, tokens: int = args.tokens) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                                constraint=constraint)  # fmt: skip
        return decode(engine_core, batch, params)[1]

    return measured(engine, {k: (v,) for k, v in runs.items()}, run, args)


def measured(engine: Engine, runs: dict, run, args) -> dict:
    """Each run warmed up, timed `args.repeats` times, then profiled once."""
    results = {}
    for name, how in runs.items():
        run(*how)  # (graphs captured, policies settled)
        seconds = [round(run(*how), 4) for _ in range(args.repeats)]
        timeline = None
        if args.timeline is not None and name == list(runs)[-1]:
            timeline = args.timeline
        entry = {"seconds": seconds, **profiled(lambda how=how: run(*how), engine.device, timeline)}
        results[name] = entry
        print(name, json.dumps(entry), flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=["eagle", "constrained"], default="eagle")
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=32, help="eagle: requests a run")
    ap.add_argument("--closed-loop", action="store_true", help="eagle: an arrival at each end")
    ap.add_argument("--k", type=int, default=3, help="eagle: the chain's drafts")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens a request")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs before the profiled one")
    ap.add_argument("--timeline", type=Path, help="the last workload's run, span by span")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    label_calls()
    runs = eagle_runs(args) if args.workload == "eagle" else constrained_runs(args)
    if args.json:
        out = {"command": "python bench/bench_timeline.py " + " ".join(sys.argv[1:]), **runs}
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
