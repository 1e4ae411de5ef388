"""EAGLE draft heads: one small decoder layer that drafts from the target's own hidden states.

A head drafts the token after next from two inputs per position t: the target's hidden state at
t (its *feature*) and the embedding of token t+1. Chained, it feeds its own output back in place
of the feature: row t at draft depth j consumes (g_t^(j-1), token t+1+j) at position t+j and
predicts token t+2+j. Its keys and values live in a cache of its own, one layer per head layer,
laid out in the target's slots so that a sequence's block table serves both: position p of the
head sits in the slot of position p of the target, and rolling the target back rolls the head
back with it.

Two published layouts load (and the trainer in `stride.train` writes the first):

- EAGLE-3 (SpecForge's `LlamaForCausalLMEagle3`): the feature is `fc` over the concatenated
  outputs of a low, a middle and a high target layer (`eagle_aux_hidden_state_layer_ids`,
  default [1, L/2 - 1, L - 4]); `midlayer` normalises embedding and feature apart
  (`input_layernorm`, `hidden_norm`) and attends over their concatenation (q/k/v read 2H); a
  final `norm` and a draft vocabulary (`lm_head` over `draft_vocab_size` tokens, `d2t` maps a
  draft id d to target id d + d2t[d]). A head without `lm_head.weight` uses the target's own
  head rows for its draft vocabulary, which keeps the file small.
- EAGLE-1/2 (the EAGLE authors' `fc` + `layers.0`): the feature is the target's final normed
  hidden state; `fc` maps [embedding; feature] to H; layer 0 has no input norm; the output goes
  straight through the target's `lm_head`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig

from stride.engine.attention import AttentionMetadata, paged_attention
from stride.engine.kernels.decode_attention import DecodeMetadata
from stride.engine.kv_cache import KVCache
from stride.engine.model import MLP, CausalLM, RMSNorm, Rotary, head_product, rotate
from stride.engine.spans import Span, prepare

EAGLE3 = "LlamaForCausalLMEagle3"
EAGLE1 = "EagleLlama"  # what Stride calls the EAGLE-1/2 layout (its config names LlamaForCausalLM)


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """A low, a middle and a high layer, as EAGLE-3's reference trainers pick them (kept below
    the last layer, whose output only reaches the head through the final norm)."""
    return tuple(min(max(i, 0), num_layers - 2) for i in (1, num_layers // 2 - 1, num_layers - 4))


@dataclass
class EagleConfig:
    """What a head's config.json says, in the names the published layouts use."""

    architecture: str  # EAGLE3 or EAGLE1
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    draft_vocab_size: int
    # Target layers whose outputs make the feature (the target's layer count: its final normed
    # state, EAGLE-1's feature).
    aux_layers: tuple[int, ...] = ()
    num_hidden_layers: int = 1
    rope: dict[str, Any] = field(default_factory=dict)  # rope_theta, rope_scaling, max positions

    @property
    def eagle3(self) -> bool:
        return self.architecture == EAGLE3

    @classmethod
    def read(cls, path: Path, target: LlamaConfig | None = None) -> EagleConfig:
        raw = json.loads((path / "config.json").read_text())
        arch = (raw.get("architectures") or [""])[0]
        eagle3 = arch == EAGLE3 or "draft_vocab_size" in raw
        heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        if target is None:
            raise ValueError(f"{path}: reading a head needs its target's config")
        aux: tuple[int, ...] = (target.num_hidden_layers,)  # EAGLE-1: the final normed state
        if eagle3:
            ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            ids = ids or raw.get("eagle_aux_hidden_state_layer_ids")
            if ids is None:
                ids = default_aux_layers(target.num_hidden_layers)
            aux = tuple(int(i) for i in ids)
        return cls(
            architecture=EAGLE3 if eagle3 else EAGLE1,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            intermediate_size=raw["intermediate_size"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            vocab_size=raw["vocab_size"],
            draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
            aux_layers=aux,
            num_hidden_layers=raw.get("num_hidden_layers", 1),
            rope={
                k: raw[k]
                for k in ("rope_theta", "rope_scaling", "max_position_embeddings")
                if raw.get(k) is not None
            },
        )

    def to_json(self) -> dict[str, Any]:
        """config.json in the EAGLE-3 layout (what SpecForge, vLLM and SGLang read)."""
        if not self.eagle3:
            raise ValueError("Stride writes heads in the EAGLE-3 layout only")
        return {
            "architectures": [EAGLE3],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers)},
            **self.rope,
        }

    def llama(self) -> LlamaConfig:
        """A LlamaConfig of the head's layer shape (for the MLP and rotary modules)."""
        return LlamaConfig(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            rms_norm_eps=self.rms_norm_eps,
            vocab_size=self.vocab_size,
            num_hidden_layers=self.num_hidden_layers,
            **self.rope,
        )

    @classmethod
    def for_target(
        cls, target: LlamaConfig, draft_vocab_size: int, num_layers: int = 1
    ) -> EagleConfig:
        """A new EAGLE-3 head shaped like one of the target's layers."""
        heads = target.num_attention_heads
        return cls(
            architecture=EAGLE3,
            hidden_size=target.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(target, "num_key_value_heads", None) or heads,
            head_dim=getattr(target, "head_dim", None) or target.hidden_size // heads,
            intermediate_size=target.intermediate_size,
            rms_norm_eps=target.rms_norm_eps,
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size,
            aux_layers=default_aux_layers(target.num_hidden_layers),
            num_hidden_layers=num_layers,
            rope={
                k: getattr(target, k)
                for k in ("rope_theta", "rope_scaling", "max_position_embeddings")
                if getattr(target, k, None) is not None
            },
        )


