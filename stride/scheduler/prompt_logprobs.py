"""Prompt logprobs: the log-probability of every prompt token, from the prefill that runs anyway.

A request that asks for them (`echo` with `logprobs`, or vLLM's `prompt_logprobs`: lm-eval's
loglikelihood tasks score their choices so) has its prefill chunks return logits for the rows
that score prompt tokens not scored yet, besides the decoder's rows: row p scores token p + 1.
Only those rows reach the head, and only for such requests. Their prompt never comes from the
prefix cache (the cached rows would never be scored): the scheduler skips the lookup until every
prompt token has its logprob. They go out with the sequence's first output.
"""

from __future__ import annotations

import torch

from stride.decoders import sampling
from stride.engine.sequence import Sequence


def rows_wanted(seq: Sequence, start: int, num_tail: int) -> tuple[int, int] | None:
    """(first position, count) of the rows of a chunk at `start` of `num_tail` tokens that score
    prompt tokens without a logprob yet; None: no such rows."""
    if seq.prompt_logprobs is None:
        return None
    first = max(start, len(seq.prompt_logprobs) - 1)
    last = min(start + num_tail - 1, len(seq.prompt_ids) - 2)
    return (first, last - first + 1) if last >= first else None


def record(seq: Sequence, first: int, logits: torch.Tensor) -> None:
    """The logprobs of the prompt tokens that `logits` rows from position `first` on score
    (`first` is the position of the first token without one: what `rows_wanted` said)."""
    tokens = seq.prompt_ids[first + 1 : first + 1 + len(logits)]
    seq.prompt_logprobs += sampling.scored(logits, tokens, seq.params.prompt_logprobs or 0)
