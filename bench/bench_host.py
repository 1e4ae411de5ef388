"""Host (Python) cost of one engine step at high concurrency, on the CPU, model compute removed.

On a GPU a decode step's graph replays in a few ms; what the step loop does around it in Python
(schedule, pack inputs, sample, detokenize, stop checks, outputs) is pure host time. Here the
tiny random model runs the prefill eagerly, and decode steps go through the CUDA-graph path's
input packing with the replay replaced by a fixed logits tensor, so a decode step's wall time is
the host overhead alone.

    python bench/bench_host.py --concurrency 256 [--profile]
    python bench/bench_host.py --concurrency 64 --decoder ar speculative:ngram \
        speculative:early_exit
    python bench/bench_host.py --concurrency 64 --model default --schema bounded
    python bench/bench_host.py --concurrency 256 --temperature 1 --top-k 50 --top-p 0.95
    python bench/bench_host.py --concurrency 256 --logprobs 5
    python bench/bench_host.py --concurrency 1 --decoder refine:introspective --k 3

`--schema` constrains every request to one of bench_constrained's JSON schemas; the token
masks' cost depends on the vocabulary, so it wants the default model (its 49,152 tokens).
`--temperature` (with `--top-k`, `--top-p`) samples: the draw's tensor ops run on the CPU
here, where a GPU would only launch their kernels. `refine:introspective` runs with a random
MASK-slot adapter, its passes packed for the adapted graphs as on a GPU (`--k`: its slots, a
pass every step).

With several decoders, each runs in turn on a fresh engine and a table compares their host µs
per step. Speculative runs use the adaptive policy with a GPU's saturation (256 tokens) unless
told otherwise, so that it weighs drafting as it would on the GPU; with the replay removed,
whatever a speculative step costs beyond an `ar` step is the decoder's own host work.

How each decode step was launched tells how much of that host work a GPU would overlap: "fed"
launches were queued before the launch they continue was committed, fed its last tokens on the
device ("picked": minus the rows of finished sequences), and steps that kept their launch in
flight let the next step's host work (commit, detokenize, schedule, pack) overlap the device;
the rest leave the device idle while the host works. The decode graphs' replay is replaced by a
fixed logits tensor, but everything around it runs as on a GPU: packing, and in a burst the
argmax (a CPU argmax here, ~0.2 ms at 256 rows, a kernel there) fed to the next step by
`run_steps`.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_constrained import STRINGS, schema  # noqa: E402

from stride.decoders.refine import Refine  # noqa: E402
from stride.decoders.registry import build_decoders  # noqa: E402
from stride.decoders.speculative import Speculative  # noqa: E402
from stride.engine.adapter import MaskAdapter  # noqa: E402
from stride.engine.config import EngineConfig  # noqa: E402
from stride.engine.cuda_graphs import MASK_WIDTH, TABLE, DecodeGraphs  # noqa: E402
from stride.engine.engine import Engine  # noqa: E402
from stride.engine.runner import MAX_GRAPH_QUERY  # noqa: E402
from stride.engine.sequence import SamplingParams  # noqa: E402
from stride.scheduler.core import EngineCore  # noqa: E402
from stride.scheduler.outputs import GenerateRequest  # noqa: E402
from tests.helpers.models import make_model_dir  # noqa: E402

MAX_FUSED_STEPS = 16


class HostGraphs(DecodeGraphs):
    """DecodeGraphs' host side (packing into the input array) with no device and no replay."""

    def __init__(self, cache, vocab: int, max_batch: int = 256, max_blocks: int = 64) -> None:
        self.cache = cache
        self.max_blocks = max_blocks
        self.buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= max_batch]
        width = TABLE + max_blocks
        self._host = torch.zeros(max_batch, width, dtype=torch.int32)
        self._host_np = self._host.numpy()
        self._inputs = torch.zeros(max_batch, width, dtype=torch.int32)
        self._logits = torch.randn(max_batch, vocab, generator=torch.Generator().manual_seed(0))
        # `run_steps`' per-step input arrays, allocated up front (unpinned: no device here);
        # each fused step's tokens are the argmax of the fixed logits.
        steps = torch.zeros(MAX_FUSED_STEPS * max_batch, width, dtype=torch.int32)
        self._steps_host, self._steps_inputs = steps, steps.clone()
        self._copied = _NoEvent()
        self._graphs = defaultdict(_NoGraph)  # every (bucket, aux, layout), none replayed
        self.adapted = True  # spans with MASK slots are packed as rows too
        self._masks_host = torch.zeros(max_batch, MASK_WIDTH, dtype=torch.bool)
        self._masks = self._masks_host.clone()


class _NoEvent:
    def synchronize(self) -> None:
        pass

    def record(self) -> None:
        pass


class _NoGraph:
    def replay(self) -> None:
        pass


