"""The Llama-family forward on a GPU with fused kernels: a few launches per layer, not forty.

The module-by-module forward (`model.CausalLM`) launches about forty small kernels per layer
(RMSNorm alone is eight elementwise ops, rotary another eight). For a small model at batch 1
those launches, not the weights, set the step time, even inside a CUDA graph. The Q/K/V and
gate/up weights are concatenated once, and the model's own parameters become views of the
concatenation, so nothing is stored twice and the module forward still works.

Two layer shapes, by the number of rows:
  - up to `few_rows` rows (decode steps of a few streams, a chain's verification, where the
    weights' bandwidth and the launches are the whole cost): a Triton GEMV folds the work around
    each product into it: RMSNorm before the QKV and gate/up products, rotary and the KV-cache
    write after QKV, SiLU*up after gate/up, the residual add after the O and down products. With
    attention (and its split merge) that is six kernels per layer. The GEMV streams weights at
    cuBLAS's rate or above (bench/bench_kernels.py; bench/bench_gpu.py measures the whole step;
    docs/BENCHMARKS.md). Each row is its own programs' work (a row's result is the same
    whatever rows share its step), reading the weights again, from L2 where the layer fits
    there: so only such models take more than one row this way (`few_rows`; an 8B layer,
    streamed from memory once per row, costs 3x cuBLAS at 8 rows; programs that each take
    several rows measured slower still).
  - more rows: cuBLAS GEMMs with add+RMSNorm, rotary+KV write and SiLU*up as Triton kernels.
    (A tensor-core variant of the fused GEMV for a few rows costs more in-loop norm work than
    the launches it saves: docs/BENCHMARKS.md, "Design choices".)
Under tensor parallelism (`parallel`) each rank runs the same kernels over its share of the heads
and columns, with an all-reduce after the O and the down products: for decode-sized rows the
product goes straight into a buffer every rank maps, and one kernel sums the ranks' products
into the residual stream (and norms it for the next cuBLAS product; `collectives`); else NCCL.
Rotary angles come from a table built once for every position, not from a dozen kernels per
step. Apart from the fused GEMV's norm (see `gemv`), each kernel rounds where the module forward
rounds (bf16 after every op).
An EAGLE-3 head's one layer runs on the same kernels (`FusedHead`, in the speculation loop's
graphs), for the same reason: about fifteen launches a row instead of forty.
A MASK-slot adapter (`adapt`: the `introspective` method) is merged into a second copy of each
layer's weights, which the slots' rows take: in the fused GEMV each such row reads the other
weights (`kernels.layer.Alt`), up to ADAPTED_FEW_ROWS rows; past that each product runs twice
and every row keeps its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from stride.engine.adapter import MASK_TOKEN, MaskAdapter
from stride.engine.attention import AttentionMetadata, attend
from stride.engine.collectives import PeerSum
from stride.engine.eagle import EagleHead
from stride.engine.kernels.decode_attention import DecodeMetadata
from stride.engine.kernels.layer import (
    Alt,
    gemv,
    qkv_rope_cache,
    rms_norm,
    rope_and_cache,
    silu_and_mul,
    triton,
)
from stride.engine.model import CausalLM
from stride.engine.parallel import RowParallelLinear

# Rows up to which a layer whose weights fit in L2 takes the fused GEMV: past it cuBLAS is
# faster (SmolLM2 on an H200: a chain of 4 or 5 drafts verifies its 5 or 6 rows faster here,
# 8 rows are faster on cuBLAS; docs/BENCHMARKS.md).
FEW_ROWS = 6
# Rows up to which a call with MASK slots among them (`adapt`) takes the fused GEMV too, each
# slot's row reading the merged weights: one stream's pass of up to 3 slots (16 rows) then runs
# a plain decode step's six kernels a layer, where the many-rows kernels run each product
# twice and pick rows after it. The GEMV's time grows with its rows: a pass of 4 slots
# (25 rows) is faster on the many-rows kernels (docs/BENCHMARKS.md).
ADAPTED_FEW_ROWS = 16


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

    def __init__(self, model: CausalLM, all_reduce: str = "auto") -> None:
        """`all_reduce`: "auto" or "nccl" (`collectives`; under tensor parallelism only)."""
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
        self.rope_table = _rope_table(model)
        self.few_rows = few_rows(model)
        # Per layer: QKV, O, gate/up and down with a MASK-slot adapter merged in (`adapt`).
        self.adapted: list[tuple[torch.Tensor, ...]] = []
        self.mask_embedding: torch.Tensor | None = None
        # Split over ranks (`parallel`): the O and down products are partial sums, all-reduced
        # before they join the residual stream.
        self.parallel = isinstance(model.model.layers[0].mlp.down_proj, RowParallelLinear)
        self.peer: PeerSum | None = None
        if self.parallel:
            weight = model.lm_head.weight
            self.peer = PeerSum.setup(weight.device, weight.dtype, weight.shape[1], all_reduce)

    def adapt(self, adapter: MaskAdapter) -> None:
        """Let calls with `adapted=True` run MASK slots (`adapter.MASK_TOKEN` rows) as the
        adapter's hooks run them on the module forward: their input the MASK embedding, their
        products through a second copy of each layer's weights with the low-rank products
        merged in, picked per row (a copy of the layers' weights: for small models)."""
        if self.parallel:
            raise ValueError("a MASK-slot adapter runs on an unsplit model")
        names = (
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            ("self_attn.o_proj",),
            ("mlp.gate_proj", "mlp.up_proj"),
            ("mlp.down_proj",),
        )
        model = self.model
        self.adapted = adapter.merged(model, names)
        self.mask_embedding = adapter.mask_embedding.detach().to(model.lm_head.weight.dtype)

    def __call__(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata | DecodeMetadata,
        num_layers: int | None = None,
        aux: tuple[int, ...] = (),
        adapted: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`CausalLM.forward`; `adapted`: MASK slots among the rows run the adapter (`adapt`),
        on the fused GEMV up to ADAPTED_FEW_ROWS rows."""
        model = self.model
        layers = model.model.layers[:num_layers]
        slots = None  # MASK rows, [rows, 1]
        if adapted:
            slots = (token_ids == MASK_TOKEN)[:, None]
            residual = model.model.embed_tokens(token_ids.clamp(min=0))
            residual = torch.where(slots, self.mask_embedding, residual)
        else:
            residual = model.model.embed_tokens(token_ids)
        if self.rope_table is not None:
            cos, sin = self.rope_table
        else:  # rope types whose angles depend on the sequence, not on the position alone
            cos, sin = model.rotary(residual, positions[None])
            cos, sin = cos[0].to(residual.dtype), sin[0].to(residual.dtype)
            positions = torch.arange(len(positions), device=positions.device)
        rope = (cos, sin, positions)
        captured: dict[int, torch.Tensor] = {}  # the residual stream after the `aux` layers
        few = self.few_rows if slots is None or self.few_rows == 1 else ADAPTED_FEW_ROWS
        if residual.shape[0] <= few:
            picks = None if slots is None else slots[:, 0].to(torch.int32)
            for i, layer in enumerate(layers):
                self._few_rows_layer(i, layer, residual, rope, kv, meta, picks)
                if i in aux:
                    captured[i] = residual.clone()
            out = rms_norm(residual, model.model.norm, None)
            captured[len(model.model.layers)] = out
            return (out, torch.cat([captured[i] for i in aux], -1)) if aux else out
        h = rms_norm(residual, layers[0].input_layernorm, None)
        for i, layer in enumerate(layers):
            a = layer.self_attn
            k_cache, v_cache = kv[0][a.layer], kv[1][a.layer]
            alt = self.adapted[i] if slots is not None else _UNADAPTED
            qkv = _linear(h, *self.qkv[i], alt[0], slots)
            q = rope_and_cache(qkv, *rope, k_cache, v_cache, meta.slot_mapping, a)
            o = attend(q, k_cache, v_cache, meta)
            o = o.view(o.shape[0], -1)
            h = self._add_norm(o, a.o_proj.weight, residual, layer.post_attention_layernorm, 0,
                               alt[1], slots)  # fmt: skip
            up = silu_and_mul(_linear(h, self.gate_up[i], None, alt[2], slots))
            after = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.model.norm
            h = self._add_norm(up, layer.mlp.down_proj.weight, residual, after, 1, alt[3], slots)
            if i in aux:
                captured[i] = residual.clone()
        captured[len(model.model.layers)] = h
        return (h, torch.cat([captured[i] for i in aux], -1)) if aux else h

    def _few_rows_layer(
        self,
        i: int,
        layer: torch.nn.Module,
        residual: torch.Tensor,
        rope,
        kv,
        meta,
        picks: torch.Tensor | None,
    ) -> None:
        """A few rows' layer in six kernels; `residual` is updated in place. `picks` [rows]
        int32: 1 for a MASK slot's row, which takes the merged weights (`adapt`)."""
        a = layer.self_attn
        k_cache, v_cache = kv[0][a.layer], kv[1][a.layer]
        weight, bias = self.qkv[i]
        qkv, o_alt, gate_up, down = (
            (None,) * 4 if picks is None else (Alt(w, picks) for w in self.adapted[i])
        )
        q = qkv_rope_cache(residual, weight, bias, layer.input_layernorm, rope, k_cache, v_cache,
                           meta.slot_mapping, a, qkv)  # fmt: skip
        o = attend(q, k_cache, v_cache, meta)
        self._add_product(o.view(o.shape[0], -1), a.o_proj.weight, residual, 0, o_alt)
        act = gemv(residual, self.gate_up[i], norm=layer.post_attention_layernorm, silu_mul=True,
                   alt=gate_up)  # fmt: skip
        self._add_product(act, layer.mlp.down_proj.weight, residual, 1, down)

    def _add_product(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        residual: torch.Tensor,
        half: int,
        alt: Alt | None = None,
    ) -> None:
        """residual += x @ weight^T (in the GEMV's epilogue; summed over ranks if split: in
        the peer sum's `half`, 0 after attention and 1 after the MLP, so consecutive sums
        alternate); rows `alt` picks take its weight (never split: `adapt`)."""
        if not self.parallel:
            gemv(x, weight, add_to=residual, alt=alt)
        elif self.peer is not None and self.peer.fits(len(x)):
            gemv(x, weight, out=self.peer.stage(len(x), half), push=self.peer.push(half))
            self.peer.add(residual, half, pushed=True)
        else:
            part = gemv(x, weight)
            dist.all_reduce(part)
            residual.add_(part)

    def _add_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        residual: torch.Tensor,
        norm: torch.nn.Module,
        half: int,
        alt: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """norm(residual += x @ weight^T), the product summed over ranks if split (see
        `_add_product`); MASK rows (`slots`) take `alt` for `weight` (`adapt`)."""
        if self.peer is not None and self.peer.fits(len(x)):
            torch.mm(x, weight.t(), out=self.peer.stage(len(x), half))
            return self.peer.add(residual, half, norm)
        product = _linear(x, weight, None, alt, slots)
        if self.parallel:
            dist.all_reduce(product)
        return rms_norm(product, norm, residual)


_UNADAPTED = (None, None, None, None)


def _linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    alt: torch.Tensor | None,
    slots: torch.Tensor | None,
) -> torch.Tensor:
    """x @ weight^T + bias; the rows `slots` marks ([rows, 1] bool) x @ alt^T + bias instead."""
    out = F.linear(x, weight, bias)
    return out if slots is None else torch.where(slots, F.linear(x, alt, bias), out)


def few_rows(model: CausalLM) -> int:
    """Rows up to which `model`'s layers take the fused GEMV: `FEW_ROWS` where a layer's
    weights take at most half the L2 cache (the rows' programs share them there), else one."""
    weight = model.lm_head.weight
    if weight.device.type != "cuda":
        return 1
    layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    l2 = torch.cuda.get_device_properties(weight.device).L2_cache_size
    return FEW_ROWS if 2 * layer <= l2 else 1


def _rope_table(model: CausalLM) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cos and sin [positions, head_dim] for every position the model takes, in its dtype.

    The rotary module's angles are an elementwise product of position and frequency, so a row of
    the table is bit for bit what the module computes for that position on its own.
    """
    rotary = model.rotary
    size = getattr(model.config, "max_position_embeddings", None)
    if size is None or "dynamic" in rotary.rope_type or rotary.rope_type == "longrope":
        return None
    weight = model.lm_head.weight
    positions = torch.arange(size, device=weight.device)[None]
    cos, sin = rotary(weight[:1], positions)
    return cos[0].to(weight.dtype).contiguous(), sin[0].to(weight.dtype).contiguous()


class FusedHead:
    """The head's layer with the target's fused kernels (RMSNorm, rotary + KV write, SiLU·up;
    for up to FEW_ROWS rows the few-row GEMVs with the norm and residual adds folded in): about
    a dozen launches a step instead of forty. CUDA only; EAGLE-3 heads of one layer."""

    def __init__(self, head: EagleHead) -> None:
        layer = head.layers[0]
        a = layer.self_attn
        self.head, self.layer = head, layer
        self.qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        self.gate_up = torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight])
        weight = head.fc.weight
        positions = torch.arange(head.config.rope.get("max_position_embeddings", 8192))
        cos, sin = head.rotary(weight[:1], positions[None].to(weight.device))
        self.cos, self.sin = cos[0].to(weight.dtype), sin[0].to(weight.dtype)

    @staticmethod
    def supported(head: EagleHead) -> bool:
        return head.config.eagle3 and len(head.layers) == 1

    def logits(self, out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of the layer's output (`weight`: the draft vocabulary's rows
        of the LM head), in the head's dtype."""
        return F.linear(rms_norm(out, self.head.norm, None), weight)

    def best(self, out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The most likely draft id of each row: for a few rows one GEMV with the norm in it
        (a chain's choice; a tree ranks its candidates by `logits`)."""
        if len(out) <= FEW_ROWS:
            return gemv(out, weight, norm=self.head.norm).argmax(-1)
        return self.logits(out, weight).argmax(-1)

    def __call__(self, tokens, hidden, positions, kv, meta: DecodeMetadata) -> torch.Tensor:
        layer, head = self.layer, self.head
        emb = rms_norm(head.embed(tokens), layer.input_layernorm, None)
        x = torch.cat([emb, rms_norm(hidden, layer.hidden_norm, None)], -1)
        q = rope_and_cache(F.linear(x, self.qkv), self.cos, self.sin, positions,
                           kv[0][0], kv[1][0], meta.slot_mapping, layer)  # fmt: skip
        o = attend(q, kv[0][0], kv[1][0], meta)
        residual = hidden.clone()
        if len(tokens) <= FEW_ROWS:  # the target's few-row GEMVs: norm, SiLU·up and adds fused
            gemv(o.flatten(1), layer.self_attn.o_proj.weight, add_to=residual)
            act = gemv(residual, self.gate_up, norm=layer.post_attention_layernorm, silu_mul=True)
            return gemv(act, layer.mlp.down_proj.weight, add_to=residual)
        h = rms_norm(F.linear(o.flatten(1), layer.self_attn.o_proj.weight),
                     layer.post_attention_layernorm, residual)  # fmt: skip
        up = silu_and_mul(F.linear(h, self.gate_up))
        return residual + F.linear(up, layer.mlp.down_proj.weight)
