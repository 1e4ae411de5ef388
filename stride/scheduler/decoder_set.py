"""The one place that calls the decoders: grouped by decoder, each call isolated per request.

One request's failure is that request's error, never the engine's. Work done for one sequence
(its `extra_tokens`, releasing its state) fails that sequence. A batched call (a decoder's
`propose` or `commit` over its sequences, a model group's step) that raises cannot be pinned on
one of them: its sequences drop their decoder state (as on preemption), become suspects, and run
again in halves, one half per step with the decoder's other sequences held back, until the one
that fails alone is found (bisection: `Suspects`). Failures are collected in `failed`; the core
ends those requests with an error.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Hashable, Iterator, Mapping

from stride.decoders.base import (
    Commit,
    Decoder,
    ModelGroup,
    Proposal,
    Scored,
    StepContext,
)
from stride.engine.sequence import Sequence, Status
from stride.scheduler.batch import Batch, Failure
from stride.scheduler.policy import Scheduled

log = logging.getLogger(__name__)


class DecoderSet(Mapping[str, Decoder]):
    """The server's decoders by name (a read-only mapping), and every call made to them."""

    def __init__(self, decoders: dict[str, Decoder], ctx: StepContext, burst_steps: int) -> None:
        self.decoders = decoders
        self.ctx = ctx
        self.burst_steps = burst_steps  # passes a decoder's own burst may run (1: none)
        self.suspects = Suspects()
        self.failed: list[Failure] = []

    def __getitem__(self, name: str) -> Decoder:
        return self.decoders[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.decoders)

    def __len__(self) -> int:
        return len(self.decoders)

    def take_failed(self) -> list[Failure]:
        failed, self.failed = self.failed, []
        return failed

    # ---- one sequence at a time --------------------------------------------------------------

    def extra_tokens(self, seq: Sequence, cap: int) -> int:
        """The scheduler asks how many tokens `seq`'s decoder adds after its tail."""
        try:
            return self.decoders[seq.decoder].extra_tokens(seq, cap)
        except Exception as e:
            self.failed.append((seq, e, "scheduling"))
            return 0

    def preempted(self, seq: Sequence) -> None:
        """The scheduler preempted `seq`: its decoder state goes (rebuilt from the tokens)."""
        try:
            self.decoders[seq.decoder].release(seq, self.ctx)
        except Exception as e:
            self.failed.append((seq, e, "preempting"))

    def release(self, seq: Sequence) -> None:
        """`seq` is over either way; a decoder that fails to release it may leak a little."""
        try:
            self.decoders[seq.decoder].release(seq, self.ctx)
        except Exception:
            log.exception("releasing the decoder state of request %s failed", seq.request_id)

    def reset(self, seq: Sequence) -> bool:
        """Drop `seq`'s decoder state, as preemption does; False (and `seq` failed) if even
        that raised."""
        try:
            self.decoders[seq.decoder].release(seq, self.ctx)
        except Exception as e:
            self.failed.append((seq, e, "resetting the decoder of"))
            return False
        return True

    # ---- batched calls -----------------------------------------------------------------------

    def propose(self, plan: list[Scheduled], alone: bool) -> Batch:
        """The step's `Batch`: each decoder's proposals for its sequences (fed rows, whose
        plain steps were promised before, ask nobody), or a decoder's own burst."""
        failed = {seq.request_id for seq, _, _ in self.failed}
        plan = [item for item in plan if item.seq.request_id not in failed]
        plan = self.suspects.without_held(plan)
        batch = Batch(plan, [None] * len(plan), alone and not self.suspects)
        burst = self._burst(batch)
        if burst is not None:
            batch.burst = burst
            return batch
        dropped: set[int] = set()
        promises: dict[int, Proposal] = {}  # (most fed rows share their promise)
        for name, idx in batch.by_decoder.items():
            asked = [i for i in idx if not plan[i].fed]
            for i in idx:
                if plan[i].fed:
                    left = plan[i].seq.promised
                    prop = promises.get(left)
                    if prop is None:
                        prop = promises[left] = Proposal(plain_steps=left)
                    batch.proposals[i] = prop
            if not asked:
                continue
            seqs = [plan[i].seq for i in asked]
            try:
                props = self.decoders[name].propose(seqs, self.ctx)
                _check_count(name, "proposals", props, seqs)
            except Exception as e:
                self._batch_failed(name, seqs, "proposing for", e)
                dropped.update(asked)
                continue
            for i, prop in zip(asked, props, strict=True):
                if len(prop.tokens) > plan[i].extra:
                    error = RuntimeError(f"decoder {name} proposed more tokens than it reserved")
                    self.failed.append((plan[i].seq, error, "proposing for"))
                    dropped.add(i)
                else:
                    batch.proposals[i] = prop
        return batch.without(dropped) if dropped else batch

    def _burst(self, batch: Batch):
        """A decoder's own passes on the device, when the whole step is its sequences' decodes,
        nobody waits and bursts are on."""
        groups = batch.by_decoder
        if self.burst_steps <= 1 or not batch.alone or len(groups) != 1:
            return None
        ((name, idx),) = groups.items()
        plan = batch.plan
        if len(idx) != len(plan) or any(item.num_tail != 1 or item.fed for item in plan):
            return None
        try:
            return self.decoders[name].burst(batch.seqs, self.burst_steps, self.ctx)
        except Exception:
            log.exception("decoder %s: a burst failed to start; proposing instead", name)
            return None

    def commit(self, batch: Batch, scored: dict[str, Scored]) -> dict[int, Commit]:
        """Each decoder's commits for its live sequences from what the target made of them
        (`scored[name]` lists its live ones' rows in plan order), by plan index."""
        plan, out = batch.plan, {}
        for name, idx in self.live(batch).items():
            seqs = [plan[i].seq for i in idx]
            proposals = [batch.proposals[i] for i in idx]
            try:
                commits = self.decoders[name].commit(seqs, proposals, scored[name], self.ctx)
                _check_count(name, "commits", commits, seqs)
            except Exception as e:
                self._batch_failed(name, seqs, "committing for", e)
                continue
            self.suspects.passed(name, seqs)
            out.update(zip(idx, commits, strict=True))
        return out

    def live(self, batch: Batch) -> dict[str, list[int]]:
        """Each decoder's plan indices whose tail completes and whose sequence still runs
        (aborts and expired deadlines finish sequences between a launch and its commit) from
        where the row started: its grammar has refused no token since the launch was made
        (`Batch.refusals`: the row continued from that token)."""
        plan, refusals = batch.plan, batch.refusals
        out = {}
        for name, idx in batch.by_decoder.items():
            idx = [i for i in idx if (seq := plan[i].seq).status is not Status.FINISHED
                   and seq.refusals == refusals[i]]  # fmt: skip
            if idx:
                out[name] = idx
        return out

    def step_groups(self, seqs: list[Sequence]) -> list[tuple[Sequence, Commit]]:
        """One batched pass of every model group (diffusion LMs) over all of its sequences."""
        groups: dict[ModelGroup, list[Sequence]] = defaultdict(list)
        for seq in seqs:
            group = self.decoders[seq.decoder].model_group(seq)
            if group is not None:
                groups[group].append(seq)
        out = []
        for group, members in groups.items():
            active = self.suspects.active(group, members)
            if active is not None:
                members = [s for s in members if s.request_id in active]
            try:
                commits = group.step(members, self.ctx)
                _check_count(type(group).__name__, "commits", commits, members)
            except Exception as e:
                self._batch_failed(group, members, "stepping the model group of", e)
                continue
            self.suspects.passed(group, members)
            out += zip(members, commits, strict=True)
        return out

    def _batch_failed(
        self, key: Hashable, seqs: list[Sequence], what: str, error: Exception
    ) -> None:
        """A batched call over `seqs` raised: fail the one sequence, or bisect several (they
        start afresh and run apart until the one that fails alone is found)."""
        if len(seqs) == 1:
            self.failed.append((seqs[0], error, what))
            return
        log.warning(
            "%s %d sequences failed (%s: %s); running them apart to find the one",
            what,
            len(seqs),
            type(error).__name__,
            error,
        )
        self.suspects.split(key, [s.request_id for s in seqs if self.reset(s)])


