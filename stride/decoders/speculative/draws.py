"""The device loop's distributions, decided without the host: each row's temperature, top-k,
top-p and min-p applied from its settings as tensors (`row_probabilities`: the same ops at every
replay of a cycle's graph), its tokens ranked only as far as the rows of a cycle need (`ranks`:
no full-vocabulary sort where no row has a top-k or top-p)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from stride.decoders import draw_kernels
from stride.decoders.sampling import columns
from stride.engine.sequence import NO_TOP_K, SamplingParams

RANK_ALL = NO_TOP_K  # `ranks` of draws that sort the whole vocabulary


def ranks(params: Iterable[SamplingParams]) -> int:
    """How many of their most likely tokens draws under `params` must rank, one rank for them
    all (`row_probabilities`): 0 where no sampled row has a top-k or top-p (temperature and
    min-p need no rank), `draw_kernels.TOP_MAX` where every sampled row has a top-k of at most
    that and none a top-p (the best TOP_MAX hold every token each may draw), else `RANK_ALL`
    (the whole vocabulary sorted, which is exact for every row)."""
    return joint_rank({_rank(p) for p in params if not p.greedy})


def joint_rank(needs: set[int]) -> int:
    """The rank that serves sampled rows of each rank in `needs` (`ranks`)."""
    if len(needs) > 1:
        return RANK_ALL
    return needs.pop() if needs else 0


def _rank(p: SamplingParams) -> int:
    if p.top_p < 1.0:
        return RANK_ALL
    if p.top_k <= 0:
        return 0
    return draw_kernels.TOP_MAX if p.top_k <= draw_kernels.TOP_MAX else RANK_ALL


def row_probabilities(logits: torch.Tensor, floats: torch.Tensor, rank: int) -> torch.Tensor:
    """`sampling.probabilities` for rows whose settings are `floats` [R, 5] (`draw_row`'s),
    decided by no host: each truncation applied where its column asks for it, the same ops at
    every call. `rank`: the rows' `ranks`; the tokens are ranked (the best `rank` of them, or
    all sorted) only where some row has a top-k or top-p. Float32 [R, V]."""
    c = columns(floats)
    scaled = logits.float() / c["temperature"]
    if rank:
        vals, ids = (scaled.topk(rank, dim=-1) if rank < scaled.shape[-1]
                     else scaled.sort(dim=-1, descending=True))  # fmt: skip
        keep = torch.arange(vals.shape[-1], device=vals.device) < c["top_k"]
        probs = torch.softmax(torch.where(keep, vals, -math.inf), dim=-1)
        keep &= (c["top_p"] >= 1.0) | (probs.cumsum(-1) - probs < c["top_p"])
        keep &= vals >= vals[:, :1] + c["log_min_p"]
    else:
        vals, ids = scaled, None
        keep = scaled >= scaled.amax(-1, keepdim=True) + c["log_min_p"]
    kept = torch.softmax(torch.where(keep, vals, -math.inf), dim=-1)
    probs = kept if ids is None else torch.zeros_like(scaled).scatter_(1, ids, kept)
    one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(c["greedy"][:, None], one_hot, probs)
