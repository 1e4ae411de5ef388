"""How a batch runs on the device, and what its sequences commit from it.

The core decides *what* runs (scheduling, proposals, applying commits); the executor decides
*how*, behind one call: `run(batch)` launches the batch and returns a `StepResult` for every
launch that has finished. A batch runs one of three ways:

- a forward: one ragged pass over every sequence's tail and proposal; each decoder commits from
  its rows' logits. Any batch can run this way.
- a burst: several plain decode steps back to back on the device, each step's sample fed to the
  next, so the host's per-step work (sync, commit, schedule, pack) is paid once for several
  tokens. Every row must be a plain step sampled on the device (`sampling.on_device`: greedy
  or sampled, with the rows' settings as tensors, `sampling.DrawSettings`; logprobs taken
  beside, `drawn_logprobs`; or under a grammar that checks each token as it is committed,
  `sampling.drawn_then_checked`, the raw logits it was drawn from kept for a refused one)
  whose decoder promised that many plain steps (`Proposal.plain_steps`), and nobody may wait.
  Several steps only for batches up to `MAX_BURST_BATCH`, where host work is a large share of a
  step: a request arriving meanwhile waits up to `steps - 1` steps longer, and a sequence that
  stops early wastes the rest of its steps.
- a decoder's own passes on the device (`Batch.burst`, e.g. EAGLE's chains).

Overlap (on the GPU only, where the decode graphs can take rows fed on the device): a launch
whose every committing row is a plain step sampled on the device, with more plain steps
promised after it, stays in flight. The next step is scheduled, proposed and launched before
its result is committed: its rows continue from the last pending tokens on the device (fed
rows, `Scheduled.fed`), and the host's commit, detokenizing and output of one step run while
the device computes the next. A launch that anything else needs the commit of (drafts to verify,
a sample drawn on the host) is waited for at once. On the CPU everything is synchronous.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import torch

from stride.decoders import adjustments, draw_kernels, sampling
from stride.decoders.base import Proposal
from stride.decoders.draw_graphs import DrawGraphs
from stride.decoders.drawn_logprobs import DrawnLogprobs
from stride.engine.engine import Engine
from stride.engine.kv_cache import OutOfBlocks
from stride.engine.roofline import StepLoad
from stride.engine.runner import SampledTokens
from stride.engine.sequence import Sequence, Status
from stride.engine.spans import Span
from stride.scheduler import prompt_logprobs
from stride.scheduler.batch import Batch, Chunk, PromptRows, StepResult
from stride.scheduler.decoder_set import DecoderSet
from stride.scheduler.launches import BurstLaunch, ForwardLaunch, Launch, LoopLaunch
from stride.scheduler.policy import Scheduled

log = logging.getLogger(__name__)

MAX_BURST_BATCH = 8  # bursts of several steps only for batches up to this size


class Executor:
    """Runs each step's batch (see the module docstring) and keeps at most one in flight."""

    def __init__(self, engine: Engine, decoders: DecoderSet, burst_steps: int) -> None:
        self.engine = engine
        self.decoders = decoders
        self.burst_steps = burst_steps
        self._draw_graphs = DrawGraphs()
        if draw_kernels.available(engine.device):
            draw_kernels.warm(engine.device, engine.hf_config.vocab_size)
        self.overlap = engine.runner.graphs is not None
        self.load = StepLoad()  # the current step's work on the device (roofline metrics)
        self._in_flight: Launch | None = None
        self._finished_at = time.perf_counter()  # when the last launch finished

    # ---- running a batch ----------------------------------------------------------------------

    def run(self, batch: Batch) -> Iterator[StepResult]:
        """Launch `batch` (at once); return the results of the launches it finishes, oldest
        first: the one in flight before, if any, then this one, unless it stays in flight. Each
        is finished (waited for, committed) as it is taken, so after the caller applied the one
        before: a draw on the host keys its noise by its sequence's position, which counts the
        tokens the launch before made."""
        self.load = StepLoad()
        launch = self._launch(batch) if batch.plan else None
        finishing = []
        if self._in_flight is not None:
            finishing.append(self._in_flight)
            self._in_flight = None
        if launch is not None:
            if launch.continuable:
                self._in_flight = launch
            else:
                finishing.append(launch)
        return map(self._finish, finishing)

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    def _launch(self, batch: Batch) -> Launch | None:
        if batch.burst is not None:
            return LoopLaunch(batch, batch.burst)
        steps, continuable = self._shape(batch)
        if steps:
            try:
                return self._launch_burst(batch, steps, continuable)
            except Exception:  # the forward below tells whose fault it is
                log.exception("a burst failed to launch; running a forward instead")
        return self._launch_forward(batch, continuable and not steps)

    def _launch_burst(self, batch: Batch, steps: int, continuable: bool) -> BurstLaunch:
        plan, seqs = batch.plan, batch.seqs
        offsets = [len(s.token_ids) - 1 + s.pending - s.num_cached for s in seqs]  # fed_offset
        tokens = self._first_tokens(plan)
        draws = self._draw_settings(seqs, steps)
        logprobs = DrawnLogprobs.of(seqs)
        graphed = self.engine.runner.decodes_in_graphs(seqs)  # (then its draws are graphed too)
        draw = self._draw_graphs if graphed else sampling.device_sample

        checked, kept = _checked_rows(seqs), []
        at = checked and torch.tensor(checked).to(self.engine.device, non_blocking=True)

        def sample(logits: torch.Tensor, step: int) -> torch.Tensor:
            if checked:  # (a copy: the graphs' logits buffer is theirs)
                kept.append(logits.index_select(0, at))
            if logprobs is not None:  # (with logprobs, the draws are not graphed)
                return logprobs.draw(logits, draws, step)
            return draw(logits, draws, step)

        made = self.engine.runner.decode_steps(seqs, tokens, steps, sample, offsets)
        self.load.add_decode_steps(seqs, steps, offsets)
        launch = BurstLaunch(batch, made, continuable)
        launch.drawn_from = _kept(seqs, checked, kept)
        launch.logprobs = logprobs and logprobs.copied()
        launch.sampled, launch.sampling, launch.draws = made.on_device[-1], seqs, draws
        self._started(launch, [steps] * len(plan))
        return launch

    def _launch_forward(self, batch: Batch, continuable: bool) -> ForwardLaunch:
        plan = batch.plan
        spans = [_span(item, prop) for item, prop in zip(plan, batch.proposals, strict=True)]
        prompt_rows = _prompt_rows(plan, spans)
        fed = self._fed_tokens(plan)
        self.load.add_forward(spans, [item.num_tail for item in plan])
        logits, failed = self._forward(spans, fed)
        rows = []
        for i, (first, count) in prompt_rows.items():  # split off the rows that score prompts
            if i not in failed:
                rows.append(PromptRows(plan[i].seq, first, logits[i][:count]))
                logits[i] = logits[i][count:]
        kept = batch
        if failed:
            kept = batch.without(failed)
            logits = [x for i, x in enumerate(logits) if i not in failed]
        committing = [i for i, item in enumerate(kept.plan) if item.completes_tail]
        launch = ForwardLaunch(kept, logits, continuable and bool(committing))
        launch.result.prompt_rows = rows
        launch.result.failed = [(plan[i].seq, error, "scoring") for i, error in failed.items()]
        if launch.continuable:  # its committing rows drawn on the device, now
            seqs = launch.sampling = [kept.plan[i].seq for i in committing]
            draws = launch.draws = self._draw_settings(seqs, 1)
            logprobs = DrawnLogprobs.of(seqs)
            stacked = torch.cat([logits[i] for i in committing])
            checked = _checked_rows(seqs)
            if checked:
                launch.drawn_from = _kept(seqs, checked, [stacked[checked]])
            if logprobs is None:
                drawn = sampling.device_sample(stacked, draws)
            else:
                drawn = logprobs.draw(stacked, draws, 0)
                launch.logprobs = logprobs.copied()
            launch.sampled = drawn
            launch.tokens = SampledTokens(drawn[None])
        self._started(launch, [1] * len(kept.plan))
        return launch

    def _draw_settings(self, seqs: list[Sequence], steps: int) -> sampling.DrawSettings:
        """`seqs`' settings for `steps` draws on the device, from the token after their pending
        ones (the in-flight launch's reused where its rows are the same). Rows with penalties
        count their pending tokens too: those settings' counts go on from its draws, and new
        ones count them on the device from its samples."""
        positions = [len(s.token_ids) + s.pending for s in seqs]
        flight = self._in_flight
        last = None if flight is None else flight.draws
        vocab = self.engine.hf_config.vocab_size  # (the draws add biases and penalties)
        draws = sampling.settings(seqs, positions, self.engine.device, steps, last, vocab)
        adjusted = draws.adjustments
        fresh = last is None or adjusted is not last.adjustments
        if fresh and adjusted and adjusted.counts is not None and flight and flight.tokens:
            rows = [i for i, s in enumerate(seqs) if s.pending and s.params.has_penalties]
            if rows:
                made = flight.tokens.on_device
                cols = torch.tensor([flight.rows[seqs[i].request_id] for i in rows])
                cols = cols.to(made.device, non_blocking=True)
                adjustments.count_rows(adjusted, rows, made[:, cols])
        return draws

    def _started(self, launch: Launch, steps: list[int]) -> None:
        """What a launch changes at once: prefill chunks are cached (their next chunk may run
        in the next step), committing rows sampled on the device are pending until committed,
        with their decoder's promise what is left of it."""
        cache = self.engine.cache
        for item, prop, n in zip(launch.batch.plan, launch.batch.proposals, steps, strict=True):
            seq = item.seq
            if item.num_tail > 1:  # (traced requests' timelines note their prefill chunks)
                launch.result.chunks.append(Chunk(seq, item.num_tail, seq.num_cached))
            if not item.completes_tail:
                seq.num_cached += item.num_tail
                cache.seal(seq)
            elif launch.sampled is not None and prop is not None:  # sampled on the device
                seq.pending += n
                seq.promised = prop.plain_steps - n

    # ---- finishing a launch -------------------------------------------------------------------

    def _finish(self, launch: Launch) -> StepResult:
        """Wait for `launch` and let its sequences' decoders commit what it made."""
        result, decoders = launch.result, self.decoders
        try:
            if isinstance(launch, LoopLaunch):
                self._finish_loop(launch)
                return result
            scored = launch.scored(decoders)
            now = time.perf_counter()
            if launch.decode_only:
                decoders.ctx.timing = now - self._finished_at
            else:
                decoders.ctx.timing = None
            self._finished_at = now
            result.commits = decoders.commit(launch.batch, scored)
            return result
        finally:
            if launch.sampled is not None:  # (launches finish in order: void tokens first)
                for item in launch.batch.plan:
                    if item.completes_tail:
                        seq = item.seq
                        void = min(seq.void, launch.passes)
                        seq.void -= void
                        seq.pending -= launch.passes - void

    def _finish_loop(self, launch: LoopLaunch) -> None:
        result, plan = launch.result, launch.batch.plan
        seqs = [item.seq for item in plan]
        before = [s.stats.draft_tokens for s in seqs]
        # (From the launch before's end, not this step's start: the host's work since, its
        # commit and outputs too, is the burst's cost, less what a burst the decoder launched
        # at that commit hid of it. A burst after an idle engine follows a prefill, which the
        # loop prices by the device's time instead.)
        commits = launch.burst.commits(self._finished_at)
        self._finished_at = time.perf_counter()
        live = [i for i, s in enumerate(seqs) if s.status is not Status.FINISHED]
        result.commits = {i: commits[i] for i in live}
        passes = [commits[i].forward_passes for i in live]
        drafted = [seqs[i].stats.draft_tokens - before[i] for i in live]
        self.load.add_burst([seqs[i] for i in live], passes, drafted)
        result.passes = max(passes, default=1)

    # ---- choosing how a batch runs ------------------------------------------------------------

    def _shape(self, batch: Batch) -> tuple[int, bool]:
        """How `batch` launches: the steps of a burst (0: a forward), with the blocks for them
        reserved (what is reserved goes back when the step commits: the core trims), and
        whether the launch may stay in flight: every committing row a plain step sampled on the
        device (`sampling.on_device`), its decoder promising more plain steps after this
        launch, and its next row one the decode graphs can feed. A burst needs every row to be
        such a decode row (a constrained one too, whose tokens are checked as they are
        committed: `sampling.drawn_then_checked`); several steps only for batches up to
        `MAX_BURST_BATCH` where nobody waits."""
        plan = batch.plan
        decodes = plain = True  # every row a plain decode row / every committing row plain
        promised = left = 1 << 30  # plain steps promised, tokens left, the least of any row
        made = 0  # the most tokens of any committing row (pending ones included)
        for item, prop in zip(plan, batch.proposals, strict=True):  # (every row, every step)
            if not item.completes_tail:
                decodes = False
                continue
            seq = item.seq
            if prop is None or prop.tokens or prop.positions is not None:
                return 0, False
            if seq.grammar is None:
                device = item.fed or sampling.on_device(seq)  # (fed: checked at launch)
            else:  # checked as it commits
                device = item.fed or sampling.drawn_then_checked(seq)
            if not device:
                return 0, False
            decodes = decodes and item.num_tail == 1
            count = len(seq.token_ids) + seq.pending
            made = max(made, count)
            promised = min(promised, prop.plain_steps)
            left = min(left, seq.params.max_tokens - (count - len(seq.prompt_ids)))
            plain = plain and seq.prompt_logprobs is None
        runner = self.engine.runner

        def continuable(n: int) -> bool:  # after a launch of n steps
            return self.overlap and plain and promised > n and runner.can_feed(made + n)

        steps = 0
        if decodes and (self.burst_steps > 1 or self.overlap):
            alone = len(plan) <= MAX_BURST_BATCH and batch.alone
            burst = self.burst_steps if alone else 1
            steps = max(0, min(burst, promised, left, self.engine.max_model_len - made))
        if steps <= 1:  # (one step that stays no launch in flight: a forward does as well)
            return (1, True) if steps and continuable(1) else (0, continuable(1))
        try:
            for item in plan:
                self.engine.cache.reserve(item.seq, item.seq.num_cached + item.seq.fed_offset
                                          + steps)  # fmt: skip
        except OutOfBlocks:
            for item in plan:  # (what it did reserve goes back)
                self.engine.cache.trim(item.seq)
            return 0, continuable(1)
        return steps, continuable(steps)

    # ---- feeding rows on the device -----------------------------------------------------------

    def _fed_tokens(self, plan: list[Scheduled]) -> torch.Tensor | None:
        """The in-flight launch's last samples, which the plan's fed rows read (or None)."""
        if not any(item.fed for item in plan):
            return None
        assert self._in_flight is not None and self._in_flight.sampled is not None
        return self._in_flight.sampled

    def _first_tokens(self, plan: list[Scheduled]) -> list[int] | torch.Tensor:
        """Each row's first token: its tail on the host, or, for fed rows, its last pending
        token on the device (then all of them travel as one device tensor)."""
        fed = self._fed_tokens(plan)
        if fed is None:
            return [item.seq.token_ids[-1] for item in plan]
        sampling = self._in_flight.sampling  # type: ignore[union-attr]
        if len(plan) == len(sampling) and all(
            item.fed and item.seq is seq for item, seq in zip(plan, sampling, strict=True)
        ):
            return fed  # the same rows in the same order (most steps): nothing to pick
        rows = self._in_flight.rows  # type: ignore[union-attr]
        first = torch.tensor(
            [0 if item.fed else item.seq.token_ids[-1] for item in plan], dtype=torch.long
        ).to(fed.device, non_blocking=True)
        picked = [(i, rows[item.seq.request_id]) for i, item in enumerate(plan) if item.fed]
        dst = torch.tensor([i for i, _ in picked]).to(fed.device, non_blocking=True)
        src = torch.tensor([r for _, r in picked]).to(fed.device, non_blocking=True)
        first[dst] = fed[src]
        return first

    def _forward(
        self, spans: list[Span], fed: torch.Tensor | None
    ) -> tuple[list[torch.Tensor], dict[int, Exception]]:
        """The step's forward pass: each span's logits, and what the spans that fail alone
        raised (none when the batch went through; their logits are placeholders). If the batch
        raises, each span runs again alone; if none succeeds, the fault is the engine's: raise.
        """
        runner = self.engine.runner
        if fed is not None:
            rows = self._in_flight.rows  # type: ignore[union-attr]
            for span in spans:
                if span.fed is not None:
                    span.fed = rows[span.seq.request_id]
        try:
            return runner.forward(spans, fed=fed), {}
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
                    logits += runner.forward([span], fed=fed)
                except Exception as alone:
                    failed[i] = alone
                    logits.append(torch.empty(0))
            if len(failed) == len(spans):
                raise
            return logits, failed


def _checked_rows(seqs: list[Sequence]) -> list[int]:
    """The rows of sequences whose tokens are drawn without their grammar's mask and checked
    as they are committed (`sampling.drawn_then_checked`), without logprobs (a token drawn
    again would have none): a launch keeps their raw logits, so that a refused token is drawn
    again under the mask at its commit (`sampling.redrawn`), not in a launch of its own."""
    return [i for i, s in enumerate(seqs) if s.grammar is not None
            and s.params.logprobs is None and sampling.drawn_then_checked(s)]  # fmt: skip


def _kept(seqs: list[Sequence], rows: list[int], kept: list[torch.Tensor]) -> dict:
    """`rows`' logits [steps, V] by request id, from `kept` (one [rows, V] a step)."""
    stacked = torch.stack(kept, 1) if rows else None
    return {seqs[i].request_id: stacked[r] for r, i in enumerate(rows)}


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
    """A plan item's share of the forward: its scheduled tail, then what its decoder proposed.
    A fed row's one token is its last pending one, fed on the device (`Span.fed`)."""
    seq = item.seq
    if item.fed:
        return Span(seq, [0], 1, offset=seq.fed_offset, fed=-1)  # (its row is set at launch)
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
