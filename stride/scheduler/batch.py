"""The plain records a step passes along: `Batch` (what runs) and `StepResult` (what it made).

`scheduler.schedule()` picks the step's work (a `Plan` of `Scheduled` items); the decoders'
proposals turn it into a `Batch`; `executor.run(batch)` runs it on the device and hands back a
`StepResult` for every launch that finished; `EngineCore.apply` turns results into outputs.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field
from functools import cached_property

import torch

from stride.decoders.base import Burst, Commit, Proposal
from stride.engine.sequence import Sequence
from stride.scheduler.policy import Scheduled

Failure = tuple[Sequence, Exception, str]  # a sequence, what it raised, and while doing what


@dataclass
class Batch:
    """A scheduled step: its plan, each item's proposal (None where its tail is not complete:
    a prefill chunk), and, where a decoder runs the whole step as passes of its own on the
    device, that `burst` instead."""

    plan: list[Scheduled]
    proposals: list[Proposal | None]
    alone: bool = False  # nobody waits to be scheduled and no model group runs beside it
    burst: Burst | None = None
    # Each item's sequence's count of refused tokens as the step was made: a row commits only
    # where its grammar has refused nothing since, for a refused token voids every launch made
    # after the one that drew it and before its commit (`DecoderSet.live`).
    refusals: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.refusals:
            self.refusals = [item.seq.refusals for item in self.plan]

    @property
    def seqs(self) -> list[Sequence]:
        return [item.seq for item in self.plan]

    @cached_property
    def by_decoder(self) -> dict[str, list[int]]:
        """The plan indices that complete their tail, by decoder."""
        out: dict[str, list[int]] = defaultdict(list)
        for i, item in enumerate(self.plan):
            if item.completes_tail:
                out[item.seq.decoder].append(i)
        return out

    def without(self, dropped: Collection[int]) -> Batch:
        kept = [i for i in range(len(self.plan)) if i not in dropped]
        return Batch(
            [self.plan[i] for i in kept],
            [self.proposals[i] for i in kept],
            self.alone,
            refusals=[self.refusals[i] for i in kept],
        )


@dataclass
class PromptRows:
    """Logits rows that score prompt tokens (`prompt_logprobs`), from position `first` on."""

    seq: Sequence
    first: int
    logits: torch.Tensor


@dataclass
class Chunk:
    """A prefill chunk a launch scored (a tail of several tokens): `tokens` of the sequence's
    prompt (or, after a preemption, of its tokens) after `cached`."""

    seq: Sequence
    tokens: int
    cached: int


@dataclass
class StepResult:
    """What one launch made: each committing plan item's `Commit`, the prompt rows and prefill
    chunks it scored, the sequences that failed in it, and the `passes` of the target it ran."""

    batch: Batch
    commits: dict[int, Commit] = field(default_factory=dict)  # by plan index
    prompt_rows: list[PromptRows] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)
    launched_at: float = field(default_factory=time.monotonic)
    passes: int = 1
