"""Attention of a ragged batch against paged KV: write the new keys, gather each context, SDPA.

The ragged batch is laid out padded ([sequences, longest query, longest context]) for the one
SDPA call per layer; a boolean mask says which cached slot each query token may see. Causal
attention is the default mask, and a decoder may hand its own mask over its query tokens
(lookahead's n-gram branches), which is why this is a masked SDPA and not a causal kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot each new token's K/V is written to
    q_index: torch.Tensor  # [B, Qmax] flat token index of each padded query row
    q_valid: torch.Tensor  # [B, Qmax] which padded query rows are real
    kv_slots: torch.Tensor  # [B, Lmax] flat cache slots of each sequence's context
    mask: torch.Tensor  # [B, 1, Qmax, Lmax] True where a query may attend


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KV, D]; caches: [slots, KV, D]. Returns [T, H, D]."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    keys = k_cache[meta.kv_slots].transpose(1, 2)  # [B, KV, L, D]
    values = v_cache[meta.kv_slots].transpose(1, 2)
    queries = q[meta.q_index].transpose(1, 2)  # [B, H, Q, D]
    out = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=meta.mask, enable_gqa=True
    )
    return out.transpose(1, 2)[meta.q_valid]