def _check_count(name: str, what: str, got: list, seqs: list[Sequence]) -> None:
    if len(got) != len(seqs):
        raise RuntimeError(f"{name} returned {len(got)} {what} for {len(seqs)} sequences")


class Suspects:
    """Which sequences of a failed batched call run apart, and when: split in two groups per
    batch key (a decoder's name, a model group), which run before anything else of that key, one
    group per step, until the one that fails alone is found: a few steps for one culprit. A group
    that goes through is cleared; a finished request is nobody's suspect."""

    def __init__(self) -> None:
        # Per batch key, groups of request ids to run apart, first group first.
        self._groups: dict[Hashable, list[set[str]]] = {}

    def __bool__(self) -> bool:
        return bool(self._groups)

    def split(self, key: Hashable, ids: list[str]) -> None:
        """A batched call of `key` over `ids` failed: they run in two halves, before the groups
        of `key` that were suspects already."""
        half = (len(ids) + 1) // 2
        rest = [g - set(ids) for g in self._groups.get(key, [])]
        groups = [g for g in (set(ids[:half]), set(ids[half:]), *rest) if g]
        if groups:
            self._groups[key] = groups

    def passed(self, key: Hashable, seqs: list[Sequence]) -> None:
        """A batched call over `seqs` went through: they are suspects no more."""
        groups = self._groups.get(key)
        if groups:
            ids = {s.request_id for s in seqs}
            groups = [g - ids for g in groups if g - ids]
            if groups:
                self._groups[key] = groups
            else:
                del self._groups[key]

    def active(self, key: Hashable, candidates: list[Sequence]) -> set[str] | None:
        """The suspect group of `key` that runs this step: the first one with a member among
        `candidates`; None: no suspects there, all of them run as usual."""
        ids = {s.request_id for s in candidates}
        return next((g for g in self._groups.get(key, ()) if g & ids), None)

    def clear(self, request_id: str) -> None:
        """A finished request is nobody's suspect (no suspects left: bursts again)."""
        for key in list(self._groups):
            groups = [g - {request_id} for g in self._groups[key]]
            if any(groups):
                self._groups[key] = [g for g in groups if g]
            else:
                del self._groups[key]

    def without_held(self, plan: list[Scheduled]) -> list[Scheduled]:
        """The plan without the sequences that a suspect group of their decoder holds back."""
        if not self._groups:
            return plan
        active: dict[str, set[str] | None] = {}
        for name in {item.seq.decoder for item in plan} & self._groups.keys():
            active[name] = self.active(name, [i.seq for i in plan if i.seq.decoder == name])
        return [
            item
            for item in plan
            if active.get(item.seq.decoder) is None
            or item.seq.request_id in active[item.seq.decoder]
        ]
