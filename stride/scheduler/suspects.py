"""Bisection of batched failures: which sequences of a batch run apart, and when.

A batched call (a decoder's `propose` or `commit`, a model group's step) that raises cannot be
pinned on one of its sequences. They become suspects, split in two groups per batch key (a
decoder's name, a model group), which run before anything else of that key, one group per step,
until the one that fails alone is found: a few steps for one culprit. A group that goes
through is cleared; a finished request is nobody's suspect.
"""

from __future__ import annotations

from collections.abc import Hashable

from stride.engine.sequence import Sequence
from stride.scheduler.policy import Scheduled


class Suspects:
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