class HeadLayer(nn.Module):
    """A Llama decoder layer whose attention reads [embedding; feature] in the first layer."""

    def __init__(self, config: EagleConfig, first: bool) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            d,
        )
        # EAGLE-3's first layer attends over the concatenation; EAGLE-1's over fc's output.
        self.fused_input = first and config.eagle3
        width = 2 * h if self.fused_input else h
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(width, self.num_heads * d, bias=False)
        self.self_attn.k_proj = nn.Linear(width, self.num_kv_heads * d, bias=False)
        self.self_attn.v_proj = nn.Linear(width, self.num_kv_heads * d, bias=False)
        self.self_attn.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.mlp = MLP(config.llama())
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        if self.fused_input:
            self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
            self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        elif not first:
            self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        # (EAGLE-1's layer 0 has no input norm: fc's output goes in as it is.)

    def attention_input(
        self, x: torch.Tensor, embeds: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(what q/k/v read, the residual stream) for input x (and the embeddings, layer 0)."""
        if self.fused_input:
            return torch.cat([self.input_layernorm(embeds), self.hidden_norm(x)], -1), x
        if hasattr(self, "input_layernorm"):
            return self.input_layernorm(x), x
        return x, x

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, a = x.shape[:-1], self.self_attn
        q = a.q_proj(x).view(*t, self.num_heads, self.head_dim)
        k = a.k_proj(x).view(*t, self.num_kv_heads, self.head_dim)
        v = a.v_proj(x).view(*t, self.num_kv_heads, self.head_dim)
        return q, k, v

    def finish(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """o_proj, residual add, then the MLP block; attended: [..., heads, head_dim]."""
        x = residual + self.self_attn.o_proj(attended.flatten(-2))
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleHead(nn.Module):
    """A draft head bound to its target (whose embedding, and maybe head, it shares)."""

    def __init__(
        self,
        config: EagleConfig,
        target: CausalLM,
        vocab: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """`vocab`: the target's whole embedding and LM head, when the target holds only a
        slice of them (split over ranks: `Engine.whole_vocab`)."""
        super().__init__()
        self.config = config
        h = config.hidden_size
        if config.eagle3:
            width = h * len(config.aux_layers)
            self.fc = nn.Linear(width, h, bias=False)
            self.norm = RMSNorm(h, config.rms_norm_eps)
        else:
            self.fc = nn.Linear(2 * h, h, bias=True)
        self.layers = nn.ModuleList(
            HeadLayer(config, first=i == 0) for i in range(config.num_hidden_layers)
        )
        self.rotary = Rotary(config.llama())
        # Shared with the target, not owned (and not saved): its token embedding, and the
        # target's own head rows unless the head brings a draft vocabulary head of its own.
        self._target = [target]  # a list, so that nn.Module does not register it
        self._vocab = vocab
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.lm_head: torch.Tensor | None = None  # [draft_vocab, H]; None: the target's rows

    @property
    def target(self) -> CausalLM:
        return self._target[0]

    @property
    def draft_ids(self) -> torch.Tensor:
        """[draft_vocab] the target token id of each draft id."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def head_weight(self) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head
        weight = self.target.lm_head.weight if self._vocab is None else self._vocab[1]
        if self.config.draft_vocab_size == self.config.vocab_size:
            return weight
        return weight[self.draft_ids]

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's captured hidden states → the head's feature input (EAGLE-3: fc)."""
        return self.fc(aux) if self.config.eagle3 else aux

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self._vocab is not None:
            return F.embedding(token_ids, self._vocab[0])
        return self.target.model.embed_tokens(token_ids)

    def inputs(self, token_ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(layer-0 input, embeddings) for tokens and features (or the head's own outputs)."""
        embeds = self.embed(token_ids)
        if self.config.eagle3:
            return hidden, embeds
        return self.fc(torch.cat([embeds, hidden], -1)), embeds

    def logits(self, out: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """Draft-vocabulary logits of the head's output (EAGLE-1: the target's head, no norm)."""
        x = self.norm(out) if self.config.eagle3 else out
        return head_product(x, self.head_weight() if weight is None else weight).float()

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary(x, positions.reshape(1, -1))
        shape = (*positions.shape, 1, cos.shape[-1])
        return cos.reshape(shape).to(x.dtype), sin.reshape(shape).to(x.dtype)

    def forward(
        self,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata | DecodeMetadata,
    ) -> torch.Tensor:
        """Rows of a ragged batch over the head's paged cache; returns the outputs g [T, H].

        `hidden` is each row's feature (`project`ed) or the head's own output for the row before
        it in a chain; `kv` holds [layers, slots, kv_heads, head_dim] keys and values.
        """
        x, embeds = self.inputs(token_ids, hidden)
        cos, sin = self.rope(x, positions)
        for i, layer in enumerate(self.layers):
            attn_in, residual = layer.attention_input(x, embeds if i == 0 else None)
            q, k, v = layer.qkv(attn_in)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            attended = paged_attention(q, k, v, kv[0][i], kv[1][i], meta)
            x = layer.finish(attended, residual)
        return x


def load_head(
    path: Path, target: CausalLM, vocab: tuple[torch.Tensor, torch.Tensor] | None = None
) -> EagleHead:
    """A head directory in either published layout, on the target's device and dtype
    (`vocab`: the whole embedding and LM head of a target split over ranks)."""
    config = EagleConfig.read(path, target.config)
    if config.hidden_size != target.config.hidden_size:
        raise ValueError(
            f"draft head {path} has hidden size {config.hidden_size}, "
            f"the target {target.config.hidden_size}"
        )
    if config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"draft head {path} has vocabulary {config.vocab_size}, "
            f"the target {target.config.vocab_size}"
        )
    state: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update(load_file(file))
    if not state:
        bins = sorted(path.glob("pytorch_model*.bin"))
        for file in bins:
            state.update(torch.load(file, map_location="cpu", weights_only=True))
    if not state:
        raise ValueError(f"no weights (*.safetensors or pytorch_model.bin) in {path}")
    param = target.lm_head.weight if vocab is None else vocab[1]
    head = EagleHead(config, target, vocab)
    own = _from_published(state, config)
    lm_head = own.pop("lm_head.weight", None)
    missing, unexpected = head.load_state_dict(own, strict=False)
    missing = [m for m in missing if not m.startswith("rotary.") and m != "d2t"]
    if missing or unexpected:
        raise ValueError(f"draft head {path}: missing {missing[:4]}, unexpected {unexpected[:4]}")
    head = head.to(device=param.device, dtype=param.dtype)
    head.d2t = head.d2t.long()
    if lm_head is not None:
        head.lm_head = lm_head.to(device=param.device, dtype=param.dtype)
    elif config.draft_vocab_size != config.vocab_size:  # the target's rows, gathered once
        head.lm_head = param.detach()[head.draft_ids].contiguous()
    with torch.device(param.device):  # fp32 angles, whatever the weights' dtype
        head.rotary = Rotary(config.llama())
    return head.eval()


def _from_published(state: dict[str, torch.Tensor], config: EagleConfig) -> dict[str, Any]:
    """Published key names → this module's (EAGLE-3's `midlayer.` is layer 0)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if key.startswith(("embed_tokens.", "t2d")):
            continue  # the target's embedding is used; t2d is what d2t already says
        if key.startswith("midlayer."):
            key = "layers.0." + key.removeprefix("midlayer.")
        out[key] = value
    if config.eagle3 and "d2t" not in out and config.draft_vocab_size != config.vocab_size:
        raise ValueError("an EAGLE-3 head with a draft vocabulary needs its d2t map")
    return out


def save_head(head: EagleHead, path: Path, with_lm_head: bool = False) -> None:
    """Write `head` in the EAGLE-3 layout (bf16 safetensors + config.json).

    `with_lm_head`: store the draft vocabulary's head rows too (what other servers expect); a
    head without them takes its target's rows when Stride loads it, and is much smaller.
    """
    path.mkdir(parents=True, exist_ok=True)
    state = {}
    for key, value in head.state_dict().items():
        if key.startswith("rotary."):
            continue
        if key.startswith("layers.0."):
            key = "midlayer." + key.removeprefix("layers.0.")
        state[key] = value.detach().to("cpu")
    for key, value in state.items():
        if value.is_floating_point():
            state[key] = value.to(torch.bfloat16).contiguous()
    state["d2t"] = head.d2t.detach().cpu().long()
    t2d = torch.zeros(head.config.vocab_size, dtype=torch.bool)
    t2d[head.draft_ids.cpu()] = True
    state["t2d"] = t2d
    if with_lm_head:
        state["lm_head.weight"] = head.head_weight().detach().to("cpu", torch.bfloat16).contiguous()
    save_file(state, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(head.config.to_json(), indent=2) + "\n")


class HeadRunner:
    """A head's batched forward over a KV cache of its own, in the target's slot layout.

    Rows come as `spans.Span`s of the target's sequences: a span's `offset` (from the
    sequence's `num_cached`) says at which position its rows start, and its mask, like the
    target's, may restrict what they see of the last slots (tree drafts see only their
    ancestors). Position p of the head lives in the slot of position p of the target, so the
    target's block tables serve the head too, and whatever the target gives back the head loses
    with it; the head only ever attends to positions it wrote since (see `EagleDrafter`).
    """

    def __init__(self, head: EagleHead, cache: KVCache) -> None:
        self.head = head
        self.block_size = cache.block_size
        layer = head.layers[0]
        shape = (len(head.layers), cache.k.shape[1], layer.num_kv_heads, layer.head_dim)
        dtype, device = head.fc.weight.dtype, cache.k.device
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @torch.inference_mode()
    def forward(self, spans: list[Span], hidden: torch.Tensor) -> torch.Tensor:
        """The head's outputs g [rows, H] for the spans' rows (packed in span order), each
        reading its token and its `hidden` row (a projected feature or an earlier output)."""
        meta, tokens, positions, _ = prepare(spans, self.block_size, self.k.device)
        return self.head(tokens, hidden, positions, (self.k, self.v), meta)
