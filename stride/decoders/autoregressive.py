"""Plain decoding: score the last token, sample one."""

from __future__ import annotations

from stride.decoders.base import (
    UNLIMITED,
    Commit,
    Decoder,
    Proposal,
    Scored,
    StepContext,
    commit_plain,
)
from stride.decoders.catalog import AR
from stride.engine.sequence import Sequence

FOR_GOOD = Proposal(plain_steps=UNLIMITED)  # shared: nobody mutates a proposal


class Autoregressive(Decoder):
    name = AR

    def propose(self, seqs: list[Sequence], ctx: StepContext) -> list[Proposal]:
        return [FOR_GOOD] * len(seqs)

    def commit(
        self,
        seqs: list[Sequence],
        proposals: list[Proposal],
        scored: Scored,
        ctx: StepContext,
    ) -> list[Commit]:
        return commit_plain(seqs, scored, ctx)
