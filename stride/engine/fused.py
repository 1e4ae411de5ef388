"""The Llama-family forward on a GPU with fused kernels: a few launches per layer, not forty.

The module-by-module forward (`model.CausalLM`) launches about forty small kernels per layer
(RMSNorm alone is eight elementwise ops, rotary another eight). For a small model at batch 1
those launches, not the weights, set the step time, even inside a CUDA graph. Here each layer is:
add+RMSNorm, one QKV GEMM, rotary+KV-cache write, attention, O GEMM, add+RMSNorm, one gate/up
GEMM, SiLU*up, down GEMM. The Q/K/V and gate/up weights are concatenated once, and the model's
own parameters become views of the concatenation, so nothing is stored twice and the module
forward still works. Each kernel rounds where the module forward rounds (bf16 after every op), so
both forwards agree to the last bit up to reduction order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stride.engine.attention import AttentionMetadata, DecodeMetadata, attend
from stride.engine.model import CausalLM

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def supported(model: CausalLM, device: torch.device) -> bool:
    attn = model.model.layers[0].self_attn
    d = attn.head_dim
    return triton is not None and device.type == "cuda" and not attn.qk_norm and d & (d - 1) == 0


def _concat_params(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """One tensor holding `params` back to back; each parameter becomes a view of it."""
    whole = torch.cat([p.data for p in params])
    for p, view in zip(params, whole.split([p.shape[0] for p in params]), strict=True):
        p.data = view
    return whole


class FusedForward:
    """Same signature and result as `CausalLM.forward`; CUDA and Triton only."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.qkv: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.gate_up: list[torch.Tensor] = []
        for layer in model.model.layers:
            a = layer.self_attn
            projections = [a.q_proj, a.k_proj, a.v_proj]
            bias = None
            if a.q_proj.bias is not None:
                bias = _concat_params([p.bias for p in projections])
            self.qkv.append((_concat_params([p.weight for p in projections]), bias))
            self.gate_up.append(
                _concat_params([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight])
            )

    def __call__(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata | DecodeMetadata,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        model = self.model
        layers = model.model.layers[:num_layers]
        residual = model.model.embed_tokens(token_ids)
        cos, sin = model.rotary(residual, positions[None])
        cos, sin = cos[0].to(residual.dtype), sin[0].to(residual.dtype)  # [T, D]
        h = rms_norm(residual, layers[0].input_layernorm, None)
        for i, layer in enumerate(layers):
            a = layer.self_attn
            weight, bias = self.qkv[i]
            qkv = F.linear(h, weight, bias)
            q = rope_and_cache(qkv, cos, sin, kv[0][a.layer], kv[1][a.layer], meta.slot_mapping, a)
            o = attend(q, kv[0][a.layer], kv[1][a.layer], meta)
            o = F.linear(o.view(o.shape[0], -1), a.o_proj.weight)
            h = rms_norm(o, layer.post_attention_layernorm, residual)
            up = silu_and_mul(F.linear(h, self.gate_up[i]))
            d = F.linear(up, layer.mlp.down_proj.weight)
            after = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.model.norm
            h = rms_norm(d, after, residual)
        return h


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
    )
    return out


def rope_and_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    attn: torch.nn.Module,
) -> torch.Tensor:
    """Rotate q and k of a fused QKV row; write k and v to their cache slots; return q [T, H, D]."""
    t = qkv.shape[0]
    h, kv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q = torch.empty(t, h, d, dtype=qkv.dtype, device=qkv.device)
    _rope_cache_kernel[(t,)](
        qkv,
        cos,
        sin,
        q,
        k_cache,
        v_cache,
        slots,
        qkv.stride(0),
        cos.stride(0),
        k_cache.stride(0),
        H=h,
        KV=kv,
        D=d,
        H_P2=triton.next_power_of_2(h),
        KV_P2=triton.next_power_of_2(kv),
        num_warps=4,
    )
    return q


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, cols = gate_up.shape
    half = cols // 2
    out = torch.empty(rows, half, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(half, block))](gate_up, out, half, BLOCK=block)
    return out


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, n_cols, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr
    ):
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
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_ptr,
        stride_qkv,
        stride_cs,
        stride_slot,
        H: tl.constexpr,
        KV: tl.constexpr,
        D: tl.constexpr,
        H_P2: tl.constexpr,
        KV_P2: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, D)
        rot = (d + D // 2) % D
        cos = tl.load(cos_ptr + t * stride_cs + d)
        sin = tl.load(sin_ptr + t * stride_cs + d)
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
    def _silu_mul_kernel(x_ptr, out_ptr, half, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < half
        gate = tl.load(x_ptr + row * 2 * half + cols, mask=ok, other=0.0)
        up = tl.load(x_ptr + row * 2 * half + half + cols, mask=ok, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        tl.store(out_ptr + row * half + cols, (act * up).to(gate.dtype), mask=ok)
