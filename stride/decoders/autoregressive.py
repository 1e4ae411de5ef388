"""Plain decoding: score the last token, sample one."""

from __future__ import annotations

import torch

from stride.decoders import sampling
from stride.decoders.base import (
    UNLIMITED,
    Commit,
    Decoder,
    Proposal,
    Scored,
    StepContext,
    plain_commits,
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


def commit_plain(seqs: list[Sequence], scored: Scored, ctx: StepContext) -> list[Commit]:
    """Plain steps' commits: the tokens sampled on the device, or one token per sequence
    sampled here from its single logits row."""
    if scored.tokens is not None:
        return plain_commits(scored)
    assert scored.logits is not None
    return sample_one_each(seqs, scored.logits, ctx)


def sample_one_each(
    seqs: list[Sequence], logits: list[torch.Tensor], ctx: StepContext
) -> list[Commit]:
    """One token per sequence from its single logits row, in one batched draw."""
    rows = [sampling.Row(s) for s in seqs]
    stacked = torch.cat(logits)
    tokens = sampling.sample(stacked, rows, ctx.eos_ids)  # synchronises with the device
    lps = sampling.logprobs(stacked, tokens, rows)
    return [Commit([t], [lp]) for t, lp in zip(tokens, lps, strict=True)]
