"""Turning logits rows into tokens: penalties, bias, temperature, top-k/top-p/min-p, seeded draws.

Every function works on a batch of rows at once. A row belongs to a sequence and sits at some
offset past its last committed token (a draft position in speculative decoding), so penalties and
min_tokens see the history up to that row. Seeded rows draw from their sequence's own generator,
which makes a seeded request reproducible whatever else shares the batch.

On a GPU the hot path stays on the device: per-row settings travel as one small tensor, greedy
rows are one batched argmax, and the chosen tokens come back in the step's single host sync
(`.tolist()`). Python loops over rows remain only for rows that need per-row work (bias,
penalties, min_tokens, a seeded generator).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stride.decoders import grammar
from stride.engine.sequence import SamplingParams, Sequence


@dataclass
class Row:
    """One logits row: its sequence, and tokens assumed to precede it beyond the sequence's own."""

    seq: Sequence
    pending: list[int] = field(default_factory=list)

    @property
    def params(self) -> SamplingParams:
        return self.seq.params


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None  # 1: the most likely token (prompt logprobs know it)


def adjust(logits: torch.Tensor, rows: list[Row], eos_ids: set[int]) -> torch.Tensor:
    """Apply logit_bias, penalties, min_tokens and grammars to raw logits; returns a new tensor.

    A constrained row (its sequence has a grammar) gets the grammar's mask; min_tokens does not
    hold it open: where the grammar ends, it ends.
    """
    logits = logits.clone()
    constrained: list[int] = []
    for i, row in enumerate(rows):
        p = row.params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), device=logits.device)
        if p.has_penalties:
            _penalize(logits[i], row)
        if row.seq.grammar is not None:
            constrained.append(i)
        elif p.min_tokens and row.seq.num_output_tokens + len(row.pending) < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_ids)
            if banned:
                logits[i, list(banned)] = float("-inf")
    if constrained:
        jobs = [(rows[i].seq.grammar, rows[i].pending) for i in constrained]
        grammar.mask_logits(logits, constrained, jobs)
    return logits


