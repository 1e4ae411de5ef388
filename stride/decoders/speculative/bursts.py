"""EAGLE's device loop as the speculative decoder's bursts: which steps may run as cycles on
the device (`cycles.EagleCycles`), in which shape (a request's fixed one, or for adaptive
requests the loop policy's choice, `loop_policy`), and their commits.

Where cycles run as CUDA graphs, a burst's commit launches the batch's next burst at once
(`Ahead`), from the state the cycles left on the device, so that the host's work between two
bursts (applying the commit, outputs, scheduling, proposing) runs while the device computes the
next one, as plain steps kept in flight hide theirs."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Protocol

from stride.decoders import sampling
from stride.decoders.base import Burst, Commit, StepContext
from stride.decoders.catalog import EAGLE
from stride.decoders.speculative import draws
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
    ahead: Ahead | None

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
    sampled, ranks = not seq.params.greedy, draws.ranks([seq.params])
    if not options.get("tree_nodes"):
        return TreeShape.chain(k, sampled, ranks)
    return TreeShape.of(max(options["tree_nodes"], k), k, options["tree_topk"], sampled, ranks)


def runnable(seq: Sequence) -> bool:
    """Can the device loop run `seq` now? Only a row drawn on the device with nothing for the
    host between two tokens: the loop accepts on the device (the argmax, or the rejection rule
    for sampled rows, from the model's own distribution: no logit bias or penalties) and hands
    nothing else back (no logprobs)."""
    p = seq.params
    return p.logprobs is None and p.unbiased and sampling.on_device(seq)


def bursts_only(seq: Sequence) -> bool:
    """Where bursts run, does `seq` draft in them only, a step that is none (the one beside an
    arrival's prefill) decoding it plainly? An EAGLE request the loop can run (on a GPU a step
    drafted on the host costs several of the loop's cycles) whose tokens do not depend on which
    steps draft: greedy, or a tree (its tokens are the target's draws). A sampled chain keeps
    its accepted drafts, the head's draws: it drafts every step, so that a seed makes the same
    tokens whatever shares its batch."""
    options = seq.decoder_options
    return (options["draft"] == EAGLE and runnable(seq)
            and (seq.params.greedy or bool(options.get("tree_nodes"))))  # fmt: skip


def batch_menu(seqs: list[Sequence]) -> tuple[TreeShape, ...] | None:
    """The shapes the loop may run a batch of adaptive requests in (`loop_policy.menu`; the
    sampled chain alone where some row samples), or None where their menus differ."""
    sampled = not all(s.params.greedy for s in seqs)
    ranks = draws.ranks(s.params for s in seqs)
    options = seqs[0].decoder_options
    if all(s.decoder_options == options for s in seqs):
        return menu(options, sampled, ranks)
    menus = {menu(s.decoder_options, sampled, ranks) for s in seqs}  # (a sampled row: no tree)
    return menus.pop() if len(menus) == 1 else None


def _one_shape(shapes: set[TreeShape | None]) -> TreeShape | None:
    """The shape a batch's sequences share, if any: chains or trees of one size where some
    rows sample are the sampled one (its greedy rows accept their argmax under it), at a rank
    that serves every sampled row."""
    known = {s for s in shapes if s is not None}
    if len(known) < len(shapes):
        return None
    if len(known) == 1:
        return known.pop()
    sizes = {replace(s, sampled=True, ranks=0) for s in known}
    if len(sizes) > 1:
        return None
    return replace(sizes.pop(), ranks=draws.joint_rank({s.ranks for s in known if s.sampled}))


def _loop_choice(spec: Speculative, seqs: list[Sequence]) -> Choice | None:
    """The loop policy's shape for a batch of adaptive EAGLE requests with the same menu."""
    shapes = batch_menu(seqs)
    if shapes is None:
        return None
    policy, batch = spec.policy, len(seqs)
    return spec.loop.choose(batch, shapes, policy.plain_seconds(batch), policy.seen.steps)


Rows = list[Sequence | None]  # a burst's rows on the device: None where a sequence ended


@dataclass
class Ahead:
    """A burst launched at the commit of the one before, in the same shape and on the same
    device rows, for those of its sequences that did not end there (`_launch_ahead`; an ended
    one's row runs on block 0, which is never handed out). The next step adopts it if it would
    start that very burst: the same sequences, still at the cached lengths and on the blocks it
    was launched for, in the same shape and cycles. Otherwise it is dropped: its cycles wrote
    only past its sequences' cached tokens, into slots that whatever runs next overwrites in
    stream order. (The slots reserved for it stay with their sequences until a burst's or a
    drafting step's commit trims them.)"""

    rows: Rows
    shape: TreeShape
    cycles: int
    starts: list[int]  # each live row's cached length after the commit it was launched at
    tables: list[list[int]]  # and its block table
    result: CycleResult

    def continues(self, seqs: list[Sequence], shape: TreeShape, cycles: int) -> bool:
        live = [s for s in self.rows if s is not None]
        if shape != self.shape or cycles != self.cycles or len(seqs) != len(live):
            return False
        return all(
            a is b and a.num_cached == n and a.block_table == t
            for a, b, n, t in zip(seqs, live, self.starts, self.tables, strict=True)
        )


def start_burst(
    spec: Speculative, seqs: list[Sequence], passes: int, ctx: StepContext
) -> Burst | None:
    """Cycles on the device for `seqs`, when every one drafts the same chain or tree shape with
    the head this step (adaptive requests: the loop policy's choice for all) and the loop can
    run them all (`runnable`); None: the step runs as usual. The burst launched ahead at the
    last commit, if it is this one; else it is dropped."""
    ahead, spec.ahead = spec.ahead, None
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
    shape, most = choice.shape, min(passes, choice.cycles)
    made = [0] * len(seqs)
    cycles = _cycles(spec, seqs, made, shape, most)
    # (a try runs fewer cycles than a burst takes: the next step may choose otherwise)
    follow = most if choice.cycles == eagle.cycles.max_cycles else 0
    if ahead is not None and ahead.continues(seqs, shape, cycles):
        spec.plans = StepPlans()
        return _EagleBurst(spec, seqs, states, shape, ahead.result, True, True, follow, ctx,
                           ahead.rows)  # fmt: skip
    fits = cycles >= 1 and eagle.cycles.fits(seqs, cycles, shape)
    if not fits or not _reserve(spec, seqs, shape, cycles, made):
        if adaptive:
            spec.loop.declined(len(seqs), shape, spec.policy.seen.steps)
        return None
    spec.plans = StepPlans()  # (the step its sequences' plans were for runs as the burst)
    # (a burst that captures its graph is not timed: the capture would price the shape)
    timed = eagle.cycles.warm(len(seqs), shape)
    in_a_row = all(eagle.caught_up(s) for s in seqs)  # (before this burst catches up)
    result = eagle.burst(seqs, shape, cycles)
    return _EagleBurst(spec, seqs, states, shape, result, timed, in_a_row, follow, ctx)


def _cycles(
    spec: Speculative, seqs: list[Sequence], made: list[int], shape: TreeShape, most: int
) -> int:
    """The cycles of a burst of `shape` (at most `most`) for `seqs` once each has `made` more
    tokens: no more than the longest of them needs, none that would pass a context's end."""
    pairs = list(zip(seqs, made, strict=True))
    left = max(s.params.max_tokens - s.num_output_tokens - m for s, m in pairs)
    room = min(spec.engine.max_model_len - s.num_tokens - m for s, m in pairs)
    return min(most, -(-left // shape.advance), (room - shape.span) // shape.advance)


def _reserve(
    spec: Speculative, seqs: list[Sequence], shape: TreeShape, cycles: int, made: list[int]
) -> bool:
    """KV slots for what `cycles` cycles of `shape` may write, for every sequence once it has
    `made` more tokens (False: the cache ran out; what was reserved goes back at the next
    commit, which the core trims)."""
    try:
        for seq, m in zip(seqs, made, strict=True):
            spec.engine.cache.reserve(seq, seq.num_cached + m + reach(shape, cycles))
    except OutOfBlocks:
        return False
    return True


def _launch_ahead(
    spec: Speculative, rows: Rows, shape: TreeShape, tokens: dict[int, list[int]], most: int
) -> bool:
    """At a burst's commit, the next burst of the same shape on the same rows (`Ahead`), for
    the sequences that do not end with their `tokens` (by row: their max_tokens, a stop token
    or EOS) and were not aborted; launched now unless none is left, one switches to plain
    decoding (its epoch), or the next burst would not fit. (Not while requests wait:
    `_EagleBurst.commits`.)"""
    eagle = spec.eagle
    assert eagle is not None and eagle.cycles is not None
    eos = spec.engine.eos_ids

    def goes_on(r: int, s: Sequence | None) -> bool:
        return s is not None and s.status is not Status.FINISHED and _end(s, tokens[r], eos) is None

    rows = [s if goes_on(r, s) else None for r, s in enumerate(rows)]
    seqs = [s for s in rows if s is not None]
    if not most or not seqs or not eagle.cycles.ahead or any(map(spec.plain_epoch, seqs)):
        return False
    made = [len(tokens[r]) for r, s in enumerate(rows) if s is not None]
    starts = [s.num_cached + m for s, m in zip(seqs, made, strict=True)]
    cycles = _cycles(spec, seqs, made, shape, most)
    if cycles < 1 or not eagle.cycles.fits(seqs, cycles, shape, starts):
        return False
    if not _reserve(spec, seqs, shape, cycles, made):
        return False
    tables = [list(s.block_table) for s in seqs]
    result = eagle.cycles.resume(rows, shape, cycles)
    spec.ahead = Ahead(rows, shape, cycles, starts, tables, result)
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
        follow: int,
        ctx: StepContext,
        rows: Rows | None = None,
    ) -> None:
        self.spec, self.seqs, self.states, self.shape = spec, seqs, states, shape
        self.result, self.timed, self.in_a_row = result, timed, in_a_row
        self.follow = follow  # the most cycles of a burst launched at its commit (0: none)
        self.ctx = ctx
        self.rows: Rows = list(seqs) if rows is None else rows  # the result's (`Ahead.rows`)

    def commits(self, since: float) -> list[Commit]:
        spec, depth, policy = self.spec, self.shape.depth, self.spec.policy
        assert spec.eagle is not None
        out, tokens = [], {}
        per_row = self.result.per_sequence()
        at = {id(s): r for r, s in enumerate(self.rows) if s is not None}
        index = [at[id(s)] for s in self.seqs]
        per_seq = [per_row[r] for r in index]
        cycles = len(per_seq[0]) if per_seq else 0
        if cycles and self.timed:
            made = sum(len(c) for cycles_of in per_seq for c in cycles_of)
            spent = Spent(time.perf_counter() - since, self.result.cycle_seconds(), self.in_a_row)
            spec.loop.measured(len(self.seqs), self.shape, cycles, spent, made, policy.seen.steps)
        policy.stepped(cycles)
        for r, seq, st, cycles in zip(index, self.seqs, self.states, per_seq, strict=True):
            made = tokens[r] = [t for cycle in cycles for t in cycle]
            if seq.status is Status.FINISHED:  # aborted meanwhile: released, nothing to count
                out.append(Commit([], []))
                continue
            for cycle in cycles[: _cycles_kept(seq, cycles, spec.engine.eos_ids)]:
                spec.record(seq, st, depth, len(cycle) - 1)
            spec.eagle.burst_done(seq, len(made), self.result.roots[r])
            out.append(
                Commit(
                    made,
                    [None] * len(made),
                    kv_keep=len(made) - 1,
                    forward_passes=len(cycles),
                    per_pass=[len(c) for c in cycles],
                )
            )
        spec.committed()
        spec.measure(self.seqs, out, None)
        # (while requests wait, the next step admits them: no burst of these sequences then)
        follow = 0 if self.ctx.waiting else self.follow
        self.followed = _launch_ahead(spec, self.rows, self.shape, tokens, follow)
        return out


def _cycles_kept(seq: Sequence, cycles: list[list[int]], eos_ids: set[int]) -> int:
    """How many of a burst's cycles make tokens that `seq` keeps: those that start before its
    end (`_end`); the cycles after it ran for the batch's other sequences, and count in none of
    its stats (a stop string's end is the core's to find)."""
    end = _end(seq, [t for cycle in cycles for t in cycle], eos_ids)
    if end is None:
        return len(cycles)
    start = kept = 0
    while kept < len(cycles) and start < end:
        start += len(cycles[kept])
        kept += 1
    return kept


def _end(seq: Sequence, tokens: list[int], eos_ids: set[int]) -> int | None:
    """How many of `tokens`, made after `seq`'s own, it keeps if it ends with them (at its
    max_tokens, or a stop token or EOS it stops at, as the core stops it); None: it goes on."""
    p = seq.params
    stops = set(p.stop_token_ids) if p.ignore_eos else eos_ids.union(p.stop_token_ids)
    room = max(p.max_tokens - seq.num_output_tokens, 0)
    for i, token in enumerate(tokens[:room]):
        if token in stops and seq.num_output_tokens + i + 1 >= p.min_tokens:
            return i + 1
    return room if len(tokens) >= room else None