def run(args: argparse.Namespace, decoder: str) -> dict[str, Any]:
    """Prefill `concurrency` requests decoded by `decoder`, then time every decode step."""
    model = None if args.model == "default" else str(make_model_dir(Path(tempfile.mkdtemp()) / "t"))
    engine = Engine(EngineConfig(model=model, device="cpu", dtype="float32", max_model_len=1024))
    vocab = engine.hf_config.vocab_size
    # Rows for a draft-scoring step too (a graph row per scored token), as on the GPU.
    rows = max(args.concurrency, MAX_GRAPH_QUERY)
    engine.runner.graphs = HostGraphs(engine.cache, vocab, rows)
    decoders = build_decoders(engine)
    decoders["speculative"] = Speculative(engine, saturation_tokens=args.saturation)
    name, _, variant = decoder.partition(":")
    if variant == "introspective":
        adapter = MaskAdapter.new(engine.model, rank=8, slots=4)
        engine.runner.attach_adapter(adapter)
        decoders["refine"] = Refine(adapter=adapter)
    core = EngineCore(engine, decoders=decoders)
    options: dict[str, Any] = {}
    if name == "refine":
        options = {"method": variant}  # (a window given: no payoff, always refining)
        if args.k is not None:
            options["slots" if variant == "introspective" else "window"] = args.k
    elif variant:
        options = {"draft": variant, "adaptive": args.k is None}
        if args.k is not None:
            options["num_speculative_tokens"] = args.k
    constraint = schema(args.new, args.schema) if args.schema else None
    params = SamplingParams(
        max_tokens=args.new,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        ignore_eos=True,
        constraint=constraint,
        logprobs=args.logprobs,
    )
    g = torch.Generator().manual_seed(0)
    for i in range(args.concurrency):
        ids = torch.randint(3, vocab, (args.prompt,), generator=g).tolist()
        core.add(GenerateRequest(f"r{i}", ids, params, name, dict(options)))

    while any(len(s.tail) > 1 or s.num_cached == 0 for s in core.seqs.values()):
        core.step()  # prefill (eager, real model compute): not measured
    launches = count_launches(core)
    in_flight = 0
    profiler = cProfile.Profile() if args.profile else None
    times = []
    tokens = drafted = 0
    while core.has_work:
        t0 = time.perf_counter()
        if profiler:
            profiler.enable()
        outs = core.step()
        if profiler:
            profiler.disable()
        times.append(time.perf_counter() - t0)
        in_flight += core.executor.in_flight
        tokens += sum(len(o.token_ids) for o in outs)
        drafted += sum((o.decoder_stats or {}).get("draft_tokens", 0) for o in outs)
    full = [t for t in times if t][: max(1, len(times) - 2)]
    mean = sum(full) / len(full)
    median = sorted(full)[len(full) // 2]
    print(
        f"{decoder}: {len(times)} decode steps, {tokens} tokens, concurrency "
        f"{args.concurrency}: host {mean * 1e6:.0f} us/step mean, {median * 1e6:.0f} median, "
        f"{mean * 1e6 / args.concurrency:.2f} us per sequence; {drafted} drafted; "
        f"launches: {launches['fed']} fed ({launches['picked']} picked), "
        f"{launches['burst']} other bursts, {launches['forward']} other forwards; kept in "
        f"flight by {in_flight} of {len(times)} steps; "
        f"worst {sorted((round(t * 1e6), i) for i, t in enumerate(times))[-4:]} us"
    )
    if profiler:
        pstats.Stats(profiler).sort_stats(args.sort).print_stats(25)
    return {"mean": mean, "median": median, "drafted": drafted, "in_flight": in_flight, **launches}


def count_launches(core: EngineCore) -> Counter:
    """Count launches: bursts and forwards fed on the device by a launch not yet committed
    ("picked" if they left out some of its rows), other bursts, other forwards."""
    counts: Counter = Counter({"fed": 0, "picked": 0, "burst": 0, "forward": 0})
    runner, executor = core.engine.runner, core.executor
    decode_steps, forward = runner.decode_steps, runner.forward

    def count(seqs) -> bool:
        fed = [s for s in seqs if s.pending]
        before = executor._in_flight
        counts["fed"] += bool(fed)
        counts["picked"] += bool(fed) and before is not None and len(fed) < len(before.rows)
        return bool(fed)

    def bursting(seqs, tokens, *args, **kwargs):
        counts["burst"] += not count(seqs)
        return decode_steps(seqs, tokens, *args, **kwargs)

    def forwarding(spans, *args, **kwargs):
        counts["forward"] += not count([c.seq for c in spans])
        return forward(spans, *args, **kwargs)

    runner.decode_steps, runner.forward = bursting, forwarding
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument(
        "--decoder",
        nargs="+",
        default=["ar"],
        help="ar | speculative:ngram | speculative:early_exit | refine:jacobi | refine:lookahead "
        "| refine:introspective (several: a comparison table)",
    )
    parser.add_argument("--k", type=int, help="speculative: fixed K (default: adaptive); refine: "
                        "the window, introspective's slots (default: the method's, with payoff)")
    parser.add_argument(
        "--saturation", type=float, default=256.0, help="speculative: the policy's saturation"
    )
    parser.add_argument("--model", default="tiny", choices=["tiny", "default"])
    parser.add_argument("--schema", choices=list(STRINGS), help="constrain every request")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--logprobs", type=int, help="each token's logprob and N alternatives")
    parser.add_argument("--profile", action="store_true", help="cProfile the decode steps")
    parser.add_argument("--sort", default="tottime", help="the profile's order (pstats key)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    results = [(d, run(args, d)) for d in args.decoder]
    if len(results) > 1:
        base = next((r for d, r in results if d == "ar"), None)
        print("\n| decoder | host us/step mean | median | vs ar | drafted | fed | in flight |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for d, r in results:
            ratio = f"{r['mean'] / base['mean']:.2f}x" if base else "-"
            print(
                f"| {d} | {r['mean'] * 1e6:.0f} | {r['median'] * 1e6:.0f} | {ratio} "
                f"| {r['drafted']} | {r['fed']} | {r['in_flight']} |"
            )


if __name__ == "__main__":
    main()
