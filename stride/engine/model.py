"""Llama-family decoder (llama, mistral, qwen2, qwen3) over a ragged batch and a paged KV cache.

Parameter names follow Hugging Face's checkpoints, so a safetensors state dict loads as is. The
layer math mirrors transformers' (fp32 RMSNorm, rotary as transformers computes it), which is
what makes token-for-token equality with `generate` possible.

The rotary embedding (`Rotary`) has the same inverse frequencies (transformers' own functions for
every rope type, and the default one's formula) and the same fp32 operations as
`LlamaRotaryEmbedding.forward`. It is defined here rather than imported from `modeling_llama`,
whose import costs an engine or API process several seconds at start (`python -X importtime`);
`modeling_rope_utils` costs next to nothing.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update

from stride.engine.attention import AttentionMetadata, paged_attention

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


class VocabHead(nn.Linear):
    """The LM head: hidden states to logits over the vocabulary, a weight far larger than a CPU's
    caches.

    On a CPU, MKL's GEMM may take a few rows against such a weight at 2-3x the time of one row
    (it packs the weight and streams it again), and the same product as weight @ x^T then streams
    it once; on other CPUs it is the other way round (docs/BENCHMARKS.md, "A vocabulary head's
    product for a few rows, CPU"). So the first product of each row count times both and keeps
    the faster, and a verification pass of a few drafts pays for its logits about what one row
    pays on either.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return head_product(x, self.weight)


# (rows, vocabulary, hidden) -> whether weight @ x^T beat x @ weight^T on this CPU
_TRANSPOSED: dict[tuple[int, ...], bool] = {}


def head_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T for a vocabulary head's weight, in the faster form (see `VocabHead`)."""
    if x.device.type != "cpu" or x.dim() != 2 or not 1 < len(x) <= 64:
        return F.linear(x, weight)
    key = (len(x), *weight.shape)
    if key not in _TRANSPOSED:
        _TRANSPOSED[key] = _seconds(_transposed, x, weight) < _seconds(F.linear, x, weight)
    return _transposed(x, weight) if _TRANSPOSED[key] else F.linear(x, weight)


def _transposed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.mm(weight, x.t()).t().contiguous()


def _seconds(product, x: torch.Tensor, weight: torch.Tensor) -> float:
    """The best of two runs of product(x, weight)."""
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        product(x, weight)
        best = min(best, time.perf_counter() - start)
    return best


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


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


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = paged_attention(q, k, v, kv[0][self.layer], kv[1][self.layer], meta)
        return self.o_proj(out.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, kv, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """Token ids and positions of a ragged batch in, final hidden states out.

    `num_layers` lets a caller run only the first layers (the early-exit drafter). `aux` names
    layers whose outputs (the residual stream after them) a caller also wants, concatenated per
    token: what an EAGLE draft head reads (`engine.eagle`); then the forward returns
    (hidden, aux states).
    """

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        if config.model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {config.model_type!r}; "
                f"Stride supports: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        self.config = config
        self.model = Backbone(config)
        self.lm_head = VocabHead(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(config)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        num_layers: int | None = None,
        aux: tuple[int, ...] = (),
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        x = self.model.embed_tokens(token_ids)
        cos, sin = self.rotary(x, positions[None])
        cos, sin = cos[0, :, None, :].to(x.dtype), sin[0, :, None, :].to(x.dtype)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers[:num_layers]):
            x = layer(x, cos, sin, kv, meta)
            if i in aux:
                captured[i] = x
        out = self.model.norm(x)
        if aux:
            captured[self.num_layers] = out
            return out, torch.cat([captured[i] for i in aux], -1)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
