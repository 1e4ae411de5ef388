"""Plain decoding: score the last token, sample one."""

from __future__ import annotations

import torch

from stride.decoders import sampling
from stride.decoders.base import Commit, Decoder, Proposal, StepContext
from stride.engine.sequence import Sequence

_NOTHING = Proposal()  # shared: nobody mutates a proposal, and a step makes one per sequence


class Autoregressive(Decoder):
    name = "ar"

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

    @staticmethod
    def fusable(seq: Sequence) -> bool:
        """May this sequence's next tokens come from fused decode steps (`device_sample`)?

        Greedy, with nothing that needs the host between two tokens: no logit bias, penalties,
        pending min_tokens, logprobs or grammar.
        """
        return seq.params.logprobs is None and sampling.plain_greedy(sampling.Row(seq))

    @staticmethod
    def device_sample(logits: torch.Tensor) -> torch.Tensor:
        """The token of each `fusable` row, left on the device: the argmax."""
        return logits.argmax(-1)


def sample_one_each(
    seqs: list[Sequence], logits: list[torch.Tensor], ctx: StepContext
) -> list[Commit]:
    """One token per sequence from its single logits row, in one batched draw."""
    rows = [sampling.Row(s) for s in seqs]
    stacked = torch.cat(logits)
    tokens = sampling.sample(stacked, rows, ctx.eos_ids)  # synchronises with the device
    lps = sampling.logprobs(stacked, tokens, rows)
    return [Commit([t], [lp]) for t, lp in zip(tokens, lps, strict=True)]
