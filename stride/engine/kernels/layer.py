"""The fused kernels of one Llama-family layer in Triton (`fused.FusedForward` runs them).

- `gemv`: the product of a few rows x [M, K] @ W^T, with RMSNorm before it, SiLU*up or a
  residual add after it folded in; `qkv_rope_cache` adds rotary and the KV-cache write after the
  QKV product. Each row is its own programs' work, so a row's result does not depend on the
  rows beside it; the programs of different rows read the same weight tiles, from L2 after the
  first. Rows an `Alt` picks read a second set of weights instead (a MASK-slot adapter's).
- `rms_norm` (with the residual add), `rope_and_cache`, `silu_and_mul`: the elementwise work
  around the cuBLAS GEMMs of more rows.

Each rounds where the module forward rounds (bf16 after every op), apart from the fused GEMV's
norm (see `gemv`). CPU-only installs have no Triton (`triton` is None then).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stride.engine.kernels import pdl
from stride.engine.kernels.peer_sum import Push

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    triton = None


@dataclass
class Alt:
    """Weights that some rows of a few-row product take instead of the layer's: `weight`, laid
    out as the layer's (the MASK-slot adapter merged in: `fused.FusedForward.adapt`), and
    `rows` [M] int32, 1 where a row takes it."""

    weight: torch.Tensor
    rows: torch.Tensor


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    norm: torch.nn.Module | None = None,
    silu_mul: bool = False,
    add_to: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    tile: dict[str, int] | None = None,
    push: Push | None = None,
    alt: Alt | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T for a few rows, with what surrounds it fused in.

    `norm`: RMSNorm x first. `silu_mul`: weight is gate and up stacked; return SiLU(gate) * up.
    `add_to`: add the product into this tensor in place (the residual stream) and return it.
    `out`: write the product here (contiguous [M, N]: a tensor-parallel rank's staging buffer);
    `push`: and deliver it to the other ranks' inboxes (`peer_sum`).
    Where K is wider than one tile (an 8B model), the norm is folded in as gain on the input
    and 1/rms on the output, so in bf16 the result differs from the module forward's (which
    rounds the normalised input) by rounding.
    `tile` overrides the tile shape (bench/bench_kernels.py sweeps it).
    `alt`: the rows it picks take its weight instead (laid out as `weight` is).
    """
    m, k = x.shape
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    if add_to is not None:
        out = add_to
    elif out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tile = tile or _gemv_tile(n, k, silu_mul, norm is not None)
    _launch_gemv(x, weight, bias, norm, out, n, triton.cdiv(n, tile["BN"]), tile, silu_mul,
            add=add_to is not None, push=push, alt=alt)  # fmt: skip
    return out