def _penalize(logits: torch.Tensor, row: Row) -> None:
    p, seq = row.params, row.seq
    vocab = logits.shape[-1]
    output = torch.tensor(seq.output_ids + row.pending, dtype=torch.long, device=logits.device)
    output = output[output < vocab]
    counts = torch.bincount(output, minlength=vocab).to(logits.dtype)
    if p.repetition_penalty != 1.0:
        seen = counts > 0
        prompt = torch.tensor(seq.prompt_ids, dtype=torch.long, device=logits.device)
        seen[prompt[prompt < vocab]] = True
        r = p.repetition_penalty
        logits[seen] = torch.where(logits[seen] > 0, logits[seen] / r, logits[seen] * r)
    logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def probabilities(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p, as one distribution per row (greedy rows: one-hot)."""
    params = [r.params for r in rows]
    dev = logits.device
    greedy = [p.greedy for p in params]
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    temps = [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)]
    # One host-to-device copy for every per-row setting.
    settings = torch.tensor([temps, top_p, min_p, greedy], dtype=torch.float32).to(dev)
    temps_t, top_p_t, min_p_t, greedy_t = settings[:, :, None].unbind(0)
    probs = torch.softmax(logits / temps_t, dim=-1)

    if any(k > 0 for k in top_k) or any(x < 1.0 for x in top_p):
        probs = _top_k_top_p(probs, top_k, top_p_t)
    if any(x > 0 for x in min_p):
        floor = min_p_t * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < floor, 0.0, probs)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    if any(greedy):
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy_t.bool(), one_hot, probs)
    return probs


def _top_k_top_p(probs: torch.Tensor, top_k: list[int], top_p: torch.Tensor) -> torch.Tensor:
    """top_p: [B, 1] on the device."""
    vocab = probs.shape[-1]
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=probs.device)[None, :]
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k]).to(probs.device)[:, None]
    keep = rank < k
    # top-p: keep the smallest prefix whose mass reaches p (the first token always stays).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep &= mass_before < top_p
    keep[:, 0] = True
    sorted_probs = torch.where(keep, sorted_probs, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


def draw(probs: torch.Tensor, rows: list[Row]) -> list[int]:
    """One token per row; rows whose sequence has a seed use that sequence's generator.

    Greedy rows hold a one-hot distribution, so the batched draw returns their argmax too.
    """
    if all(r.params.greedy or r.seq.generator is not None for r in rows):
        out = probs.argmax(-1)
    else:
        out = torch.multinomial(probs, 1).squeeze(1)
    for i, row in enumerate(rows):
        if row.seq.generator is not None and not row.params.greedy:
            out[i] = torch.multinomial(probs[i], 1, generator=row.seq.generator)[0]
    return out.tolist()


def plain_greedy(row: Row) -> bool:
    """Greedy with nothing for `adjust` to do: the argmax of the raw logits."""
    p = row.params
    return (
        p.greedy
        and not p.logit_bias
        and not p.has_penalties
        and row.seq.grammar is None
        and row.seq.num_output_tokens + len(row.pending) >= p.min_tokens
    )


def greedy_on_device(seq: Sequence) -> bool:
    """May this sequence's next tokens be picked on the device (`device_argmax`), several
    passes in a row with no host in between? Greedy, with nothing that needs the host between
    two tokens: no logit bias, penalties, pending min_tokens, logprobs or grammar."""
    p = seq.params
    return (
        p.plain_greedy
        and seq.grammar is None
        and (not p.min_tokens or len(seq.token_ids) - len(seq.prompt_ids) >= p.min_tokens)
    )


def device_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The token of each `greedy_on_device` row, left on the device."""
    return logits.argmax(-1)


def sample(logits: torch.Tensor, rows: list[Row], eos_ids: set[int]) -> list[int]:
    if all(map(plain_greedy, rows)):  # the common serving case: one argmax, one sync
        return logits.argmax(-1).tolist()
    logits = adjust(logits, rows, eos_ids)
    if all(r.params.greedy for r in rows):  # skip the distribution
        return logits.argmax(-1).tolist()
    return draw(probabilities(logits, rows), rows)


def logprobs(logits: torch.Tensor, tokens: list[int], rows: list[Row]) -> list[TokenLogprob | None]:
    """Log-probabilities of the chosen tokens under the model (raw logits), plus alternatives."""
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(rows)
    if not wanted:
        return out
    lp = torch.log_softmax(logits[wanted].float(), dim=-1)
    k_max = max(rows[i].params.logprobs or 0 for i in wanted)
    top_v, top_i = lp.topk(k_max, dim=-1) if k_max else (lp[:, :0], lp[:, :0].long())
    chosen = lp.gather(1, torch.tensor([[tokens[i]] for i in wanted], device=lp.device))
    top_v, top_i, chosen = top_v.tolist(), top_i.tolist(), chosen[:, 0].tolist()
    for j, i in enumerate(wanted):
        k = rows[i].params.logprobs or 0
        out[i] = TokenLogprob(
            tokens[i], chosen[j], list(zip(top_i[j][:k], top_v[j][:k], strict=True))
        )
    return out


def scored(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """Log-probabilities of given `tokens` under raw `logits` rows (one each), with the k most
    likely alternatives: prompt logprobs. Rows go a slice at a time (a long prompt's logits
    rows are large)."""
    out: list[TokenLogprob] = []
    for start in range(0, len(tokens), 256):
        lp = torch.log_softmax(logits[start : start + 256].float(), dim=-1)
        wanted = tokens[start : start + 256]
        chosen = lp.gather(1, torch.tensor(wanted, device=lp.device)[:, None])
        ranks = (lp > chosen).sum(-1).add(1).tolist()
        top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
        columns = (wanted, chosen[:, 0].tolist(), ranks, top_i.tolist(), top_v.tolist())
        for t, c, rank, ti, tv in zip(*columns, strict=True):
            out.append(TokenLogprob(t, c, list(zip(ti, tv, strict=True)), rank))
    return out
