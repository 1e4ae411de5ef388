"""Turning logits rows into tokens: penalties, bias, temperature, top-k/top-p/min-p, seeded draws.

Every function works on a batch of rows at once. A row belongs to a sequence and sits at some
offset past its last committed token (a draft position in speculative decoding), so penalties and
min_tokens see the history up to that row.

Draws come from a counter-based generator (`counter`): the noise for a token is a function of
the sequence's seed, the position of the token being drawn and the token id, so a seeded request
gives the same tokens whatever shares its batch, on the host or on the device, in a burst or
not. One implementation serves both paths: `device_sample` takes per-row settings as tensors on
the logits' device (`DrawSettings`, built once per launch), truncates (top-k, top-p, min-p) and
takes argmax(logits / T + Gumbel noise), a few batched tensor ops with no host sync, after
adding the rows' logit biases and penalties where the settings carry them (`adjustments`). The
host path (`sample`) applies what needs the host first (bias, penalties, min_tokens, grammar
masks: `adjust`, with the same arithmetic) and then makes the same draw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from operator import is_

import numpy as np
import torch

from stride.decoders import adjustments, counter, draw_kernels, grammar
from stride.decoders.adjustments import Adjustments
from stride.engine.sequence import NO_TOP_K, SamplingParams, Sequence


@dataclass
class Row:
    """One logits row: its sequence, and tokens assumed to precede it beyond the sequence's own.
    `ahead`: the row draws a token this many places past those (a slot guessing further on)."""

    seq: Sequence
    pending: list[int] = field(default_factory=list)
    ahead: int = 0

    @property
    def params(self) -> SamplingParams:
        return self.seq.params

    @property
    def position(self) -> int:
        """The index in its sequence of the token this row draws: what its noise is keyed by."""
        return len(self.seq.token_ids) + len(self.pending) + self.ahead


@dataclass
class TokenLogprob:
    """A token's log-probability and its most likely alternatives': their ids and values side by
    side, each a slice of a step's lists (not a pair per alternative: a step of 256 rows makes
    and pickles about a third of the objects)."""

    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]
    rank: int | None = None  # 1: the most likely token (prompt logprobs know it)

    @property
    def top(self) -> list[tuple[int, float]]:
        """The alternatives as (id, logprob) pairs, most likely first."""
        return list(zip(self.top_ids, self.top_logprobs, strict=True))


def adjust(logits: torch.Tensor, rows: list[Row], eos_ids: set[int]) -> torch.Tensor:
    """Apply logit_bias, penalties, min_tokens and grammars to raw logits; returns a new tensor.

    Biases and penalties are the device draw's (`adjustments`), each row's history its
    committed tokens and its pending ones. A constrained row (its sequence has a grammar) gets
    the grammar's mask; min_tokens does not hold it open: where the grammar ends, it ends.
    """
    seqs, pending = [r.seq for r in rows], [r.pending for r in rows]
    adjusted = adjustments.build(seqs, logits.shape[-1], logits.device, pending)
    logits = adjustments.apply(logits, adjusted)
    logits = logits.clone() if adjusted is None else logits  # (apply made a new one)
    constrained: list[int] = []
    for i, row in enumerate(rows):
        p = row.params
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


def probabilities(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p, as one distribution per row (greedy rows: one-hot):
    the distribution `sample` draws from (the same truncation)."""
    s = settings([r.seq for r in rows], [r.position for r in rows], logits.device)
    if s.all_greedy:
        return torch.zeros_like(logits).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    vals, ids = _candidates(logits / s.temperature, s)
    probs = torch.softmax(vals, dim=-1)
    if ids is not None:
        probs = torch.zeros_like(logits).scatter_(1, ids, probs)
    if s.any_greedy:
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(s.greedy[:, None], one_hot, probs)
    return probs


def draw(probs: torch.Tensor, rows: list[Row], stream: int = counter.TARGET) -> list[int]:
    """One token per row from the distributions `probs`, with the rows' counter-based noise in
    `stream` (greedy rows hold a one-hot distribution: their argmax, drawn without noise where
    every row is greedy)."""
    if all(r.seq.params.greedy for r in rows):
        return probs.argmax(-1).tolist()
    keys = counter.keys([r.seq.seed for r in rows], np.array([r.position for r in rows]), stream)
    return counter.pick(probs, torch.from_numpy(keys).to(probs.device, non_blocking=True)).tolist()


