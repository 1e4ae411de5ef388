"""EAGLE's device loop as the speculative decoder's bursts: which steps may run as cycles on
the device (`cycles.EagleCycles`), in which shape (a request's fixed one, or for adaptive
requests the loop policy's choice, `loop_policy`), and their commits."""

from __future__ import annotations

import time
from typing import Protocol

from stride.decoders import sampling
from stride.decoders.base import Burst, Commit
from stride.decoders.catalog import EAGLE
from stride.decoders.speculative.cycles import CycleResult
from stride.decoders.speculative.device_tree import TreeShape
from stride.decoders.speculative.eagle import EagleDrafter
from stride.decoders.speculative.layout import reach
from stride.decoders.speculative.loop_policy import Choice, LoopPolicy, Spent, menu
from stride.decoders.speculative.policy import AdaptivePolicy, SeqState, StepPlans
from stride.engine.engine import Engine
from stride.engine.kv_cache import OutOfBlocks
from stride.engine.sequence import Sequence, Status


class Speculative(Protocol):
    """What a burst needs of the speculative decoder (`decoder.Speculative`)."""

    engine: Engine
    eagle: EagleDrafter | None
    policy: AdaptivePolicy
    loop: LoopPolicy
    plans: StepPlans

    def state(self, seq: Sequence) -> SeqState: ...

    def in_loop(self, seq: Sequence) -> bool: ...

    def record(self, seq: Sequence, state: SeqState, drafted: int, accepted: int) -> None: ...

    def committed(self) -> None: ...

    def plain_epoch(self, seq: Sequence) -> bool: ...

    def measure(
        self, seqs: list[Sequence], commits: list[Commit], launch_s: float | None
    ) -> None: ...


def loop_shape(seq: Sequence, state: SeqState, eagle: EagleDrafter) -> TreeShape | None:
    """What `seq` drafts with the head this step, as the device loop's shape (None: nothing,
    or not with the head). A request of a fixed K drafts its own chain or tree, not what the
    step reserved for it, which its last tokens trim: the loop reserves its own slots, runs
    no more cycles than the longest sequence needs, and a commit keeps nothing past a request's
    end (as after an EOS), so a batch keeps one shape, and its loop, to each request's end.
    An adaptive request drafts what the policy chose for this step."""
    options = seq.decoder_options
    if options["draft"] != EAGLE:
        return None
    if options["adaptive"]:
        if not state.reserved:
            return None
        k = state.depth if options.get("tree_nodes") else state.reserved
    elif eagle.available(seq, 1):
        k = options["num_speculative_tokens"]
    else:
        return None
    if not options.get("tree_nodes") or not seq.params.greedy:  # (sampled rows draft chains)
        return TreeShape.chain(k, sampled=not seq.params.greedy)
    return TreeShape.of(max(options["tree_nodes"], k), k, options["tree_topk"])


def runnable(seq: Sequence) -> bool:
    """Can the device loop run `seq` now? Only a row drawn on the device with nothing for the
    host between two tokens: the loop accepts on the device (the argmax, or the rejection rule
    for sampled rows) and hands nothing else back (no logprobs)."""
    return seq.params.logprobs is None and sampling.on_device(seq)


def batch_menu(seqs: list[Sequence]) -> tuple[TreeShape, ...] | None:
    """The shapes the loop may run a batch of adaptive requests in (`loop_policy.menu`; the
    sampled chain alone where some row samples), or None where their menus differ."""
    sampled = not all(s.params.greedy for s in seqs)
    options = seqs[0].decoder_options
    if all(s.decoder_options == options for s in seqs):
        return menu(options, sampled)
    menus = {menu(s.decoder_options, sampled) for s in seqs}  # (a sampled row has no tree)
    return menus.pop() if len(menus) == 1 else None


def _one_shape(shapes: set[TreeShape | None]) -> TreeShape | None:
    """The shape a batch's sequences share, if any: chains of one length where some rows
    sample are the sampled chain (its greedy rows accept their argmax under it)."""
    known = {s for s in shapes if s is not None}
    if len(known) < len(shapes):
        return None
    if len(known) == 1:
        return known.pop()
    depths = {s.depth for s in known}
    if len(depths) > 1 or not all(s.is_chain for s in known):
        return None
    return TreeShape.chain(depths.pop(), sampled=True)


def _loop_choice(spec: Speculative, seqs: list[Sequence]) -> Choice | None:
    """The loop policy's shape for a batch of adaptive EAGLE requests with the same menu."""
    shapes = batch_menu(seqs)
    if shapes is None:
        return None
    policy, batch = spec.policy, len(seqs)
    return spec.loop.choose(batch, shapes, policy.plain_seconds(batch), policy.seen.steps)


