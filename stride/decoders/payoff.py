"""Does refining pay? `jacobi`, `lookahead` and `introspective` with default options choose by
measurement between refining passes and plain steps (`Adaptive`, their side of it).

A model that was not trained to guess its future accepts few guesses (Jacobi on the default
model barely more than one token per pass: docs/BENCHMARKS.md), and a refining pass costs more
than a plain step: more rows to score, and no greedy bursts on the device. Refining can then be
slower than `ar`, and a request that named a method without tuning it should not pay for that.
So a method's adaptive sequences run in epochs of `EPOCH` steps, all in one mode: plain (they
decode as `ar` does, greedy bursts included) or refining. Each epoch measures what its mode
delivered, tokens committed per second per sequence, at its batch-size bucket; the faster mode
runs next, refining only if it beats plain by `MIN_GAIN`. The other mode is tried again later,
since what it measured goes stale (the batch changes, the text gets more predictable). What a
try of a losing mode costs is kept to a small share of the time, however slow that mode is:
  - a try ends after `PROBE` steps if it is already losing, and a try of refining after its
    first step if even the most tokens a refining step can commit (`most`) would lose at the
    time that step took;
  - the wait until the next try, in epochs at the same bucket, is at least `EXPLORE_EVERY`
    times how many times slower the mode measured there (so that a try of one step takes about
    1/(`EXPLORE_EVERY` × `EPOCH`) of the time, a try of `PROBE` steps a few times that, however
    slow the mode), up to `LONGEST_WAIT` (a measure that far off may have timed a one-off, such
    as a compile), and doubles each time it loses there again, the doubling up to `MAX_WAIT`;
    each bucket keeps its own wait, since a mode that loses at one batch size may win at
    another (EAGLE's loop does, at 8 sequences, what it cannot at one);
  - a bucket that has measured one mode and not the other borrows the other's rate from a
    neighbouring bucket that has both (scaled by the ratio there), instead of trying it at
    once: a batch that shrinks as its requests finish passes through every bucket below it. A
    bucket with no such neighbour (a batch that jumps there) tries the mode itself.
Epochs start plain (the first refining epoch is then a try against a measured plain rate) unless
the owner says otherwise. The speculative decoder uses the same epochs for its adaptive requests
(those its device loop drafts apart from the others), drafting as the refining mode, and starts
there (its policies time plain steps on their own first).
A sequence in a plain epoch is promised plain steps up to the next try (`plain_steps`), not to
the epoch's end, so that the executor keeps its launches in flight as it does for `ar`; steps
promised before the mode changed are the measure of neither mode.

Wall time is what is measured, so whatever a mode costs counts, on any device: its forwards,
its host work, the bursts it allows. An epoch's clock starts at the step that ended the epoch
before (the first step ever only starts it), and an epoch interrupted by a pause (no adaptive
sequence for a while) is dropped, not measured. A pause is a gap between two records far longer
(`PAUSE` times) than the mode's steps take: the epoch's mean step so far, else the mode's mean
in its last epoch, and never less than the launch's own time (`StepContext.timing`), so that a
mode whose steps are slow is measured as slow, not taken for an idle server.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from stride.decoders.base import Commit, Proposal, Scored, StepContext, plain_commits
from stride.decoders.rates import MIN_GAIN, bucket, ema
from stride.engine.sequence import Sequence

EPOCH = 16  # steps per measured epoch
PROBE = 4  # steps after which a probe of the mode out of favour may end, already losing
EXPLORE_EVERY = 8  # epochs of the faster mode before a slower one is tried again (at least)
MAX_WAIT = 64  # the longest that doubling makes the wait, in epochs
LONGEST_WAIT = 1024  # the longest wait, in epochs, however much slower the mode measured
PAUSE = 20.0  # records this many times a step's time apart: the epoch is dropped


@dataclass
class Tries:
    """When a bucket tries the mode out of favour again: after `wait` epochs there (`since` so
    far), which grows with the tries it lost in a row (`losses`)."""

    wait: int = EXPLORE_EVERY
    since: int = 0
    losses: int = 0


class Payoff:
    """One method's choice between refining and plain steps, shared by its adaptive sequences."""

    def __init__(
        self, most: int, clock: Callable[[], float] = time.perf_counter, refining: bool = False
    ) -> None:
        """`refining`: the first epoch's mode."""
        self.most = most  # the most tokens a refining step commits per sequence
        self.clock = clock
        self.refining = refining
        self.rates: dict[int, dict[bool, float]] = {}  # bucket -> mode -> tokens/s/sequence
        self.epochs = 0  # epochs measured so far
        self._tries: dict[int, Tries] = {}  # bucket -> when the mode out of favour is tried
        self._key: int | None = None  # the bucket of the last epoch measured
        self._probing = False  # this epoch tries the mode out of favour (or not yet measured)
        self._start: float | None = None  # when the epoch's clock started
        self._last = 0.0
        self._steps = 0
        self._tokens = 0
        self._rows = 0  # sequence-steps in the epoch
        self._step_s: dict[bool, float] = {}  # each mode's mean step time in its last epoch

    def plain_steps(self) -> int:
        """Plain steps a sequence may be promised now: to the end of this epoch, and on through
        the plain epochs after it, up to the next try of refining. (A promise the executor sees
        beyond its launch keeps that launch in flight: epochs are no reason to wait for one.)"""
        left = max(1, EPOCH - self._steps)
        if self.refining or self._probing or self._key is None:
            return left
        tries = self._tries.get(self._key, Tries())
        return left + EPOCH * max(0, tries.wait - tries.since - 1)

    def record(
        self, batch: int, tokens: int, launch_s: float | None, refining: bool, steps: int = 1
    ) -> None:
        """`steps` steps of `batch` adaptive sequences committed `tokens` in all (one step, or a
        greedy burst of plain ones), in a launch of `launch_s` seconds (None: not known), in the
        mode `refining` says: steps of the other one were promised before this epoch began and
        are not its measure (its clock starts after them)."""
        now = self.clock()
        if refining != self.refining:
            self._restart(now)
            return
        if self._start is not None:
            if self._steps:
                mean: float | None = (self._last - self._start) / self._steps
            else:
                mean = self._step_s.get(self.refining)
            step_s = max(mean or 0.0, (launch_s or 0.0) / steps)
            if step_s > 0 and now - self._last > PAUSE * steps * step_s:
                self._start = None  # a pause: this epoch measures nothing
        if self._start is None:
            self._restart(now)
            return
        self._last = now
        self._steps += steps
        self._tokens += tokens
        self._rows += batch * steps
        if self._steps >= EPOCH or self._probe_lost(now):
            self._end_epoch(now)

    def _measured(self, now: float) -> tuple[int, float] | None:
        """This epoch's batch-size bucket, and the rate it has made so far."""
        seconds = now - self._start
        if seconds <= 0:
            return None
        batch = self._rows / self._steps
        return bucket(round(batch)), self._tokens / seconds / batch

    def _probe_lost(self, now: float) -> bool:
        """A try that has run `PROBE` steps and is already slower than the other mode, or a
        try of refining that could not win even committing `most` tokens a step."""
        if not self._probing:
            return False
        measured = self._measured(now)
        rates = {} if measured is None else self.rates.get(measured[0], {})
        if (not self.refining) not in rates:  # (nothing to lose to yet)
            return False
        if self.refining:
            best = measured[1] * self.most * self._rows / self._tokens if self._tokens else 0.0
            if not _refining_wins({**rates, True: best}):
                return True
        if self._steps < PROBE:
            return False
        return _refining_wins({**rates, self.refining: measured[1]}) != self.refining

    def _end_epoch(self, now: float) -> None:
        self._step_s[self.refining] = (now - self._start) / self._steps
        measured = self._measured(now)
        if measured is not None:
            key, rate = measured
            rates = self.rates.setdefault(key, {})
            rates[self.refining] = ema(rates.get(self.refining), rate, 0.5)
            self._borrow(key)
            self.epochs += 1
            self._key = key
            self.refining = self._next(rates, self._tries.setdefault(key, Tries()))
        self._restart(now)

    def _restart(self, now: float) -> None:
        """The epoch's clock starts now, with nothing counted."""
        self._start = self._last = now
        self._steps = self._tokens = self._rows = 0

    def _borrow(self, key: int) -> None:
        """The mode bucket `key` has not measured, from a neighbouring bucket that has both (its
        ratio there, applied to the rate measured here; the one below first)."""
        rates, other = self.rates[key], not self.refining
        if other in rates:
            return
        for k in (key - 1, key + 1):
            near = self.rates.get(k, {})
            if len(near) == 2:
                rates[other] = rates[self.refining] * near[other] / near[self.refining]
                return

    def _next(self, rates: dict[bool, float], tries: Tries) -> bool:
        """The next epoch's mode, now that this one's mode has a rate in `rates`, at the bucket
        whose `tries` these are."""
        other, tried = not self.refining, self._probing
        self._probing = other not in rates
        if self._probing:
            return other
        faster = _refining_wins(rates)
        if tried and faster == other:  # the try lost (again): wait longer before the next
            tries.losses += 1
            slower = rates[other] / rates[self.refining]
            doubled = min(EXPLORE_EVERY << (tries.losses - 1), MAX_WAIT)
            tries.wait = max(doubled, min(round(EXPLORE_EVERY * slower), LONGEST_WAIT))
        elif tried:  # it won: its epoch is the first of the mode now in favour
            tries.losses, tries.wait = 0, EXPLORE_EVERY
        if faster != self.refining:
            tries.since = 0
            return faster
        tries.since += 1
        if tries.since >= tries.wait:
            tries.since, self._probing = 0, True
            return other
        return faster