@dataclass
class DrawSettings:
    """Per-row sampling settings on the logits' device, and what the host knows of them (which
    ops a draw needs): built once per launch, so that each draw (`device_sample`) is a few
    batched tensor ops with no host sync."""

    seqs: list[Sequence]  # whose rows these are
    bases: np.ndarray  # [B] int64: the rows' key bases (`counter.bases`), on the host
    floats: torch.Tensor  # [B, 5] float32: the five columns below, which are views of it
    temperature: torch.Tensor  # [B, 1] float32; greedy rows: 1
    top_p: torch.Tensor  # [B, 1] float32
    log_min_p: torch.Tensor  # [B, 1] float32: log(min_p), -inf without one
    greedy: torch.Tensor  # [B] bool
    top_k: torch.Tensor  # [B, 1] float32 (exact below any vocabulary); without: past them all
    keys: torch.Tensor  # [steps, B, 1] int64: each row's key for its draw at each step
    all_greedy: bool
    any_greedy: bool
    k_max: int  # > 0: every sampled row keeps at most its top_k, this the largest
    k_cap: int  # the largest top-k of the sampled rows that have one (0: none has)
    any_top_p: bool
    any_top_k: bool  # some sampled row has a top-k (with k_max 0: not every one has)
    any_min_p: bool
    # The rows' logit biases and penalties, added before each draw; None where no row has one,
    # or the logits hold them already (the host's draws: `adjust`).
    adjustments: Adjustments | None = None


def settings(
    seqs: list[Sequence],
    positions: list[int],
    device: torch.device,
    steps: int = 1,
    last: DrawSettings | None = None,
    vocab: int | None = None,
) -> DrawSettings:
    """The settings of rows drawing for `seqs`, whose first draws are the tokens at
    `positions`, and `steps` draws each (step s draws position + s): two host-to-device
    copies, the rest vectorised on the host. `last`: the previous launch's; where its rows are
    the same sequences in the same order (most steps), only the keys are new: one copy.
    `vocab`: the logits' width, where the draws add the rows' logit biases and penalties (the
    raw logits of the device's forward)."""
    places = np.asarray(positions, dtype=np.int64)[None, :] + np.arange(steps)[:, None]
    if last is not None and _reusable(last, seqs):
        keys = counter.keys_at(last.bases, places)
        return replace(last, keys=torch.from_numpy(keys)[..., None].to(device, non_blocking=True))
    rows = np.array([s.params.draw_row for s in seqs], dtype=np.float64)  # (cached tuples)
    greedy = rows[:, 3] > 0
    sampled = rows[~greedy]
    bases = counter.bases([s.seed for s in seqs])
    floats_t = torch.from_numpy(rows.astype(np.float32)).to(device, non_blocking=True)
    keys_t = torch.from_numpy(counter.keys_at(bases, places)).to(device, non_blocking=True)
    top_k = sampled[:, 4].max(initial=0)
    finite = sampled[:, 4][sampled[:, 4] < NO_TOP_K]
    return DrawSettings(
        seqs=seqs,
        bases=bases,
        **columns(floats_t),
        keys=keys_t[..., None],
        all_greedy=bool(greedy.all()),
        any_greedy=bool(greedy.any()),
        k_max=int(top_k) if top_k < NO_TOP_K else 0,
        k_cap=int(finite.max(initial=0)),
        any_top_p=bool((sampled[:, 1] < 1.0).any()),
        any_top_k=bool((sampled[:, 4] < NO_TOP_K).any()),
        any_min_p=bool((sampled[:, 2] > -math.inf).any()),
        adjustments=None if vocab is None else adjustments.build(seqs, vocab, device),
    )


def columns(floats: torch.Tensor) -> dict[str, torch.Tensor]:
    """`DrawSettings`' tensors of rows whose settings are `floats` [B, 5] (`draw_row`'s)."""
    return dict(
        floats=floats,
        temperature=floats[:, 0:1],
        top_p=floats[:, 1:2],
        log_min_p=floats[:, 2:3],
        greedy=floats[:, 3] > 0,
        top_k=floats[:, 4:5],
    )


def _reusable(last: DrawSettings, seqs: list[Sequence]) -> bool:
    """Are `last`'s settings those of `seqs` but for their keys: the same sequences in the same
    order? (Its token counts, for penalties, are then this launch's too: its draws, queued
    before this launch's, count the tokens it makes.)"""
    return len(last.seqs) == len(seqs) and all(map(is_, last.seqs, seqs))


