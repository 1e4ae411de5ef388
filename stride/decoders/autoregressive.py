"""Plain decoding: score the last token, sample one."""

from __future__ import annotations

import torch

from stride.decoders import sampling
from stride.decoders.base import Commit, Decoder, Proposal, StepContext
from stride.decoders.catalog import AR
from stride.engine.sequence import Sequence

_NOTHING = Proposal()  # shared: nobody mutates a proposal, and a step makes one per sequence


class Autoregressive(Decoder):
    name = AR

    def propose(self, seqs: list[Sequence], ctx: StepContext) -> list[Proposal]:
        return [_NOTHING] * len(seqs)

    def commit(
        self,
        seqs: list[Sequence],
        proposals: list[Proposal],
        logits: list[torch.Tensor],
        ctx: StepContext,
    ) -> list[Commit]:
        return sample_one_each(seqs, logits, ctx)

    def plain_steps(self, seqs: list[Sequence]) -> int:
        return 1 << 30  # plain decoding, for any number of steps

    def may_launch_ahead(self) -> bool:
        return True  # the next plan is the scheduler's alone


def sample_one_each(
    seqs: list[Sequence], logits: list[torch.Tensor], ctx: StepContext
) -> list[Commit]:
    """One token per sequence from its single logits row, in one batched draw."""
    rows = [sampling.Row(s) for s in seqs]
    stacked = torch.cat(logits)
    tokens = sampling.sample(stacked, rows, ctx.eos_ids)  # synchronises with the device
    lps = sampling.logprobs(stacked, tokens, rows)
    return [Commit([t], [lp]) for t, lp in zip(tokens, lps, strict=True)]
