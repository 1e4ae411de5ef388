"""A span, one sequence's share of a ragged batch, and the two attention layouts a batch of
spans takes outside the decode graphs: padded, for one masked SDPA call per layer (`prepare`:
prefill chunks, anything long), and as decode rows for the paged decode kernel (`decode_rows`:
short masked spans, lookahead's branches); and the masks of spans replayed as rows of the
decode graphs (`graph_masks`, `span_mask`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stride.engine.attention import AttentionMetadata
from stride.engine.kernels.decode_attention import DecodeMetadata
from stride.engine.sequence import Sequence


@dataclass
class Span:
    seq: Sequence
    token_ids: list[int]
    num_logits: int  # logits for the last `num_logits` tokens (0 = none, mid-prefill)
    positions: list[int] | None = None  # default: num_cached, num_cached + 1, ...
    # [n, w] bool: what the span's n tokens see of the last w (>= n) slots of their context,
    # which end with their own; the slots before those are seen whole. Default: causal.
    mask: torch.Tensor | None = None
    offset: int = 0  # the tokens start this far past num_cached (pending tokens before them)
    # A fed span's one token is row `fed` of a tensor of tokens on the device (`forward`'s
    # `fed`: the last samples of a launch still in flight); its `token_ids` hold a placeholder.
    fed: int | None = None


def prepare(spans: list[Span], bs: int, dev: torch.device):
    """The padded attention layout of a ragged batch: (metadata, token ids, positions, the
    rows whose logits are wanted). `bs` is the KV cache's block size."""
    n_q = [len(c.token_ids) for c in spans]
    starts = [c.seq.num_cached + c.offset for c in spans]
    n_ctx = [s + n for s, n in zip(starts, n_q, strict=True)]
    b, q_max, l_max = len(spans), max(n_q), max(n_ctx)

    tokens, positions, rows = [], [], []
    offset = 0
    for c, start, n in zip(spans, starts, n_q, strict=True):
        tokens.extend(c.token_ids)
        positions.extend(c.positions or range(start, start + n))
        rows.extend(range(offset + n - c.num_logits, offset + n))
        offset += n

    n_blocks = -(-l_max // bs)
    table = torch.zeros(b, n_blocks, dtype=torch.long)
    for i, c in enumerate(spans):
        used = c.seq.block_table[: -(-n_ctx[i] // bs)]
        table[i, : len(used)] = torch.tensor(used, dtype=torch.long)
    kv_slots = (table[:, :, None] * bs + torch.arange(bs)).view(b, -1)[:, :l_max]

    n_q_t = torch.tensor(n_q)
    starts_t = torch.tensor(starts)
    q_pos = torch.arange(q_max)
    q_valid = q_pos[None, :] < n_q_t[:, None]
    first_token = torch.cumsum(n_q_t, 0) - n_q_t
    q_index = torch.where(q_valid, first_token[:, None] + q_pos[None, :], 0)
    place = starts_t[:, None] + q_pos[None, :]  # [B, Q]: each query's place in its context
    # Each scored token's K/V goes to the slot of its place, span after span.
    slots = kv_slots.gather(1, place.clamp(max=l_max - 1))[q_valid]

    # Causal by default: query i of a span sees cached slots and span tokens up to itself.
    k_pos = torch.arange(l_max)
    mask = k_pos[None, None, :] <= place[:, :, None]
    for i, c in enumerate(spans):
        if c.mask is not None:
            end, n, w = n_ctx[i], n_q[i], c.mask.shape[1]
            mask[i, :n, end - w : end] = c.mask
    mask[~q_valid] = False
    mask[~q_valid, 0] = True  # padded rows must see something, or SDPA returns NaN

    meta = AttentionMetadata(
        slot_mapping=slots.to(dev, non_blocking=True),
        q_index=q_index.to(dev, non_blocking=True),
        q_rows=q_valid.flatten().nonzero()[:, 0].to(dev, non_blocking=True),
        kv_slots=kv_slots.to(dev, non_blocking=True),
        mask=mask[:, None].to(dev, non_blocking=True),
    )
    return (
        meta,
        torch.tensor(tokens, dtype=torch.long).to(dev, non_blocking=True),
        torch.tensor(positions, dtype=torch.long).to(dev, non_blocking=True),
        torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=True),
    )


def decode_rows(spans: list[Span], bs: int, dev: torch.device):
    """Short masked spans as decode rows (`ModelRunner._forward_rows`): (metadata, token ids,
    positions, the rows whose logits are wanted). Each token is a row whose context ends at its
    own slot and that sees, of the slots its span's mask covers, what the mask allows
    (`DecodeMetadata.tree_mask`): the paged decode kernel reads each row's keys from its blocks,
    with no padded gather of every context and no dense mask."""
    masks_of = [_causal(len(c.token_ids)) if c.mask is None else c.mask for c in spans]
    width = max(m.shape[1] for m in masks_of)
    tokens: list[int] = []
    positions: list[int] = []
    ends: list[int] = []  # each row's context length (its own slot is the last)
    firsts: list[int] = []  # where its span's mask starts in its context
    masks = torch.zeros(sum(len(c.token_ids) for c in spans), width, dtype=torch.bool)
    logit_rows: list[int] = []
    for c, mask in zip(spans, masks_of, strict=True):
        start, n, w = c.seq.num_cached + c.offset, len(c.token_ids), mask.shape[1]
        masks[len(tokens) : len(tokens) + n, :w] = mask.cpu()
        logit_rows += range(len(tokens) + n - c.num_logits, len(tokens) + n)
        tokens += c.token_ids
        positions += c.positions or range(start, start + n)
        ends += range(start + 1, start + n + 1)
        firsts += [start + n - w] * n
    # One block-table row per span, repeated for its rows.
    widest = max(len(c.seq.block_table) for c in spans)
    per_span = torch.zeros(len(spans), widest, dtype=torch.int32)
    for i, c in enumerate(spans):
        per_span[i, : len(c.seq.block_table)] = torch.tensor(c.seq.block_table, dtype=torch.int32)
    table = per_span.repeat_interleave(torch.tensor([len(c.token_ids) for c in spans]), 0)
    last = torch.tensor(ends) - 1
    slots = table.gather(1, (last // bs)[:, None])[:, 0].long() * bs + last % bs
    meta = DecodeMetadata(
        slot_mapping=slots.to(dev, non_blocking=True),
        block_tables=table.to(dev, non_blocking=True),
        context_lens=torch.tensor(ends, dtype=torch.int32).to(dev, non_blocking=True),
        block_size=bs,
        tree_start=torch.tensor(firsts, dtype=torch.int32).to(dev, non_blocking=True),
        tree_mask=masks.to(dev, non_blocking=True),
    )
    ids = torch.tensor(tokens, dtype=torch.long).to(dev, non_blocking=True)
    at = torch.tensor(positions, dtype=torch.long).to(dev, non_blocking=True)
    return meta, ids, at, torch.tensor(logit_rows, device=dev)


def graph_masks(
    spans: list[Span], lengths: list[int], always: bool = False
) -> tuple[list[int], torch.Tensor] | None:
    """The rows' tree starts and masks for a graph replay (`DecodeGraphs.run`), or None when
    no span is masked (unless `always`). A masked span of n tokens whose mask covers w slots
    starts its rows' masks at its last w slots; any other row starts at its own slot, which
    it sees."""
    if not always and all(c.mask is None for c in spans):
        return None
    starts = [length - 1 for length in lengths]
    masks = torch.zeros(len(lengths), max(1 if c.mask is None else c.mask.shape[1] for c in spans),
                        dtype=torch.bool)  # fmt: skip
    masks[:, 0] = True
    row = 0
    for c in spans:
        n = len(c.token_ids)
        if c.mask is not None:
            w = c.mask.shape[1]
            end = lengths[row + n - 1]  # the span's context, its last token included
            starts[row : row + n] = [end - w] * n
            masks[row : row + n] = False
            masks[row : row + n, :w] = c.mask.cpu()
        row += n
    return starts, masks


def span_mask(c: Span, lengths: list[int]) -> tuple[list[int], torch.Tensor]:
    """One span's rows as one tree: all start where its mask does (its last w slots; a causal
    span's own n), each row's mask over them."""
    mask = _causal(len(lengths)) if c.mask is None else c.mask.cpu()
    return [lengths[-1] - mask.shape[1]] * len(lengths), mask


def _causal(n: int) -> torch.Tensor:
    """The mask of a span without one: each of its n tokens sees those before it and itself."""
    return torch.ones(n, n, dtype=torch.bool).tril()