def device_sample(logits: torch.Tensor, s: DrawSettings, step: int = 0) -> torch.Tensor:
    """Each row's token [B], left on the logits' device: greedy rows their argmax, sampled rows
    argmax(truncated logits / T + Gumbel noise keyed by their step `step` draw). On the GPU,
    two fused kernels (`draw_kernels`) where the batch's truncation allows it, else `ops_sample`.
    The rows' logit biases and penalties (`DrawSettings.adjustments`) are added first, and the
    drawn tokens counted for the penalties of the next draw."""
    logits = adjustments.apply(logits, s.adjustments)
    if s.all_greedy:
        tokens = logits.argmax(-1)
    elif (route := kernel_route(logits, s)) is None:
        tokens = ops_sample(logits, s, step)
    else:
        tokens = draw_kernels.draw(logits, s.floats, s.keys[step], *route)
    adjustments.count(s.adjustments, tokens)
    return tokens


def kernel_route(logits: torch.Tensor, s: DrawSettings) -> tuple[bool, bool, bool] | None:
    """`draw_kernels.draw`'s flags for these rows, or None where it cannot draw them: off the
    GPU (Triton's interpreter aside), or a top-k past its candidates."""
    return kernel_flags(s) if draw_kernels.available(logits) else None


def kernel_flags(s: DrawSettings) -> tuple[bool, bool, bool] | None:
    """`draw_kernels.draw`'s (top, whole, top_p) for these rows wherever it runs, or None where
    a top-k is past its candidates."""
    if s.all_greedy or not (s.any_top_k or s.any_top_p or s.any_min_p):
        return False, True, False
    if s.k_cap > draw_kernels.TOP_MAX:
        return None
    return True, s.k_max == 0, s.any_top_p


def ops_sample(logits: torch.Tensor, s: DrawSettings, step: int = 0) -> torch.Tensor:
    """`device_sample` as plain tensor ops, on any device and for any settings."""
    if s.all_greedy:
        return logits.argmax(-1)
    vals, ids = _candidates(logits / s.temperature, s)
    picked = (vals + counter.gumbel(s.keys[step], ids, logits.shape[-1])).argmax(-1)
    tokens = picked if ids is None else ids.gather(1, picked[:, None])[:, 0]
    if s.any_greedy:
        tokens = torch.where(s.greedy, logits.argmax(-1), tokens)
    return tokens