def start_burst(spec: Speculative, seqs: list[Sequence], passes: int) -> Burst | None:
    """Cycles on the device for `seqs`, when every one drafts the same chain or tree shape with
    the head this step (adaptive requests: the loop policy's choice for all) and the loop can
    run them all (`runnable`); None: the step runs as usual."""
    eagle = spec.eagle
    if eagle is None or eagle.cycles is None or passes < 2:
        return None
    if not all(map(runnable, seqs)) or any(map(spec.plain_epoch, seqs)):
        return None
    states = [spec.state(s) for s in seqs]
    adaptive = all(spec.in_loop(s) for s in seqs)
    if adaptive:
        # (after plain steps that handed out no features the head cannot draft: a plain step)
        ready = all(eagle.available(s, 1) for s in seqs)
        choice = _loop_choice(spec, seqs) if ready else None
    else:
        one = _one_shape({loop_shape(s, st, eagle) for s, st in zip(seqs, states, strict=True)})
        choice = None if one is None else Choice(one, eagle.cycles.max_cycles)
    if choice is None:
        return None
    shape = choice.shape
    left = max(s.params.max_tokens - s.num_output_tokens for s in seqs)
    room = min(spec.engine.max_model_len - s.num_tokens for s in seqs) - shape.span
    cycles = min(passes, choice.cycles, -(-left // shape.advance), room // shape.advance)
    fits = cycles >= 1 and eagle.cycles.fits(seqs, cycles, shape)
    if not fits or not _reserve(spec, seqs, shape, cycles):
        if adaptive:
            spec.loop.declined(len(seqs), shape, spec.policy.seen.steps)
        return None
    spec.plans = StepPlans()  # (the step its sequences' plans were for runs as the burst)
    # (a burst that captures its graph is not timed: the capture would price the shape)
    timed = eagle.cycles.warm(len(seqs), shape)
    in_a_row = all(eagle.caught_up(s) for s in seqs)  # (before this burst catches up)
    result = eagle.burst(seqs, shape, cycles)
    return _EagleBurst(spec, seqs, states, shape, result, timed, in_a_row)


def _reserve(spec: Speculative, seqs: list[Sequence], shape: TreeShape, cycles: int) -> bool:
    """KV slots for what `cycles` cycles of `shape` may write, for every sequence (False: the
    cache ran out; what was reserved goes back at commit, which the core trims)."""
    try:
        for seq in seqs:
            spec.engine.cache.reserve(seq, seq.num_cached + reach(shape, cycles))
    except OutOfBlocks:
        return False
    return True


class _EagleBurst(Burst):
    """EAGLE's cycles run on the device (`start_burst`), committed as one burst."""

    def __init__(
        self,
        spec: Speculative,
        seqs: list[Sequence],
        states: list[SeqState],
        shape: TreeShape,
        result: CycleResult,
        timed: bool,
        in_a_row: bool,
    ) -> None:
        self.spec, self.seqs, self.states, self.shape = spec, seqs, states, shape
        self.result, self.timed, self.in_a_row = result, timed, in_a_row

    def commits(self, since: float) -> list[Commit]:
        spec, depth, policy = self.spec, self.shape.depth, self.spec.policy
        assert spec.eagle is not None
        out = []
        per_seq = self.result.per_sequence()
        cycles = len(per_seq[0]) if per_seq else 0
        if cycles and self.timed:
            made = sum(len(c) for cycles_of in per_seq for c in cycles_of)
            spent = Spent(time.perf_counter() - since, self.result.cycle_seconds(), self.in_a_row)
            spec.loop.measured(len(self.seqs), self.shape, cycles, spent, made, policy.seen.steps)
        policy.stepped(cycles)
        for i, (seq, st, cycles) in enumerate(zip(self.seqs, self.states, per_seq, strict=True)):
            tokens = [t for cycle in cycles for t in cycle]
            if seq.status is Status.FINISHED:  # aborted meanwhile: released, nothing to count
                out.append(Commit([], []))
                continue
            for cycle in cycles[: _cycles_kept(seq, cycles, spec.engine.eos_ids)]:
                spec.record(seq, st, depth, len(cycle) - 1)
            spec.eagle.burst_done(seq, len(tokens), self.result.roots[i])
            out.append(
                Commit(
                    tokens,
                    [None] * len(tokens),
                    kv_keep=len(tokens) - 1,
                    forward_passes=len(cycles),
                    per_pass=[len(c) for c in cycles],
                )
            )
        spec.committed()
        spec.measure(self.seqs, out, None)
        return out


def _cycles_kept(seq: Sequence, cycles: list[list[int]], eos_ids: set[int]) -> int:
    """How many of a burst's cycles make tokens that `seq` keeps: those that start before its
    end (its max_tokens, or a stop token or EOS it stops at, as the core stops it); the cycles
    after it ran for the batch's other sequences, and count in none of its stats (a stop
    string's end is the core's to find)."""
    p = seq.params
    made = seq.num_output_tokens
    stops = set(p.stop_token_ids) if p.ignore_eos else eos_ids.union(p.stop_token_ids)
    for i, cycle in enumerate(cycles):
        if made >= p.max_tokens:
            return i
        for token in cycle:
            made += 1
            if token in stops and made >= p.min_tokens:
                return i + 1
    return len(cycles)