def qkv_rope_cache(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm: torch.nn.Module,
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    attn: torch.nn.Module,
    alt: Alt | None = None,
) -> torch.Tensor:
    """A few rows' RMSNorm, QKV product, rotary and KV-cache write in one kernel; returns q
    [M, H, D]. Each program computes output columns in rotary pairs (d, d + D/2) of a head, so it
    holds both halves that rotating needs; the rounding is `rope_and_cache`'s. `alt`: as
    `gemv`'s."""
    n, k = weight.shape
    q = torch.empty(len(x), attn.num_heads, attn.head_dim, dtype=x.dtype, device=x.device)
    tile = _gemv_tile(n, k, False, True)
    tile["BN"] = max(1, tile["BN"] // 2)  # pairs of columns
    cos, sin, positions = rope
    _launch_gemv(x, weight, bias, norm, q, n, triton.cdiv(n // 2, tile["BN"]), tile,
            rope=(cos, sin, positions, slots, k_cache, v_cache), attn=attn, alt=alt)  # fmt: skip
    return q


def _launch_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm: torch.nn.Module | None,
    out: torch.Tensor,
    n: int,
    programs: int,
    tile: dict[str, int],
    silu_mul: bool = False,
    add: bool = False,
    rope: tuple[torch.Tensor, ...] | None = None,
    attn: torch.nn.Module | None = None,
    push: Push | None = None,
    alt: Alt | None = None,
) -> None:
    """Launch `_gemv_row_kernel` (`programs` per row of x, which must be contiguous, as `out`
    is); operands a variant does not use get `weight` as a pointer."""
    m, k = x.shape
    assert x.is_contiguous() and out.is_contiguous()
    assert push is None or not (silu_mul or add or rope), "a pushed product is a plain one"
    if alt is not None:
        assert alt.weight.shape == weight.shape and alt.weight.dtype == weight.dtype
        apart = alt.weight.data_ptr() - weight.data_ptr()  # (the allocator aligns both)
        assert apart % weight.element_size() == 0
    _gemv_row_kernel[(m, programs)](
        x,
        weight,
        bias if bias is not None else weight,
        norm.weight if norm is not None else weight,
        out,
        n,
        k,
        norm.eps if norm is not None else 0.0,
        *(rope or [weight] * 6),  # cos, sin, positions, slots, k cache, v cache
        rope[2].stride(0) if rope else 0,  # positions: a column of the CUDA graphs' inputs
        push.inbox_ptrs if push else weight,
        push.at if push else 0,
        alt.rows if alt is not None else weight,
        apart // weight.element_size() if alt is not None else 0,
        PUSH_RANK=push.rank if push else 0,
        PUSH_WORLD=push.world if push else 0,
        EMPTY=push.empty if push else 0,
        ALT=alt is not None,
        NORM=norm is not None,
        BIAS=bias is not None,
        SILU_MUL=silu_mul,
        ADD=add,
        ONE_TILE=k <= tile["BK"],
        ROPE=rope is not None,
        HEADS=attn.num_heads if attn is not None else 0,
        KV_HEADS=attn.num_kv_heads if attn is not None else 0,
        HEAD_DIM=attn.head_dim if attn is not None else 0,
        **tile,
        **pdl.launch_options(x.device),
    )


def _gemv_tile(n: int, k: int, silu_mul: bool, norm: bool) -> dict[str, int]:
    """Tile shape and launch of the fused GEMV: the fastest of bench/bench_kernels.py's sweep
    for each product of SmolLM2-135M and Llama-8B, whole and as a rank's share under tensor
    parallelism of 2 and 4, as one rule (docs/BENCHMARKS.md, "Design choices").

    A normed x of up to 1024 columns is read in one tile (then the norm is exact, see
    `_gemv_row_kernel`). Otherwise the number of output columns sets it: every SM must stream,
    so narrower products take narrower column blocks; the fp32 accumulators (BN x BK, twice
    with SiLU) must stay in registers.
    """
    if norm and k <= 1024:
        bn, bk, warps, stages = 2, 1024, 4, 3
    elif silu_mul:
        bn, bk, warps, stages = 4, 512, 4, 3
    elif n <= 1024:
        bn, bk, warps, stages = 2, 1024, 4, 3
    elif n < 3072:
        bn, bk, warps, stages = 4, 1024, 8, 2
    else:
        bn, bk, warps, stages = 8, 512, 8, 3
    return dict(BN=bn, BK=bk, num_warps=warps, num_stages=stages)


def rms_norm(x: torch.Tensor, norm: torch.nn.Module, residual: torch.Tensor | None) -> torch.Tensor:
    """RMSNorm of x, or of residual += x (in place) when a residual is given."""
    rows, cols = x.shape
    out = torch.empty_like(x)
    _rms_norm_kernel[(rows,)](
        x,
        residual if residual is not None else x,
        norm.weight,
        out,
        cols,
        norm.eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(cols),
        num_warps=4 if cols <= 2048 else 8,
        **pdl.launch_options(x.device),
    )
    return out


def rope_and_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    attn: torch.nn.Module,
) -> torch.Tensor:
    """Rotate q and k of a fused QKV row; write k and v to their cache slots; return q [T, H, D].

    Row t's angles are row `positions[t]` of cos and sin.
    """
    t = qkv.shape[0]
    h, kv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q = torch.empty(t, h, d, dtype=qkv.dtype, device=qkv.device)
    _rope_cache_kernel[(t,)](
        qkv,
        cos,
        sin,
        positions,
        q,
        k_cache,
        v_cache,
        slots,
        qkv.stride(0),
        cos.stride(0),
        positions.stride(0),  # a column of the CUDA graphs' packed inputs
        k_cache.stride(0),
        H=h,
        KV=kv,
        D=d,
        H_P2=triton.next_power_of_2(h),
        KV_P2=triton.next_power_of_2(kv),
        num_warps=4,
        **pdl.launch_options(qkv.device),
    )
    return q


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, cols = gate_up.shape
    half = cols // 2
    out = torch.empty(rows, half, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(half, block))](
        gate_up, out, half, BLOCK=block, **pdl.launch_options(gate_up.device)
    )
    return out