def _candidates(scaled: torch.Tensor, s: DrawSettings) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The tokens a draw picks among, with their temperature-scaled logits, -inf where top-k,
    top-p or min-p drop them: the batch's `k_max` best when every sampled row has a top-k
    (no full-vocabulary sort), all of them sorted when some row needs a rank without that
    (top-p, or a top-k beside rows without one), or the whole row unsorted (ids None) when
    nothing needs a rank. top-p counts the mass of what
    top-k kept; min-p compares with the most likely token."""
    if s.k_max:
        vals, ids = scaled.topk(min(s.k_max, scaled.shape[-1]), dim=-1)
    elif s.any_top_p or s.any_top_k:
        vals, ids = scaled.sort(dim=-1, descending=True)
    else:
        if s.any_min_p:
            floor = scaled.amax(-1, keepdim=True) + s.log_min_p
            scaled = scaled.masked_fill(scaled < floor, -math.inf)
        return scaled, None
    rank = torch.arange(vals.shape[-1], device=vals.device)
    keep = rank < s.top_k
    if s.any_top_p:
        probs = torch.softmax(torch.where(keep, vals, -math.inf), dim=-1)
        # The mass of the more likely tokens: 0 for the first, which top_p > 0 always keeps.
        keep &= probs.cumsum(-1) - probs < s.top_p
    if s.any_min_p:
        keep &= vals >= vals[:, :1] + s.log_min_p
    return torch.where(keep, vals, -math.inf), ids


def plain_greedy(row: Row) -> bool:
    """Greedy with nothing for `adjust` to do: the argmax of the raw logits."""
    p = row.params
    return (
        p.greedy
        and p.plain
        and row.seq.grammar is None
        and row.seq.num_output_tokens + len(row.pending) >= p.min_tokens
    )


def on_device(seq: Sequence) -> bool:
    """May this sequence's next tokens be drawn on the device (`device_sample`), several passes
    in a row with no host in between? Nothing may need the host between two tokens: no pending
    min_tokens or grammar. Logprobs are taken on the device (`drawn_logprobs`), and a logit bias
    and penalties are added there (`adjustments`), but not both for one row: its logprobs are
    the raw logits', which the device's draw no longer holds."""
    p = seq.params
    return (
        (p.unbiased or p.logprobs is None)
        and seq.grammar is None
        and (not p.min_tokens or len(seq.token_ids) - len(seq.prompt_ids) >= p.min_tokens)
    )


def redrawn(seq: Sequence, drawn_from: torch.Tensor | None, i: int) -> int | None:
    """The token a draw under `seq`'s grammar mask gives in place of its refused token, where it
    is known without scoring that place again: the forced text's first token (the mask allows
    it alone: `Matcher.instead`), or a draw under the mask from the raw logits row the refused
    token was drawn from (`drawn_from[i]`, kept by its launch), the draw a launch makes under
    the mask. None where logprobs are asked for (they are the raw logits' of a scored row)."""
    if seq.params.logprobs is not None:
        return None
    if seq.grammar.instead is not None or drawn_from is None:
        return seq.grammar.instead
    logits = drawn_from[i : i + 1].clone()
    grammar.mask_logits(logits, [0], [(seq.grammar, [])])
    return _draw(logits, [Row(seq)]).tolist()[0]


def checked_alone(row: Row) -> bool:
    """May this row's token be drawn from its raw logits and checked alone afterwards
    (`_draw_checked`)? Nothing for `adjust` to do but a grammar's mask, and a draw that the mask
    changes only by refusing its token: greedy, or sampled without top-k, top-p or min-p (they
    rank tokens among those the mask leaves), where the same noise picks the same token among
    fewer whenever that token is left; no pending tokens."""
    p = row.params
    if row.seq.grammar is None:
        return p.unbiased and row.seq.num_output_tokens + len(row.pending) >= p.min_tokens
    untruncated = p.greedy or (p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0)
    return p.unbiased and untruncated and not row.pending


def drawn_then_checked(seq: Sequence) -> bool:
    """May this constrained sequence's tokens be drawn on the device from the raw logits,
    several passes in a row and in launches kept in flight, and each checked when it is
    committed? What `checked_alone` allows, except after a refused token that its commit could
    not draw again (`redrawn`: with logprobs; the grammar's `refused`): that token is drawn on
    the host, under the mask."""
    grammar = seq.grammar
    return grammar is not None and not grammar.refused and checked_alone(Row(seq))


def sample(logits: torch.Tensor, rows: list[Row], eos_ids: set[int]) -> list[int]:
    if all(map(plain_greedy, rows)):  # the common serving case: one argmax, one sync
        return logits.argmax(-1).tolist()
    if all(map(checked_alone, rows)):
        return _draw_checked(logits, rows, eos_ids)
    return _draw(adjust(logits, rows, eos_ids), rows).tolist()


def _draw(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """The rows' tokens from logits already adjusted, on the logits' device."""
    if all(r.params.greedy for r in rows):  # skip the distribution
        return logits.argmax(-1)
    s = settings([r.seq for r in rows], [r.position for r in rows], logits.device)
    return device_sample(logits, s)


def _draw_checked(logits: torch.Tensor, rows: list[Row], eos_ids: set[int]) -> list[int]:
    """Draws under grammars, a mask asked for only where it is needed: a token drawn from the
    raw logits is the one the masked logits give whenever the mask allows it (`checked_alone`,
    `grammar.Matcher.allows`); the other rows are masked and drawn again, with the same noise.
    What the grammars force is read while the device computes."""
    drawn = _draw(logits, rows)
    forced = [None if r.seq.grammar is None else r.seq.grammar.forced() for r in rows]
    tokens = drawn.tolist()
    masked = [
        i
        for i, (row, token, ahead) in enumerate(zip(rows, tokens, forced, strict=True))
        if row.seq.grammar is not None and not row.seq.grammar.allows(token, ahead)
    ]
    if masked:
        picked = [rows[i] for i in masked]
        again = _draw(adjust(logits[masked], picked, eos_ids), picked).tolist()
        for i, token in zip(masked, again, strict=True):
            tokens[i] = token
    return tokens


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
        out[i] = TokenLogprob(tokens[i], chosen[j], top_i[j][:k], top_v[j][:k])
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
            out.append(TokenLogprob(t, c, ti, tv, rank))
    return out