class Adaptive:
    """A refine method's side of the choice: its adaptive requests (default options, flagged
    `adaptive` in them) take plain steps while its `payoff` (set by the method) says refining
    does not pay, and every step of theirs is measured for it."""

    payoff: Payoff

    def plain(self, seq: Sequence) -> bool:
        """Does `seq` take a plain step (its method measured that refining does not pay)?"""
        return seq.decoder_options.get("adaptive", False) and not self.payoff.refining

    def plain_proposal(self) -> Proposal:
        """An adaptive sequence in a plain epoch decodes as `ar` until refining is tried again."""
        return Proposal(plain_steps=self.payoff.plain_steps())

    def commit_plain(self, scored: Scored, ctx: StepContext) -> list[Commit]:
        """Plain steps of adaptive sequences, sampled on the device: counted for `payoff`."""
        commits = plain_commits(scored)
        steps = max(c.forward_passes for c in commits)
        made = sum(len(c.tokens) for c in commits)
        self.payoff.record(len(commits), made, ctx.timing, False, steps)
        return commits

    def measure(
        self,
        seqs: list[Sequence],
        proposals: list[Proposal],
        commits: list[Commit],
        ctx: StepContext,
    ) -> None:
        """The step's tokens of adaptive sequences, for `payoff`: a step that refined any is a
        refining step (its time is a refining pass's), and counts those that refined."""
        adaptive = [(bool(p.tokens), len(c.tokens))
                    for s, p, c in zip(seqs, proposals, commits, strict=True)
                    if s.decoder_options.get("adaptive") and c.tokens]  # fmt: skip
        if not adaptive:
            return
        refining = any(refined for refined, _ in adaptive)
        made = [n for refined, n in adaptive if refined == refining]
        self.payoff.record(len(made), sum(made), ctx.timing, refining)


def _refining_wins(rates: dict[bool, float]) -> bool:
    """Refining is the faster mode only by `MIN_GAIN`: a tie goes to plain steps."""
    return rates[True] >= MIN_GAIN * rates[False]
