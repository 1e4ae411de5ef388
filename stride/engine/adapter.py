"""The MASK-slot adapter: a learned MASK embedding and low-rank adapters gated to MASK rows.

The `introspective` refine method appends MASK slots after a sequence's real tokens; one causal
forward then verifies the real tokens and, at the slots, guesses the tokens after them. A base
model cannot guess from a placeholder, so the slots' rows get help the real rows never see: their
input is a learned embedding instead of a token's, and every adapted projection adds a rank-r
product `B(A x)` on those rows only. Real rows run the base model untouched, bit for bit (they
come before the slots and never attend to them), which is what keeps the method lossless.

The gate is a set of forward hooks on the model's modules, active only inside `on_rows`: the
engine's `CausalLM` and a transformers Llama-family model name their modules alike, so the same
adapter serves (the engine's runner) and trains (`stride.train.introspective`) unchanged.
A slot is written in a span as the token id `MASK_TOKEN`, which no vocabulary holds.

On disk: `config.json` (`AdapterConfig`) and `model.safetensors` (`mask_embedding`, and
`<module path>.lora_a` [r, in] / `.lora_b` [out, r] per adapted projection).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

MASK_TOKEN = -1
ARCHITECTURE = "StrideMaskAdapter"
PROJECTIONS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip


@dataclass
class AdapterConfig:
    rank: int
    slots: int  # MASK slots per set it was trained for (k)
    hidden_size: int
    num_layers: int
    vocab_size: int
    projections: tuple[str, ...] = PROJECTIONS
    base_model: str = ""  # the name of the model it was trained on (informative)
    architecture: str = ARCHITECTURE

    @classmethod
    def read(cls, path: Path) -> AdapterConfig:
        raw = json.loads((path / "config.json").read_text())
        if raw.get("architecture") != ARCHITECTURE:
            raise ValueError(f"{path} holds no MASK-slot adapter (config.json: {ARCHITECTURE})")
        raw["projections"] = tuple(raw["projections"])
        return cls(**raw)


class LowRank(nn.Module):
    def __init__(self, fan_in: int, fan_out: int, rank: int) -> None:
        super().__init__()
        self.lora_a = nn.Parameter(torch.randn(rank, fan_in) / fan_in**0.5)
        self.lora_b = nn.Parameter(torch.zeros(fan_out, rank))  # starts as no change

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.lora_a.T.to(x.dtype)) @ self.lora_b.T.to(x.dtype)

    def delta(self) -> torch.Tensor:
        """B A [out, in], fp32: what the adapter adds to its projection's weight."""
        return self.lora_b.float() @ self.lora_a.float()