if triton is not None:
    from stride.engine.kernels.peer_sum import as_bits, push_rows

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        res_ptr,
        w_ptr,
        out_ptr,
        n_cols,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            x = x + tl.load(res_ptr + row * n_cols + cols, mask=ok, other=0.0)
            tl.store(res_ptr + row * n_cols + cols, x, mask=ok)
        xf = x.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
        normed = (xf * rstd).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        tl.store(out_ptr + row * n_cols + cols, (w * normed).to(x.dtype), mask=ok)

    @triton.jit
    def _rotate(x_ptr, rows, n_rows, cos, sin, d, rot, D: tl.constexpr):
        """x * cos + rotate_half(x) * sin, rounding after each op as the module forward does."""
        ok = rows[:, None] < n_rows
        x = tl.load(x_ptr + rows[:, None] * D + d[None, :], mask=ok, other=0.0)
        xr = tl.load(x_ptr + rows[:, None] * D + rot[None, :], mask=ok, other=0.0)
        xr = tl.where(d[None, :] < D // 2, -xr, xr)
        a = (x * cos[None, :]).to(x.dtype)
        b = (xr * sin[None, :]).to(x.dtype)
        return (a + b).to(x.dtype), ok

    @triton.jit
    def _rope_cache_kernel(
        qkv_ptr,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_ptr,
        stride_qkv,
        stride_cs,
        stride_pos,
        stride_slot,
        H: tl.constexpr,
        KV: tl.constexpr,
        D: tl.constexpr,
        H_P2: tl.constexpr,
        KV_P2: tl.constexpr,
        PDL: tl.constexpr,
    ):
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        t = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, D)
        rot = (d + D // 2) % D
        pos = tl.load(pos_ptr + t * stride_pos).to(tl.int64)
        cos = tl.load(cos_ptr + pos * stride_cs + d)
        sin = tl.load(sin_ptr + pos * stride_cs + d)
        row = qkv_ptr + t * stride_qkv
        heads = tl.arange(0, H_P2)
        q, ok = _rotate(row, heads, H, cos, sin, d, rot, D)
        tl.store(q_ptr + t * H * D + heads[:, None] * D + d[None, :], q, mask=ok)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        kv_heads = tl.arange(0, KV_P2)
        k, ok = _rotate(row + H * D, kv_heads, KV, cos, sin, d, rot, D)
        dst = slot * stride_slot + kv_heads[:, None] * D + d[None, :]
        tl.store(k_cache_ptr + dst, k, mask=ok)
        v = tl.load(row + (H + KV) * D + kv_heads[:, None] * D + d[None, :], mask=ok, other=0.0)
        tl.store(v_cache_ptr + dst, v, mask=ok)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, half, BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < half
        gate = tl.load(x_ptr + row * 2 * half + cols, mask=ok, other=0.0)
        up = tl.load(x_ptr + row * 2 * half + half + cols, mask=ok, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        tl.store(out_ptr + row * half + cols, (act * up).to(gate.dtype), mask=ok)

    @triton.jit
    def _gemv_row_kernel(
        x_ptr,
        w_ptr,
        bias_ptr,
        norm_ptr,
        out_ptr,
        N,
        K,
        eps,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        slot_ptr,
        k_cache_ptr,
        v_cache_ptr,
        stride_pos,
        push_ptrs,
        push_at,
        alt_rows_ptr,
        alt_apart,
        PUSH_RANK: tl.constexpr,
        PUSH_WORLD: tl.constexpr,
        EMPTY: tl.constexpr,
        ALT: tl.constexpr,
        NORM: tl.constexpr,
        BIAS: tl.constexpr,
        SILU_MUL: tl.constexpr,
        ADD: tl.constexpr,
        ONE_TILE: tl.constexpr,
        ROPE: tl.constexpr,
        HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """Output columns [BN * pid, BN * (pid + 1)) (pid: `program_id(1)`) of row
        `program_id(0)`. Products are summed in registers across the K loop and reduced once at
        the end. RMSNorm, when asked: if x fits one K tile,
        it is applied to x as the module applies it; else it is split in two, its gain on x as it
        is loaded and 1/rms (from the sum of squares of the same loads) on the output.
        With SILU_MUL or ROPE each column comes with a second one (its up row; the other half of
        its rotary pair), whose product is summed beside it in `up`. PUSH_WORLD > 0: the
        columns are also stored into the other ranks' inboxes (`peer_sum.Push`). ALT: a row
        whose `alt_rows` entry is 1 reads its weights `alt_apart` elements further on
        (`Alt`)."""
        dtype = out_ptr.dtype.element_ty
        row = tl.program_id(0)  # (rows vary fastest: a tile's readers run close together)
        x_ptr += row * K
        if ROPE:  # q rows [HEADS * HEAD_DIM]; each row its own position and cache slot
            out_ptr += row * (HEADS * HEAD_DIM)
            pos_ptr += row * stride_pos
            slot_ptr += row
        else:
            out_ptr += row * N
        if ROPE:
            pairs = tl.program_id(1) * BN + tl.arange(0, BN)
            col_ok = pairs < N // 2
            head = pairs // (HEAD_DIM // 2)
            cols = head * HEAD_DIM + pairs % (HEAD_DIM // 2)
            second = HEAD_DIM // 2 * K
        else:
            cols = tl.program_id(1) * BN + tl.arange(0, BN)
            col_ok = cols < N
            second = N * K  # SILU_MUL: the up rows follow the gate rows
        ks = tl.arange(0, BK)
        if ALT:
            w_ptr += tl.load(alt_rows_ptr + row).to(tl.int64) * alt_apart
        w_rows = w_ptr + cols[:, None].to(tl.int64) * K
        paired: tl.constexpr = SILU_MUL or ROPE
        w, w2 = _weight_tile(w_rows, second, ks, K, col_ok, paired)
        if PDL:  # the first weight tile is in flight; now wait for x (see stride/engine/pdl.py)
            gdc_wait()
            gdc_launch_dependents()
        acc = tl.zeros([BN, BK], dtype=tl.float32)
        up = tl.zeros([BN, BK], dtype=tl.float32)
        squares = tl.zeros([BK], dtype=tl.float32)
        acc, up, squares = _gemv_tile_step(
            x_ptr, norm_ptr, ks, K, eps, w, w2, acc, up, squares, NORM, ONE_TILE, paired, dtype
        )
        for k0 in range(BK, K, BK):
            w, w2 = _weight_tile(w_rows, second, k0 + ks, K, col_ok, paired)
            acc, up, squares = _gemv_tile_step(
                x_ptr, norm_ptr, k0 + ks, K, eps, w, w2, acc, up, squares, NORM, ONE_TILE, paired,
                dtype,
            )  # fmt: skip
        y = tl.sum(acc, axis=1)
        u = tl.sum(up, axis=1)
        if NORM and not ONE_TILE:
            scale = tl.math.rsqrt(tl.sum(squares, axis=0) / K + eps)
            y *= scale
            u *= scale
        if BIAS:
            y += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            if ROPE:
                u += tl.load(bias_ptr + cols + HEAD_DIM // 2, mask=col_ok, other=0.0).to(tl.float32)
        if ROPE:
            _rope_store(y.to(dtype), u.to(dtype), head, cols - head * HEAD_DIM, col_ok, cos_ptr,
                        sin_ptr, pos_ptr, slot_ptr, out_ptr, k_cache_ptr, v_cache_ptr, HEADS,
                        KV_HEADS, HEAD_DIM)  # fmt: skip
        else:
            if SILU_MUL:
                gate = y.to(dtype).to(tl.float32)
                y = (gate / (1.0 + tl.exp(-gate))).to(dtype) * u.to(dtype)
            y = y.to(dtype)
            if ADD:
                y = (y + tl.load(out_ptr + cols, mask=col_ok, other=0.0)).to(dtype)
            tl.store(out_ptr + cols, y, mask=col_ok)
            if PUSH_WORLD > 0:
                at = push_at + row.to(tl.int64) * N + cols
                push_rows(as_bits(y, EMPTY), push_ptrs, at, col_ok, PUSH_RANK, PUSH_WORLD)

    @triton.jit
    def _weight_tile(w_rows, second, k, K, col_ok, PAIRED: tl.constexpr):
        """Columns k of the program's weight rows (and of their paired rows, if PAIRED)."""
        w_ok = col_ok[:, None] & (k < K)[None, :]
        w = tl.load(w_rows + k[None, :], mask=w_ok, other=0.0)
        w2 = w
        if PAIRED:
            w2 = tl.load(w_rows + second + k[None, :], mask=w_ok, other=0.0)
        return w, w2

    @triton.jit
    def _gemv_tile_step(x_ptr, norm_ptr, k, K, eps, w, w2, acc, up, squares, NORM: tl.constexpr,
                        ONE_TILE: tl.constexpr, PAIRED: tl.constexpr,
                        dtype: tl.constexpr):  # fmt: skip
        """Multiply one K tile of x (normalised as `_gemv_row_kernel` says) into the sums."""
        k_ok = k < K
        x = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        if NORM:
            gain = tl.load(norm_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            if ONE_TILE:  # all of x at hand: normalise and round as the module does
                rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / K + eps)
                x = (gain * (x * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            else:
                squares += x * x
                x = x * gain
        acc += w.to(tl.float32) * x[None, :]
        if PAIRED:
            up += w2.to(tl.float32) * x[None, :]
        return acc, up, squares

    @triton.jit
    def _rope_store(a, b, head, j, ok, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr,
                    k_cache_ptr, v_cache_ptr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                    HEAD_DIM: tl.constexpr):  # fmt: skip
        """Columns j and j + D/2 of heads `head` (a, b: the projection, rounded): rotate q and k
        heads as `_rotate` does, then store q to q_ptr and k, v to the row's cache slot."""
        half: tl.constexpr = HEAD_DIM // 2
        pos = tl.load(pos_ptr).to(tl.int64) * HEAD_DIM
        c1 = tl.load(cos_ptr + pos + j)
        c2 = tl.load(cos_ptr + pos + j + half)
        s1 = tl.load(sin_ptr + pos + j)
        s2 = tl.load(sin_ptr + pos + j + half)
        rotated = head < HEADS + KV_HEADS
        first = tl.where(rotated, ((a * c1).to(a.dtype) + (-b * s1).to(a.dtype)).to(a.dtype), a)
        second = tl.where(rotated, ((b * c2).to(a.dtype) + (a * s2).to(a.dtype)).to(a.dtype), b)
        is_q = ok & (head < HEADS)
        tl.store(q_ptr + head * HEAD_DIM + j, first, mask=is_q)
        tl.store(q_ptr + head * HEAD_DIM + j + half, second, mask=is_q)
        slot = tl.load(slot_ptr).to(tl.int64) * (KV_HEADS * HEAD_DIM)
        is_k = ok & rotated & (head >= HEADS)
        k_at = k_cache_ptr + slot + (head - HEADS) * HEAD_DIM + j
        tl.store(k_at, first, mask=is_k)
        tl.store(k_at + half, second, mask=is_k)
        is_v = ok & (head >= HEADS + KV_HEADS)
        v_at = v_cache_ptr + slot + (head - HEADS - KV_HEADS) * HEAD_DIM + j
        tl.store(v_at, first, mask=is_v)
        tl.store(v_at + half, second, mask=is_v)
