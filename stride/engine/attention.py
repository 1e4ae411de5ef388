"""Attention of a ragged batch against paged KV, in two shapes.

General steps (prefill chunks, drafts, lookahead windows) are laid out padded ([sequences, longest
query, longest context]) for one masked SDPA call per layer: a boolean mask says which cached slot
each query token may see, so a decoder may hand its own mask over its query tokens (lookahead's
n-gram branches). That is why the general path is masked SDPA and not a causal kernel.

cuDNN's SDPA backend is left out on GPUs (`use_planless_sdpa`): it builds a plan for every new
shape (about half a second on an H200), and here every prompt length is a new shape.

Decode steps (one new token per sequence, causal) on a GPU take a paged decode kernel instead
(`kernels.decode_attention`): it reads each sequence's keys straight from its blocks, with no
gather and no padded mask, and its inputs (`DecodeMetadata`: block tables, context lengths) live
in fixed buffers, so the step can be a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stride.engine.kernels.decode_attention import (
    DecodeMetadata,
    decode_attention,
    decode_attention_reference,
)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot each new token's K/V is written to
    q_index: torch.Tensor  # [B, Qmax] flat token index of each padded query row
    q_rows: torch.Tensor  # [T] each token's row in the padded [B * Qmax] query layout
    kv_slots: torch.Tensor  # [B, Lmax] flat cache slots of each sequence's context
    mask: torch.Tensor  # [B, 1, Qmax, Lmax] True where a query may attend


def use_planless_sdpa(device: torch.device) -> None:
    """Keep SDPA off cuDNN's backend on CUDA (a process-wide switch, set by every runner)."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata | DecodeMetadata,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KV, D]; caches: [slots, KV, D]. Returns [T, H, D]."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    return attend(q, k_cache, v_cache, meta)


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata | DecodeMetadata,
) -> torch.Tensor:
    """Attention of q [T, H, D] over caches that already hold this step's keys and values."""
    if isinstance(meta, DecodeMetadata):
        if not q.is_cuda:  # (decode rows off the GPU: EAGLE's device cycles, run eagerly)
            return decode_attention_reference(q, k_cache, v_cache, meta)
        return decode_attention(q, k_cache, v_cache, meta)
    keys = k_cache[meta.kv_slots].transpose(1, 2)  # [B, KV, L, D]
    values = v_cache[meta.kv_slots].transpose(1, 2)
    queries = q[meta.q_index].transpose(1, 2)  # [B, H, Q, D]
    out = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=meta.mask, enable_gqa=True
    )
    # An index gather, not a boolean mask: a mask would cost a host sync per layer (nonzero).
    return out.transpose(1, 2).flatten(0, 1)[meta.q_rows]
