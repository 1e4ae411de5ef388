"""Rotary position embedding as transformers' Llama computes it.

The same inverse frequencies (transformers' own functions for every rope type, and the default
one's formula) and the same fp32 operations as `LlamaRotaryEmbedding.forward`, which is what
token-for-token equality with `generate` needs. Defined here rather than imported from
`modeling_llama`, whose import costs an engine or API process several seconds at start
(`python -X importtime`); `modeling_rope_utils` costs next to nothing.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update


def default_rope(config: PretrainedConfig, **kwargs) -> tuple[torch.Tensor, float]:
    """The original RoPE's inverse frequencies, and no scaling of cos and sin."""
    base = config.rope_parameters["rope_theta"]
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


class Rotary(nn.Module):
    """cos and sin [1, T, head_dim] for positions [1, T]. The attribute names are the ones
    `dynamic_rope_update` reads and updates (dynamic and long-rope types)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = config.rope_parameters["rope_type"]
        init = default_rope if self.rope_type == "default" else ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = init(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inv_freq = self.inv_freq.to(device=x.device, dtype=torch.float)
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)
