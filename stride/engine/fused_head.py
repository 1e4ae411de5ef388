"""The EAGLE head's layer on the target's fused kernels, for the speculation loop's graphs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stride.engine.attention import attend
from stride.engine.eagle import EagleHead
from stride.engine.kernels import layer as kernels
from stride.engine.kernels.decode_attention import DecodeMetadata


class FusedHead:
    """The head's layer with the target's fused kernels (RMSNorm, rotary + KV write, SiLU·up):
    about fifteen launches a row instead of forty. CUDA only; EAGLE-3 heads of one layer."""

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

    def __call__(self, tokens, hidden, positions, kv, meta: DecodeMetadata) -> torch.Tensor:
        layer, head = self.layer, self.head
        emb = kernels.rms_norm(head.embed(tokens), layer.input_layernorm, None)
        x = torch.cat([emb, kernels.rms_norm(hidden, layer.hidden_norm, None)], -1)
        q = kernels.rope_and_cache(F.linear(x, self.qkv), self.cos, self.sin, positions,
                                 kv[0][0], kv[1][0], meta.slot_mapping, layer)  # fmt: skip
        o = attend(q, kv[0][0], kv[1][0], meta)
        residual = hidden.clone()
        h = kernels.rms_norm(F.linear(o.flatten(1), layer.self_attn.o_proj.weight),
                           layer.post_attention_layernorm, residual)  # fmt: skip
        up = kernels.silu_and_mul(F.linear(h, self.gate_up))
        return residual + F.linear(up, layer.mlp.down_proj.weight)
