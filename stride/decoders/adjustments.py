"""A launch's logit biases and penalties as per-row tensors, added to the logits (`apply`).

Both ways of drawing add them here, so a seeded row draws the same tokens either way: the
host's (`sampling.adjust`), from each row's whole history, and a draw on the device (bursts,
launches kept in flight), which has no host between its steps: what a row adds to its logits
travels with the launch's settings (`sampling.DrawSettings.adjustments`), built once at launch,
its logit bias as (ids, values) and for rows with penalties the counts of their output tokens so
far, which each of the launch's draws brings up to date on the device (`count`). A row without
an adjustment is left as it is (a bias of 0 at token 0, a repetition penalty of 1, frequency and
presence of 0).

Counts start from the tokens the host has committed; a row whose tokens are still in flight
(the launch before this one, not committed yet) has those counted on the device, from that
launch's samples (`count_rows`, `Executor._draw_settings`). A launch of the same rows as the
one in flight shares its adjustments, counts included: that launch's draws, queued first,
count its tokens before this launch's draws read them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stride.engine.sequence import Sequence


@dataclass
class Adjustments:
    """Per-row tensors on the logits' device; None where no row of the launch has one."""

    bias: tuple[torch.Tensor, torch.Tensor] | None  # [B, K] token ids, [B, K] values
    counts: torch.Tensor | None  # [B, V] float32: each row's output tokens so far, by id
    prompt: torch.Tensor | None  # [B, V] bool: the tokens of each row's prompt
    penalties: torch.Tensor | None  # [3, B, 1] float32: repetition, frequency, presence


def build(
    seqs: list[Sequence],
    vocab: int,
    device: torch.device,
    pending: list[list[int]] | None = None,
) -> Adjustments | None:
    """The adjustments of rows drawing for `seqs` over logits of `vocab` columns, or None where
    no row has a logit bias or a penalty. `pending`: each row's tokens past its committed ones
    that its penalties count too (the host's draws: drafts, tokens it drew before)."""
    bias = _bias(seqs, device)
    penalized = [i for i, s in enumerate(seqs) if s.params.has_penalties]
    if bias is None and not penalized:
        return None
    if not penalized:
        return Adjustments(bias, None, None, None)
    rows, ids, prompt_rows, prompt_ids = [], [], [], []
    for i in penalized:
        seq = seqs[i]
        output = [t for t in seq.output_ids + (pending[i] if pending else []) if t < vocab]
        rows += [i] * len(output)
        ids += output
        if seq.params.repetition_penalty != 1.0:
            prompt = [t for t in seq.prompt_ids if t < vocab]
            prompt_rows += [i] * len(prompt)
            prompt_ids += prompt
    counts = torch.zeros(len(seqs), vocab, device=device)
    counts.index_put_(_at(rows, ids, device), torch.ones(len(ids), device=device), accumulate=True)
    prompt_seen = torch.zeros(len(seqs), vocab, dtype=torch.bool, device=device)
    prompt_seen[_at(prompt_rows, prompt_ids, device)] = True
    coefficients = [(s.params.repetition_penalty, s.params.frequency_penalty,
                     s.params.presence_penalty) for s in seqs]  # fmt: skip
    penalties = _to(np.ascontiguousarray(np.float32(coefficients).T[..., None]), device)
    return Adjustments(bias, counts, prompt_seen, penalties)


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device, copied behind whatever the device is running."""
    return torch.from_numpy(array).to(device, non_blocking=True)


def _at(rows: list[int], ids: list[int], device: torch.device) -> tuple[torch.Tensor, ...]:
    return _to(np.array(rows, dtype=np.int64), device), _to(np.array(ids, dtype=np.int64), device)


def _bias(seqs: list[Sequence], device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    width = max((len(s.params.logit_bias) for s in seqs), default=0)
    if not width:
        return None
    ids = np.zeros((len(seqs), width), dtype=np.int64)
    values = np.zeros((len(seqs), width), dtype=np.float32)
    for i, seq in enumerate(seqs):
        bias = seq.params.logit_bias
        ids[i, : len(bias)] = list(bias)
        values[i, : len(bias)] = list(bias.values())
    return _to(ids, device), _to(values, device)


def apply(logits: torch.Tensor, a: Adjustments | None) -> torch.Tensor:
    """The logits with the rows' bias, then their penalties (OpenAI's and vLLM's order): a new
    tensor, or the logits themselves where there is nothing to add."""
    if a is None:
        return logits
    if a.bias is not None:
        ids, values = a.bias
        logits = logits.scatter_add(1, ids, values.to(logits.dtype))
    if a.counts is not None:
        repetition, frequency, presence = a.penalties
        present = a.counts > 0
        seen = present | a.prompt
        repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, repeated, logits)
        logits = logits - (frequency * a.counts + presence * present.to(logits.dtype))
    return logits


def count_rows(a: Adjustments, rows: list[int], tokens: torch.Tensor) -> None:
    """`tokens` [steps, len(rows)] (on the device) counted for `rows`: their tokens still in
    flight when the launch starts, in one scatter."""
    assert a.counts is not None
    at = _to(np.tile(np.array(rows, dtype=np.int64), len(tokens)), tokens.device)
    ones = torch.ones(tokens.numel(), dtype=a.counts.dtype, device=tokens.device)
    a.counts.index_put_((at, tokens.flatten()), ones, accumulate=True)


def count(a: Adjustments | None, tokens: torch.Tensor) -> None:
    """Each row's drawn token counted, for the launch's next draw (rows with penalties)."""
    if a is not None and a.counts is not None:
        ones = torch.ones(len(tokens), 1, dtype=a.counts.dtype, device=tokens.device)
        a.counts.scatter_add_(1, tokens[:, None], ones)