class MaskAdapter(nn.Module):
    """The adapter's parameters, and the hooks that apply them to one model's MASK rows."""

    def __init__(self, config: AdapterConfig, model: nn.Module) -> None:
        super().__init__()
        self.config = config
        modules = dict(model.named_modules())
        embed = modules["model.embed_tokens"].weight
        if embed.shape[1] != config.hidden_size or _num_layers(model) != config.num_layers:
            raise ValueError(
                f"the adapter was trained for {config.num_layers} layers of width "
                f"{config.hidden_size}, not this model's {_num_layers(model)} of {embed.shape[1]}"
            )
        self.mask_embedding = nn.Parameter(embed.detach().float().mean(0))
        self.paths = [
            f"model.layers.{i}.{p}" for i in range(config.num_layers) for p in config.projections
        ]
        self.low_rank = nn.ModuleList(
            LowRank(modules[p].in_features, modules[p].out_features, config.rank)
            for p in self.paths
        )
        self._rows: torch.Tensor | None = None
        self._hooked: set[int] = set()  # ids of the models whose modules carry the hooks

    @classmethod
    def new(cls, model: nn.Module, rank: int, slots: int, base_model: str = "") -> MaskAdapter:
        """A fresh adapter for `model` (its `config` says the shapes): no-op projections."""
        c = model.config
        config = AdapterConfig(
            rank, slots, c.hidden_size, c.num_hidden_layers, c.vocab_size, base_model=base_model
        )
        return cls(config, model).to(model.model.embed_tokens.weight.device)

    @classmethod
    def load(cls, path: Path | str, model: nn.Module) -> MaskAdapter:
        """The adapter saved in `path`, for `model`, on its device and in its dtype."""
        path = Path(path)
        config = AdapterConfig.read(path)
        if config.vocab_size != model.config.vocab_size:
            raise ValueError(
                f"the adapter in {path} was trained for a vocabulary of {config.vocab_size}, "
                f"not {model.config.vocab_size}"
            )
        adapter = cls(config, model)
        tensors = load_file(str(path / "model.safetensors"))
        with torch.no_grad():
            adapter.mask_embedding.copy_(tensors["mask_embedding"])
            for p, lr in zip(adapter.paths, adapter.low_rank, strict=True):
                lr.lora_a.copy_(tensors[f"{p}.lora_a"])
                lr.lora_b.copy_(tensors[f"{p}.lora_b"])
        weight = model.model.embed_tokens.weight
        return adapter.to(weight.device, weight.dtype)

    def save(self, path: Path | str, dtype: torch.dtype = torch.bfloat16) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tensors = {"mask_embedding": self.mask_embedding}
        for p, lr in zip(self.paths, self.low_rank, strict=True):
            tensors[f"{p}.lora_a"], tensors[f"{p}.lora_b"] = lr.lora_a, lr.lora_b
        save_file(
            {k: v.detach().to("cpu", dtype).contiguous() for k, v in tensors.items()},
            str(path / "model.safetensors"),
        )
        config = {**asdict(self.config), "projections": list(self.config.projections)}
        (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    def merged(
        self, model: nn.Module, groups: tuple[tuple[str, ...], ...]
    ) -> list[tuple[torch.Tensor, ...]]:
        """Per layer of `model`, each group of its projections stacked (as a fused QKV stacks
        them), each with its low-rank product added: the weights a MASK row sees, for the fused
        kernels (their results differ from the hooks' by rounding alone)."""
        by_path = dict(zip(self.paths, self.low_rank, strict=True))
        modules = dict(model.named_modules())

        def stacked(layer: int, names: tuple[str, ...]) -> torch.Tensor:
            weights = []
            for name in names:
                path = f"model.layers.{layer}.{name}"
                weight = modules[path].weight
                delta = by_path[path].delta().to(weight.device) if path in by_path else 0.0
                weights.append(weight.float() + delta)
            return torch.cat(weights).to(weight.dtype)

        return [
            tuple(stacked(i, names) for names in groups) for i in range(self.config.num_layers)
        ]

    def attach(self, model: nn.Module) -> MaskAdapter:
        """Hook the adapter into `model` (once); the hooks are inert outside `on_rows`."""
        if id(model) in self._hooked:
            return self
        self._hooked.add(id(model))
        modules = dict(model.named_modules())
        modules["model.embed_tokens"].register_forward_hook(self._embed)
        for p, lr in zip(self.paths, self.low_rank, strict=True):
            modules[p].register_forward_hook(partial(self._project, lr))
        return self

    @contextmanager
    def on_rows(self, rows: torch.Tensor) -> Iterator[None]:
        """Forwards inside run the adapter on `rows`: indices into the batch's tokens, flattened
        over the leading dimensions ([tokens] for the engine, [batch, length] for training)."""
        self._rows = rows
        try:
            yield
        finally:
            self._rows = None

    def _embed(self, module, inputs, output: torch.Tensor) -> torch.Tensor | None:
        rows = self._rows
        if rows is None:
            return None
        flat = output.reshape(-1, output.shape[-1])
        mask = self.mask_embedding.to(flat.dtype).expand(len(rows), -1)
        return flat.index_copy(0, rows, mask).view_as(output)

    def _project(self, low_rank: LowRank, module, inputs, output: torch.Tensor):
        rows = self._rows
        if rows is None:
            return None
        x = inputs[0].reshape(-1, inputs[0].shape[-1])
        flat = output.reshape(-1, output.shape[-1])
        return flat.index_add(0, rows, low_rank(x[rows]).to(flat.dtype)).view_as(output)


def _num_layers(model: nn.Module) -> int:
    return len(model.model.layers)
