"""Paged decode attention in Triton (flash-decoding): one query token per sequence against its
KV blocks, the context split among programs whose partial softmax sums a second kernel merges.
The verify rows of draft trees take a kernel of their own (`_tree_kernel`): a tree's rows share
their prefix, which it reads once for all of them. CPU-only installs have no Triton: the kernels
are not offered there (`decode_kernel_supported`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stride.engine.kernels import pdl

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # CPU-only installs: the decode kernel is simply not offered
    triton = None


@dataclass
class DecodeMetadata:
    """One query token per sequence, attending causally to its whole context (itself included).
    The kernel reads the block tables and context lengths; `attention.paged_attention` first
    writes the new keys and values at `slot_mapping`.

    A row of a draft tree (speculation's device loop) sees its sequence's committed prefix and,
    among the tree's N slots that follow it, only its ancestors and itself: `tree_start` is the
    index in the context of the tree's first slot, `tree_mask` says which of the N it sees
    (the tree's rows sit in consecutive slots in any order, their positions are the rotary's
    business). Without them every row sees its whole context.

    `tree_rows` = R > 0 says more: the batch is whole trees of R consecutive rows (rows
    t * R .. t * R + R - 1 are tree t's) that share their block table and `tree_start`, each row's
    context reaching past it (`context_lens` > `tree_start`). The kernel then reads each tree's
    prefix once for all its rows (`_tree_kernel`) instead of once per row.
    """

    slot_mapping: torch.Tensor  # [B] slot the new token's K/V is written to
    block_tables: torch.Tensor  # [B, max_blocks] block ids of each sequence (rest unused)
    context_lens: torch.Tensor  # [B] tokens in each context, the new one included (>= 1)
    block_size: int
    tree_start: torch.Tensor | None = None  # [B] index of the row's tree's first slot
    tree_mask: torch.Tensor | None = None  # [B, N] bool: the tree slots the row sees
    tree_rows: int = 0  # R > 0: the rows are whole trees of R rows each (see above)


def decode_kernel_supported(device: torch.device, head_dim: int) -> bool:
    return triton is not None and device.type == "cuda" and head_dim & (head_dim - 1) == 0


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: DecodeMetadata,
    launch: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """Paged decode attention: q [B, H, D] against each sequence's blocks. Returns [B, H, D].

    One program per (sequence, KV head) would leave most of the GPU idle at a small batch while
    each walks its whole context; the context is split among several programs whose partial
    softmax sums a second kernel merges (flash-decoding). `launch` overrides
    (splits, tokens per tile, warps); bench/bench_kernels.py sweeps it. Whole trees
    (`DecodeMetadata.tree_rows`) take `_tree_attention`.
    """
    if meta.tree_rows:
        return _tree_attention(q, k_cache, v_cache, meta, launch)
    b, h, d = q.shape
    kv = k_cache.shape[1]
    group = h // kv
    lengths = meta.context_lens.contiguous()  # a column of the graphs' packed input array
    # Splits: 16 up to PROGRAMS programs, fewer past that. A program walks its split one tile
    # after another, so more of them keep more loads in flight even when every SM has some; a
    # short context leaves some splits empty (a split has a tile at least), and they cost little.
    # So a sequence's bf16 result is the same in any batch up to PROGRAMS / 16 (sequence, KV
    # head) pairs. Tiles of 16 tokens, on 4 warps while there are at most 16 pairs (few programs,
    # more loads each) and 2 past that: the fastest of bench/bench_kernels.py's sweep at
    # contexts up to 1,024 and batches 1 to 64 (docs/BENCHMARKS.md, "Design choices").
    pairs = b * kv
    default = (max(1, min(16, PROGRAMS // pairs)), 16, 4 if pairs <= 16 else 2)
    splits, block_n, warps = launch or default
    out = torch.empty_like(q)
    partial = torch.empty(b, h, splits, d + 2, dtype=torch.float32, device=q.device)
    tree = meta.tree_mask is not None
    # (without a tree the mask arguments are never read: any tensor will do)
    mask = meta.tree_mask.view(torch.uint8) if tree else lengths
    start = meta.tree_start.contiguous() if tree else lengths  # (rows may share one: a view)
    _decode_kernel[(b, kv, splits)](
        q,
        k_cache,
        v_cache,
        out,
        partial,
        meta.block_tables,
        lengths,
        mask,
        start,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        out.stride(0),
        out.stride(1),
        meta.block_tables.stride(0),
        mask.stride(0) if tree else 0,
        meta.tree_mask.shape[1] if tree else 0,
        d**-0.5,
        splits,
        TREE=tree,
        GROUP=group,
        GROUP_P2=max(triton.next_power_of_2(group), 2),
        HEAD_DIM=d,
        BLOCK_SIZE=meta.block_size,
        BLOCK_N=block_n,
        SPLIT=splits > 1,
        num_warps=warps,
        **pdl.launch_options(q.device),
    )
    if splits > 1:
        _merge_kernel[(b, h)](
            partial,
            out,
            out.stride(0),
            out.stride(1),
            splits,
            HEAD_DIM=d,
            SPLITS_P2=max(triton.next_power_of_2(splits), 2),
            **pdl.launch_options(q.device),
        )
    return out


# Decode attention programs past which a launch takes fewer splits (of (sequence, KV head) pairs
# × splits): 16 splits up to 512 pairs, 64 sequences of the 8B shape.
PROGRAMS = 8192

# Query rows of a tree program: (tree row, query head of the group) pairs, flattened row-major.
_TREE_BLOCK_M = 64


def _tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: DecodeMetadata,
    launch: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """`decode_attention` for a batch of whole trees (`DecodeMetadata.tree_rows`).

    Row by row, each of a tree's R rows would read the whole shared prefix: R times the keys and
    values of a plain decode row. Here one program takes BLOCK_M of a tree's (row, query head)
    pairs for one KV head, loads each prefix tile once for all of them and scores it with tensor
    core products; a tree of 64 rows and a group of 3 is 3 such programs per KV head, whose
    repeated reads of a tile mostly hit L2. The prefix is split among programs as in
    `decode_attention` (at batch 1 there would be only a few programs otherwise), the last split
    also taking the tree's own N slots under each row's mask; `_merge_kernel` combines the splits.
    The split count depends on shapes only (trees, KV heads, rows), so a CUDA graph keeps it
    while the prefix length changes between replays. `launch` overrides (splits, tokens per
    tile, warps).
    """
    b, h, d = q.shape
    kv = k_cache.shape[1]
    group = h // kv
    rows = meta.tree_rows
    assert meta.tree_mask is not None and b % rows == 0, "tree_rows needs whole trees under masks"
    trees = b // rows
    m_tiles = triton.cdiv(rows * group, _TREE_BLOCK_M)
    if launch is None:
        splits = max(1, min(16, 2 * _num_sms(q.device) // (trees * kv * m_tiles)))
        launch = (splits, 64, 4)
    splits, block_n, warps = launch
    out = torch.empty_like(q)
    partial = torch.empty(b, h, splits, d + 2, dtype=torch.float32, device=q.device)
    mask = meta.tree_mask.view(torch.uint8)
    _tree_kernel[(trees, kv, m_tiles * splits)](
        q,
        k_cache,
        v_cache,
        out,
        partial,
        meta.block_tables,
        meta.context_lens.contiguous(),
        mask,
        meta.tree_start.contiguous(),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        out.stride(0),
        out.stride(1),
        meta.block_tables.stride(0),
        mask.stride(0),
        rows,
        mask.shape[1],
        d**-0.5,
        splits,
        GROUP=group,
        HEAD_DIM=d,
        BLOCK_SIZE=meta.block_size,
        BLOCK_M=_TREE_BLOCK_M,
        BLOCK_N=block_n,
        SPLIT=splits > 1,
        # fp32 caches: exact products, not TF32 (bf16 ones multiply exactly either way)
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=warps,
        **pdl.launch_options(q.device),
    )
    if splits > 1:
        _merge_kernel[(b, h)](
            partial,
            out,
            out.stride(0),
            out.stride(1),
            splits,
            HEAD_DIM=d,
            SPLITS_P2=max(triton.next_power_of_2(splits), 2),
            **pdl.launch_options(q.device),
        )
    return out


_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def decode_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: DecodeMetadata
) -> torch.Tensor:
    """What the kernel computes, in plain torch (the tests' yardstick, and the CPU's path)."""
    outs = []
    for i in range(q.shape[0]):
        n = int(meta.context_lens[i])
        pos = torch.arange(n, device=q.device)
        slots = meta.block_tables[i, pos // meta.block_size].long() * meta.block_size
        slots = slots + pos % meta.block_size
        keys = k_cache[slots].transpose(0, 1)[None]  # [1, KV, n, D]
        values = v_cache[slots].transpose(0, 1)[None]
        sees = None
        if meta.tree_mask is not None:
            tree = meta.tree_mask[i]
            rel = pos - int(meta.tree_start[i])
            inside = (rel >= 0) & (rel < len(tree))
            sees = ((rel < 0) | (inside & tree[rel.clamp(0, len(tree) - 1)]))[None, None]
        outs.append(
            F.scaled_dot_product_attention(
                q[i][None, :, None], keys, values, attn_mask=sees, enable_gqa=True
            )[0, :, 0]
        )
    return torch.stack(outs)


if triton is not None:

    @triton.jit
    def _decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        part_ptr,
        tables_ptr,
        lens_ptr,
        mask_ptr,
        start_ptr,
        stride_qt,
        stride_qh,
        stride_ks,
        stride_kh,
        stride_ot,
        stride_oh,
        stride_tb,
        stride_mb,
        tree_n,
        scale,
        num_splits,
        TREE: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_P2: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLIT: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """One program per (sequence, KV head, context split): all query heads of the group share
        each key load; online softmax in fp32, BLOCK_N tokens at a time. Split programs store
        their unnormalised sums, running max and denominator for `_merge_kernel`. TREE: the
        row sees only the tree slots its mask byte allows (`DecodeMetadata.tree_mask`)."""
        if PDL:  # see stride/engine/kernels/pdl.py
            gdc_wait()
            gdc_launch_dependents()
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        n_ctx = tl.load(lens_ptr + seq)
        if TREE:
            tree_lo = tl.load(start_ptr + seq)
        per_split = tl.cdiv(tl.cdiv(n_ctx, num_splits), BLOCK_N) * BLOCK_N
        lo = split * per_split
        hi = tl.minimum(lo + per_split, n_ctx)
        g = tl.arange(0, GROUP_P2)
        d = tl.arange(0, HEAD_DIM)
        heads = kv_head * GROUP + g
        g_ok = g < GROUP
        q = tl.load(
            q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
            mask=g_ok[:, None],
            other=0.0,
        ).to(tl.float32)
        q = q * scale
        m = tl.full([GROUP_P2], float("-inf"), tl.float32)
        denom = tl.zeros([GROUP_P2], tl.float32)
        acc = tl.zeros([GROUP_P2, HEAD_DIM], tl.float32)
        offs = tl.arange(0, BLOCK_N)
        for i in range(0, tl.cdiv(hi - lo, BLOCK_N)):
            t = lo + i * BLOCK_N + offs
            t_ok = t < hi
            block = tl.load(tables_ptr + seq * stride_tb + t // BLOCK_SIZE, mask=t_ok, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + t % BLOCK_SIZE
            kv_off = slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
            k = tl.load(k_ptr + kv_off, mask=t_ok[:, None], other=0.0).to(tl.float32)
            v = tl.load(v_ptr + kv_off, mask=t_ok[:, None], other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G, N]
            if TREE:
                rel = t - tree_lo
                seen = tl.load(mask_ptr + seq * stride_mb + rel,
                               mask=t_ok & (rel >= 0) & (rel < tree_n), other=0)  # fmt: skip
                s = tl.where((t_ok & ((rel < 0) | (seen != 0)))[None, :], s, float("-inf"))
                # A tile the row sees none of (all of it another branch's) leaves the max at
                # -inf: subtract 0 instead, so that it adds nothing rather than NaN.
                m_new = tl.maximum(m, tl.max(s, axis=1))
                m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m - m_sub)
                p = tl.exp(s - m_sub[:, None])
            else:
                s = tl.where(t_ok[None, :], s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, axis=1))
                alpha = tl.exp(m - m_new)
                p = tl.exp(s - m_new[:, None])
            denom = denom * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        if SPLIT:
            # partial[seq, head, split] = (acc[0:D], max, denominator); an empty split leaves
            # max -inf and denominator 0, which the merge weighs as nothing.
            row = part_ptr + ((seq * GROUP * tl.num_programs(1) + heads) * num_splits + split) * (
                HEAD_DIM + 2
            )
            tl.store(row[:, None] + d[None, :], acc, mask=g_ok[:, None])
            tl.store(row + HEAD_DIM, m, mask=g_ok)
            tl.store(row + HEAD_DIM + 1, denom, mask=g_ok)
        else:
            out = tl.where(denom[:, None] > 0, acc / denom[:, None], 0.0)  # empty context: 0
            tl.store(
                out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=g_ok[:, None],
            )

    @triton.jit
    def _tree_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        part_ptr,
        tables_ptr,
        lens_ptr,
        mask_ptr,
        start_ptr,
        stride_qt,
        stride_qh,
        stride_ks,
        stride_kh,
        stride_ot,
        stride_oh,
        stride_tb,
        stride_mb,
        tree_rows,
        tree_n,
        scale,
        num_splits,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLIT: tl.constexpr,
        PRECISION: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """One program per (tree, KV head, BLOCK_M of the tree's (row, query head) pairs, prefix
        split): online softmax in fp32 over the split's prefix tiles, which every row sees
        whole, and in the last split also over the tree's N slots, each row seeing those its
        mask allows within its context. Scores and sums are tensor core products (`tl.dot`).
        Split programs store their partial sums for `_merge_kernel`, as `_decode_kernel`'s do."""
        if PDL:  # see stride/engine/kernels/pdl.py
            gdc_wait()
            gdc_launch_dependents()
        tree = tl.program_id(0)
        kv_head = tl.program_id(1)
        m_tile = tl.program_id(2) // num_splits
        split = tl.program_id(2) % num_splits
        first = tree * tree_rows  # the tree's first row: its block table and tree_start
        prefix = tl.load(start_ptr + first)
        pair = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row = first + pair // GROUP
        heads = kv_head * GROUP + pair % GROUP
        m_ok = pair < tree_rows * GROUP
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(
            q_ptr + row[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
            mask=m_ok[:, None],
            other=0.0,
        )
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        offs = tl.arange(0, BLOCK_N)
        table = tables_ptr + first * stride_tb
        per_split = tl.cdiv(tl.cdiv(prefix, num_splits), BLOCK_N) * BLOCK_N
        lo = split * per_split
        hi = tl.minimum(lo + per_split, prefix)
        for i in range(0, tl.cdiv(hi - lo, BLOCK_N)):
            t = lo + i * BLOCK_N + offs
            t_ok = t < hi
            block = tl.load(table + t // BLOCK_SIZE, mask=t_ok, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + t % BLOCK_SIZE
            kv_off = slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
            k = tl.load(k_ptr + kv_off, mask=t_ok[:, None], other=0.0)
            v = tl.load(v_ptr + kv_off, mask=t_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [M, N]
            # (every tile here holds a token all rows see: the max stays finite)
            s = tl.where(t_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            denom = denom * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        # The tree's own slots, in the last split only (where the prefix leaves the least work):
        # row r sees slot j if its mask says so and its context reaches it. No slot past the
        # furthest row's context is read (a mask may be wider than the tree: the decode graphs').
        reach = tl.load(lens_ptr + row, mask=m_ok, other=0) - prefix
        far = tl.maximum(tl.minimum(tl.max(reach, axis=0), tree_n), 0)
        tree_tiles = tl.where(split == num_splits - 1, tl.cdiv(far, BLOCK_N), 0)
        for i in range(0, tree_tiles):
            j = i * BLOCK_N + offs
            j_ok = j < far
            t = prefix + j
            block = tl.load(table + t // BLOCK_SIZE, mask=j_ok, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + t % BLOCK_SIZE
            kv_off = slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
            k = tl.load(k_ptr + kv_off, mask=j_ok[:, None], other=0.0)
            v = tl.load(v_ptr + kv_off, mask=j_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            sees = j_ok[None, :] & (j[None, :] < reach[:, None])
            seen = tl.load(mask_ptr + row[:, None] * stride_mb + j[None, :], mask=sees, other=0)
            s = tl.where(seen != 0, s, float("-inf"))
            # A row that sees none of a tile (nor any prefix, in an empty split) keeps its max at
            # -inf: subtract 0 instead, so that the tile adds nothing rather than NaN.
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_sub)
            p = tl.exp(s - m_sub[:, None])
            denom = denom * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        if SPLIT:
            # partial[row, head, split], as `_decode_kernel` lays it out
            part = part_ptr + (
                (row * GROUP * tl.num_programs(1) + heads) * num_splits + split
            ) * (HEAD_DIM + 2)
            tl.store(part[:, None] + d[None, :], acc, mask=m_ok[:, None])
            tl.store(part + HEAD_DIM, m, mask=m_ok)
            tl.store(part + HEAD_DIM + 1, denom, mask=m_ok)
        else:
            out = tl.where(denom[:, None] > 0, acc / denom[:, None], 0.0)
            tl.store(
                out_ptr + row[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=m_ok[:, None],
            )

    @triton.jit
    def _merge_kernel(
        part_ptr,
        out_ptr,
        stride_ot,
        stride_oh,
        num_splits,
        HEAD_DIM: tl.constexpr,
        SPLITS_P2: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Combine one (sequence, head)'s split partial softmax sums into its output row."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        seq = tl.program_id(0)
        head = tl.program_id(1)
        sp = tl.arange(0, SPLITS_P2)
        d = tl.arange(0, HEAD_DIM)
        sp_ok = sp < num_splits
        rows = part_ptr + ((seq * tl.num_programs(1) + head) * num_splits + sp) * (HEAD_DIM + 2)
        m = tl.load(rows + HEAD_DIM, mask=sp_ok, other=float("-inf"))
        denom = tl.load(rows + HEAD_DIM + 1, mask=sp_ok, other=0.0)
        acc = tl.load(rows[:, None] + d[None, :], mask=sp_ok[:, None], other=0.0)
        m_max = tl.max(m, axis=0)
        w = tl.where(sp_ok & (denom > 0), tl.exp(m - m_max), 0.0)
        total = tl.sum(denom * w, axis=0)
        out = tl.where(total > 0, tl.sum(acc * w[:, None], axis=0) / total, 0.0)
        tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))
