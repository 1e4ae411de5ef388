"""How a scheduled step runs on the device, and what its sequences commit from it.

The core decides *what* runs (scheduling, proposals, commits, fault isolation); the executor
decides *how*, behind one interface: `launch` a scheduled batch, `follow` a launched step on the
device before it is committed, and say whether the next step `may_launch_ahead`. A launched
step (`InFlight`) hands each decoder's sequences their `Commit`s, whichever way it ran:

- `Forward`: one ragged forward pass over every sequence's tail and proposal; each decoder
  commits from its rows' logits. Any batch can run this way.
- `GreedyBurst`: several decode steps back to back on the device, each step's argmax fed to the
  next, so the host's per-step work (sync, commit, schedule, pack, launch) is paid once for
  several tokens. Every row must decode plainly greedily (`sampling.greedy_on_device`) and
  nobody may wait to join; a decoder other than `ar` joins for as many steps as it would decode
  its rows as `ar` (`Decoder.plain_steps`), if above 1 (an answer of 1 may need this step's
  `commit`, e.g. to time it). Several steps per burst only for batches up to `MAX_BURST_BATCH`,
  where host work is a large share of a step: a request arriving meanwhile waits up to
  `steps - 1` steps longer (a burst more if chained), and a sequence that stops early wastes the
  rest of its steps. A larger batch, up to what the decode graphs take, runs 1-step bursts, and
  only to chain them: chaining costs neither the wait nor the waste, and buys the overlap.
  `burst_steps` of 1 turns bursts off at every batch size.
- `DecoderBurst`: a decoder's own passes on the device (`Decoder.burst`, e.g. EAGLE's greedy
  chains), when the whole step is its sequences' decodes and nobody waits.

Two ways to overlap the host with the device, both on the GPU only (on the CPU everything is
synchronous, and they would only make arrivals wait longer):

- chaining (`follow`): the greedy burst that continues a launched one is queued before that one
  is committed, its first tokens picked on the device from the last sample;
- launch-ahead: the next step's forward is launched before this step's text is decoded, when
  nobody waits and every decoder in flight agrees (`Decoder.may_launch_ahead`).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

import torch

from stride.decoders import sampling
from stride.decoders.base import Burst, Commit, Decoder, Proposal, StepContext
from stride.engine.engine import Engine
from stride.engine.kv_cache import OutOfBlocks
from stride.engine.roofline import StepLoad
from stride.engine.runner import SampledTokens, Span
from stride.engine.sequence import Sequence, Status
from stride.scheduler import prompt_logprobs
from stride.scheduler.policy import Scheduled

log = logging.getLogger(__name__)

MAX_BURST_BATCH = 8  # greedy bursts of several steps only for batches up to this size


@dataclass
class Batch:
    """A scheduled step: its plan, each item's proposal (None: its tail is not complete, or
    nothing was proposed yet), and the plan indices that complete their tail, by decoder."""

    plan: list[Scheduled]
    proposals: list[Proposal | None]
    by_decoder: dict[str, list[int]]

    @classmethod
    def of(cls, plan: list[Scheduled], proposals: list[Proposal | None] | None = None) -> Batch:
        by_decoder: dict[str, list[int]] = defaultdict(list)
        for i, item in enumerate(plan):
            if item.completes_tail:
                by_decoder[item.seq.decoder].append(i)
        return cls(plan, proposals or [None] * len(plan), by_decoder)

    def without(self, dropped: Collection[int]) -> Batch:
        kept = [i for i in range(len(self.plan)) if i not in dropped]
        return Batch.of([self.plan[i] for i in kept], [self.proposals[i] for i in kept])

    @property
    def seqs(self) -> list[Sequence]:
        return [item.seq for item in self.plan]


class InFlight:
    """A step launched on the device and not yet committed."""

    def __init__(self, batch: Batch, num_tokens: int) -> None:
        self.batch = batch
        self.num_tokens = num_tokens  # tokens the device scores for it
        self.launched_at = time.monotonic()  # (a traced request's prefill chunks start there)
        # Sequences whose forward failed alone, with what it raised (they are out of `batch`).
        self.failed: list[tuple[Sequence, Exception]] = []

    def live(self) -> Iterable[tuple[str, list[int]]]:
        """Each decoder's plan indices whose sequences are still running (aborts and expired
        deadlines finish sequences between a launch and its commit)."""
        plan = self.batch.plan
        for name, idx in self.batch.by_decoder.items():
            idx = [i for i in idx if plan[i].seq.status is not Status.FINISHED]
            if idx:
                yield name, idx

    def advance(self, decoder: Decoder, seqs: list[Sequence]) -> None:
        """Tell `decoder` about passes it did not commit itself (bursts)."""

    def commits(
        self, decoder: Decoder, idx: list[int], ctx: StepContext
    ) -> list[Commit]:  # pragma: no cover - every kind overrides it
        """What the sequences at plan indices `idx` (all `decoder`'s) commit (waits for them)."""
        raise NotImplementedError


class Forward(InFlight):
    """One forward pass: each decoder commits from its rows' logits. `prompt_logits`: the rows
    that score prompt tokens (`prompt_logprobs`), as (sequence, first position, logits)."""

    def __init__(
        self,
        batch: Batch,
        num_tokens: int,
        logits: list[torch.Tensor],
        prompt_logits: list[tuple[Sequence, int, torch.Tensor]] | None = None,
    ) -> None:
        super().__init__(batch, num_tokens)
        self.logits = logits
        self.prompt_logits = prompt_logits or []

    def commits(self, decoder: Decoder, idx: list[int], ctx: StepContext) -> list[Commit]:
        plan, proposals = self.batch.plan, self.batch.proposals
        seqs = [plan[i].seq for i in idx]
        props = [proposals[i] for i in idx]
        return decoder.commit(seqs, props, [self.logits[i] for i in idx], ctx)  # type: ignore[arg-type]


class GreedyBurst(InFlight):
    """`tokens.steps` greedy decode steps: each sequence commits one token per step, all but
    the last with their KV cached."""

    def __init__(self, batch: Batch, tokens: SampledTokens) -> None:
        super().__init__(batch, len(batch.plan) * tokens.steps)
        self.tokens = tokens
        self._per_sequence: list[list[int]] | None = None

    def advance(self, decoder: Decoder, seqs: list[Sequence]) -> None:
        decoder.advance(seqs, self.tokens.steps)

    def commits(self, decoder: Decoder, idx: list[int], ctx: StepContext) -> list[Commit]:
        if self._per_sequence is None:
            self._per_sequence = self.tokens.per_sequence()
        steps = self.tokens.steps
        return [
            Commit(self._per_sequence[i], [None] * steps, steps - 1, forward_passes=steps)
            for i in idx
        ]


class DecoderBurst(InFlight):
    """A decoder's own passes on the device (`Decoder.burst`); the plan is all its sequences."""

    def __init__(self, batch: Batch, burst: Burst) -> None:
        super().__init__(batch, len(batch.plan))
        self.burst = burst

    def commits(self, decoder: Decoder, idx: list[int], ctx: StepContext) -> list[Commit]:
        every = self.burst.commits()
        return [every[i] for i in idx]


class Executor:
    """Picks how each step runs (see the module docstring) and launches it."""

    def __init__(self, engine: Engine, decoders: dict[str, Decoder], burst_steps: int | None):
        self.engine = engine
        self.decoders = decoders
        graphs = engine.runner.graphs
        # On a GPU, the next step's forward is launched before this step's text is decoded.
        self.launch_ahead = graphs is not None
        self.burst_steps = burst_steps if burst_steps is not None else 8 if graphs else 1
        self.chain = graphs is not None
        self.max_chain_batch = graphs.max_batch if graphs is not None else 1 << 30
        self.load = StepLoad()  # the current step's work on the device (roofline metrics)

    # ---- launching a scheduled batch ------------------------------------------------------

    def launch(
        self,
        batch: Batch,
        propose: Callable[[Batch], Batch | None],
        ctx: StepContext,
        alone: bool,
        isolating: bool,
    ) -> InFlight | None:
        """Start `batch` on the device (asynchronously on a GPU); None: nothing left to run.

        `propose` lets the decoders propose (the core's, with its fault isolation); `alone`:
        nobody waits and nothing runs beside the target; `isolating`: suspects run apart.
        """
        if alone:
            burst = self._decoder_burst(batch, ctx)
            if burst is not None:
                return DecoderBurst(batch, burst)
        proposed = propose(batch)
        if proposed is None:
            return None
        batch = proposed
        spans = [_span(item, prop) for item, prop in zip(batch.plan, batch.proposals, strict=True)]
        steps = self._greedy_steps(batch) if alone and not isolating else 0
        if steps:
            tails = [span.token_ids[0] for span in spans]
            try:
                tokens = self.engine.runner.decode_steps(
                    batch.seqs, tails, steps, sampling.device_argmax
                )
                self.load.add_decode_steps(batch.seqs, steps)
                return GreedyBurst(batch, tokens)
            except Exception:  # the plain forward below tells whose fault it is
                log.exception("a greedy burst failed; running a plain forward instead")
        prompt_rows = _prompt_rows(batch.plan, spans)
        num_tokens = sum(len(span.token_ids) for span in spans)
        self.load.add_forward(spans, [item.num_tail for item in batch.plan])
        logits, failed = self._forward(spans)
        scored: list[tuple[Sequence, int, torch.Tensor]] = []
        for i, (first, count) in prompt_rows.items():  # split off the rows that score prompts
            if i not in failed:
                scored.append((batch.plan[i].seq, first, logits[i][:count]))
                logits[i] = logits[i][count:]
        if not failed:
            return Forward(batch, num_tokens, logits, scored)
        kept = batch.without(failed)
        inflight = Forward(
            kept, num_tokens, [x for i, x in enumerate(logits) if i not in failed], scored
        )
        inflight.failed = [(batch.plan[i].seq, error) for i, error in failed.items()]
        return inflight

    def _decoder_burst(self, batch: Batch, ctx: StepContext) -> Burst | None:
        """A decoder's own passes (`Decoder.burst`), when the whole step is its sequences'
        decodes and bursts are on."""
        if self.burst_steps <= 1 or len(batch.by_decoder) != 1:
            return None
        ((name, idx),) = batch.by_decoder.items()
        if len(idx) != len(batch.plan) or any(item.num_tail != 1 for item in batch.plan):
            return None
        return self.decoders[name].burst(batch.seqs, self.burst_steps, ctx)

    def _forward(self, spans: list[Span]) -> tuple[list[torch.Tensor], dict[int, Exception]]:
        """The step's forward pass: each span's logits, and what the spans that fail alone
        raised (none when the batch went through; their logits are placeholders). If the batch
        raises, each span runs again alone; if none succeeds, the fault is the engine's: raise.
        """
        try:
            return self.engine.runner.forward(spans), {}
        except Exception as e:
            if len(spans) == 1:
                raise
            log.warning(
                "a forward pass over %d sequences failed (%s: %s); retrying each alone",
                len(spans),
                type(e).__name__,
                e,
            )
            logits: list[torch.Tensor] = []
            failed: dict[int, Exception] = {}
            for i, span in enumerate(spans):
                try:
                    logits += self.engine.runner.forward([span])
                except Exception as alone:
                    failed[i] = alone
                    logits.append(torch.empty(0))
            if len(failed) == len(spans):
                raise
            return logits, failed

    def _greedy_steps(self, batch: Batch) -> int:
        """How many steps a greedy burst of `batch` runs (0: a plain forward), with the blocks
        for them reserved (what is reserved goes back when the step commits: the core trims)."""
        try:
            steps = self._burst_length(batch)
            if steps == 1:  # the scheduler reserved this step's slot
                return 1 if self.chain else 0  # unchained, a 1-step burst buys nothing
            for item in batch.plan if steps else ():
                self.engine.cache.reserve(item.seq, item.seq.num_cached + steps)
            return steps
        except OutOfBlocks:
            return 0
        except Exception:
            log.exception("choosing a greedy burst failed; running a plain forward")
            return 0

    def _burst_length(self, batch: Batch) -> int:
        steps = self.burst_steps
        if steps <= 1:
            return 0
        plan = batch.plan
        if len(plan) > MAX_BURST_BATCH:
            if not self.chain or len(plan) > self.max_chain_batch:
                return 0
            steps = 1  # only to chain them
        for item in plan:
            seq = item.seq
            if not (
                item.completes_tail and item.num_tail == 1 and sampling.greedy_on_device(seq)
            ):
                return 0
            left = seq.params.max_tokens - seq.num_output_tokens
            steps = min(steps, left, self.engine.max_model_len - len(seq.token_ids))
        for name, idx in batch.by_decoder.items():
            plain = self.decoders[name].plain_steps([plan[i].seq for i in idx])
            if plain <= 1:
                return 0
            steps = min(steps, plain)
        return steps

    # ---- overlapping the host with the device ---------------------------------------------

    def follow(self, inflight: InFlight, alone: bool, num_running: int) -> InFlight | None:
        """Launch the greedy burst that continues `inflight`'s, before `inflight` is committed.

        Committing a burst waits for its tokens; with the next burst already queued, the GPU
        runs it meanwhile instead of idling through the host's sync, commit, schedule and pack.
        Its plan is `inflight`'s minus the sequences finished since (aborted, expired, or
        stopped by the commit before) and those that `inflight` takes to max_tokens; its first
        tokens are their rows of `inflight`'s last sample, picked on the device; its steps are
        what `launch` would allow once `inflight` has committed. A sequence that stops
        otherwise in that commit still has a row, skipped when this burst commits. Nothing new
        joins: the chain ends when someone waits (a request arriving meanwhile waits at most one
        more burst, and no prefill starves) or when something else runs (`num_running` is more
        than the burst's). Another decoder's rows join for as long as its `plain_steps`, asked
        before `inflight` commits (for `inflight`'s first step), allows.
        """
        if not isinstance(inflight, GreedyBurst) or not self.chain or not alone:
            return None
        try:
            return self._follow(inflight, num_running)
        except Exception:  # nothing launched: the next step launches from scratch
            log.exception("chaining greedy bursts failed")
            return None

    def _follow(self, inflight: GreedyBurst, num_running: int) -> GreedyBurst | None:
        done = inflight.tokens.steps
        old, alive = inflight.batch.plan, 0
        kept: list[int] = []  # indices into `old`
        lefts: list[int] = []
        for i, item in enumerate(old):
            seq = item.seq
            if seq.status is Status.FINISHED:
                continue
            alive += 1
            left = seq.params.max_tokens - seq.num_output_tokens - done  # once committed
            if left > 0:  # else `inflight` ends it (length)
                kept.append(i)
                lefts.append(left)
        if not kept or alive != num_running:
            return None
        batch = inflight.batch
        if len(kept) < len(old):
            batch = Batch.of([old[i] for i in kept], [batch.proposals[i] for i in kept])
        plan = batch.plan
        steps = self.burst_steps if len(plan) <= MAX_BURST_BATCH else 1
        steps = min(steps, min(lefts))  # (admission keeps max_tokens within max_model_len)
        for name, idx in batch.by_decoder.items():
            plain = self.decoders[name].plain_steps([plan[j].seq for j in idx])
            steps = min(steps, plain - done)
        if steps < 1:
            return None
        try:
            for item in plan:  # the burst's first step writes the K/V of `inflight`'s last token
                self.engine.cache.reserve(item.seq, item.seq.num_cached + done + steps)
        except OutOfBlocks:
            return None  # what was reserved goes back when `inflight` commits (the core trims)
        first = inflight.tokens.on_device[-1]  # picked by `rows` if some sequences left
        rows = None if plan is old else kept
        tokens = self.engine.runner.decode_steps(
            batch.seqs, first, steps, sampling.device_argmax, done, rows
        )
        self.load.add_decode_steps(batch.seqs, steps, done)
        return GreedyBurst(batch, tokens)

    def may_launch_ahead(self, alone: bool, in_flight: Iterable[str]) -> bool:
        """Launch the next step's forward now, before this step's text is decoded?

        Only on the GPU path, when nobody waits (`alone`, and no suspects run apart), and when
        every decoder with sequences `in_flight` agrees (`Decoder.may_launch_ahead`): then the
        next step's plan is the one it would pick itself, unless a request arrives (it joins a
        step later) or leaves (its row is dropped) in between.
        """
        if not self.launch_ahead or not alone:
            return False
        for name in in_flight:
            try:
                if not self.decoders[name].may_launch_ahead():
                    return False
            except Exception:
                log.exception("decoder %s: may_launch_ahead failed", name)
                return False
        return True


def _prompt_rows(plan: list[Scheduled], spans: list[Span]) -> dict[int, tuple[int, int]]:
    """The rows of each span that score prompt tokens for `prompt_logprobs` (plan index ->
    first position, count); the spans return their logits too, before the decoder's rows."""
    rows: dict[int, tuple[int, int]] = {}
    for i, (item, span) in enumerate(zip(plan, spans, strict=True)):
        wanted = prompt_logprobs.rows_wanted(item.seq, item.seq.num_cached, item.num_tail)
        if wanted is not None:
            rows[i] = wanted
            span.num_logits += wanted[1]
    return rows


def _span(item: Scheduled, prop: Proposal | None) -> Span:
    """A plan item's share of the forward: its scheduled tail, then what its decoder proposed."""
    seq = item.seq
    start = seq.num_cached
    tail = seq.token_ids[start : start + item.num_tail]
    if prop is None:
        return Span(seq, tail, num_logits=0)
    if not prop.tokens and prop.positions is None:
        return Span(seq, tail, 1, None, prop.mask)
    positions = None
    if prop.positions is not None:
        positions = list(range(start, start + len(tail))) + prop.positions
    return Span(seq, tail + prop.tokens, 1 + len(prop.tokens), positions, prop.mask)
