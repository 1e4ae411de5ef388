"""Tensor parallelism: which share of a model each rank holds, and the collectives that join them.

Megatron-style, over `torch.distributed` (NCCL on GPUs, gloo on the CPU):
  - attention: each rank holds whole KV groups, i.e. some KV heads and the query heads that read
    them (Q/K/V split by rows, the output projection by columns); with more ranks than KV heads,
    each KV head is replicated on the ranks that share its query heads;
  - MLP: gate and up split by rows, down by columns;
  - embedding and LM head: vocabulary-parallel (each rank holds a slice of the rows);
  - one all-reduce after the attention's output projection and one after the MLP's down
    projection per layer, one after the embedding; the LM head's slices are all-gathered.
The residual stream, norms and rotary are replicated: every rank holds the same hidden states
between layers, so what reads them (early exit, captured features) is unchanged.

Uneven splits are handled, not refused: heads are dealt out in whole KV groups as evenly as
they go (SmolLM2-135M's 3 KV groups of 3 heads give TP=2 ranks 3 and 6 heads), a group shared
by several ranks is split as evenly as it goes, and MLP columns and vocabulary rows likewise
(the vocabulary's last slice is padded so the all-gather sees equal slices). Only a split that
leaves a rank without a query head is refused, with an error that says so.

The modules below keep the state-dict names of `model.CausalLM`'s (they subclass `nn.Linear`
and `nn.Embedding`), so a sharded model loads a checkpoint's sliced tensors as they come.
"""

from __future__ import annotations

import copy
import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from stride.engine.model import CausalLM, VocabHead, head_product

# torch 2.13 renamed the gather into one tensor and warns on the old name; 2.11 has only the old
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# How long a collective may wait for a peer before it fails (a dead peer fails it at once on
# gloo; on NCCL the engine's watcher aborts the group as soon as a worker exits).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


def _split(n: int, parts: int, i: int) -> range:
    """Part i of `range(n)` cut into `parts` contiguous pieces as even as they go."""
    return range(n * i // parts, n * (i + 1) // parts)


@dataclass(frozen=True)
class Layout:
    """What rank `rank` of `world` holds of a model: index ranges into the full tensors."""

    rank: int
    world: int
    head_dim: int
    heads: range  # query heads
    kv_heads: range
    ffn: range  # MLP intermediate columns
    vocab: range  # embedding / LM head rows (real ones)
    vocab_per_rank: int  # rows each rank holds, padding included (equal on every rank)

    @classmethod
    def of(cls, config: PretrainedConfig, world: int, rank: int) -> Layout:
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        group = heads // kv
        if world <= kv:
            kv_heads = _split(kv, world, rank)
            q_heads = range(kv_heads.start * group, kv_heads.stop * group)
        else:  # ranks r with r * kv // world == j share KV head j and split its query heads
            j = rank * kv // world
            sharing = [r for r in range(world) if r * kv // world == j]
            mine = _split(group, len(sharing), sharing.index(rank))
            kv_heads = range(j, j + 1)
            q_heads = range(j * group + mine.start, j * group + mine.stop)
        if not q_heads:
            raise ValueError(
                f"--tensor-parallel-size {world} leaves rank {rank} without an attention head: "
                f"the model has {heads} query heads in {kv} KV groups of {group}; each rank "
                f"needs at least one (use a size of at most {heads}, and at most {group} ranks "
                "per KV group)"
            )
        ffn = _split(config.intermediate_size, world, rank)
        per_rank = -(-config.vocab_size // world)
        start = min(rank * per_rank, config.vocab_size)
        vocab = range(start, min(start + per_rank, config.vocab_size))
        return cls(rank, world, head_dim, q_heads, kv_heads, ffn, vocab, per_rank)

    def local_config(self, config: PretrainedConfig) -> PretrainedConfig:
        """`config` with this rank's head, column and vocabulary counts (to build its modules)."""
        local = copy.deepcopy(config)
        local.num_attention_heads = len(self.heads)
        local.num_key_value_heads = len(self.kv_heads)
        local.head_dim = self.head_dim
        local.intermediate_size = len(self.ffn)
        local.vocab_size = self.vocab_per_rank
        return local

    def slice_of(self, name: str) -> tuple[int, range] | None:
        """The dimension and index range of this rank's slice of checkpoint tensor `name`
        (None: replicated whole)."""
        d = self.head_dim
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return 0, range(self.heads.start * d, self.heads.stop * d)
        if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            return 0, range(self.kv_heads.start * d, self.kv_heads.stop * d)
        if name.endswith("o_proj.weight"):
            return 1, range(self.heads.start * d, self.heads.stop * d)
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            return 0, self.ffn
        if name.endswith("down_proj.weight"):
            return 1, self.ffn
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return 0, self.vocab
        return None

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's share of a whole checkpoint tensor (a copy, so the whole can go)."""
        where = self.slice_of(name)
        if where is None:
            return tensor
        dim, part = where
        return self.pad(name, tensor.narrow(dim, part.start, len(part)).clone())

    def pad(self, name: str, part: torch.Tensor) -> torch.Tensor:
        """A vocabulary slice padded with zero rows to `vocab_per_rank` (others: as they are)."""
        missing = self.vocab_per_rank - len(self.vocab)
        if missing and name in ("model.embed_tokens.weight", "lm_head.weight"):
            part = torch.cat([part, part.new_zeros(missing, *part.shape[1:])])
        return part


class RowParallelLinear(nn.Linear):
    """A projection whose input columns are split over the ranks: the partial products sum."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out)
        return out


class VocabParallelEmbedding(nn.Embedding):
    """Rows `start .. start + num_embeddings` of the table; ids elsewhere look up zeros, and the
    all-reduce adds the one rank that holds each id."""

    def __init__(self, num_embeddings: int, embedding_dim: int, start: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.start = start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside[:, None], 0)
        dist.all_reduce(x)
        return x


class VocabParallelHead(VocabHead):
    """The LM head's slice of rows: each rank's logits, all-gathered into the whole row."""

    def __init__(self, hidden: int, per_rank: int, vocab: int, world: int) -> None:
        super().__init__(hidden, per_rank, bias=False)
        self.vocab, self.world = vocab, world

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = head_product(x, self.weight)
        gathered = local.new_empty(self.world * local.shape[0], local.shape[1])
        _all_gather(gathered, local.contiguous())
        whole = gathered.view(self.world, *local.shape).permute(1, 0, 2).flatten(1)
        return whole[:, : self.vocab]


def sharded_model(config: PretrainedConfig, layout: Layout) -> CausalLM:
    """This rank's `CausalLM` (on the current default device: the loader builds it on meta),
    its layers with `layout`'s heads and columns, the reducing and gathering modules in place.
    `model.config` stays the whole model's (what callers read: vocabulary, layers, positions)."""
    local = layout.local_config(config)
    net = CausalLM(local)
    hidden = config.hidden_size
    for layer in net.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        a.o_proj = RowParallelLinear(a.o_proj.in_features, hidden, bias=False)
        mlp.down_proj = RowParallelLinear(mlp.down_proj.in_features, hidden, bias=False)
    net.model.embed_tokens = VocabParallelEmbedding(
        layout.vocab_per_rank, hidden, layout.rank * layout.vocab_per_rank
    )
    net.lm_head = VocabParallelHead(
        hidden, layout.vocab_per_rank, config.vocab_size, layout.world
    )
    if getattr(config, "tie_word_embeddings", False):
        net.lm_head.weight = net.model.embed_tokens.weight
    net.config = config
    return net


def backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU after the one named (cuda:1 with TP=2: cuda:1, cuda:2)."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def agree_min(value: int, device: torch.device) -> int:
    """The smallest of every rank's `value` (each rank sizes its KV cache from its own memory;
    block tables are shared, so all hold as many blocks as the tightest one)."""
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def broadcast_tokens(tokens: torch.Tensor) -> torch.Tensor:
    """Rank 0's sampled tokens to every rank (the next decode step's input everywhere)."""
    tokens = tokens.contiguous()
    dist.broadcast(tokens, src=0)
    return tokens


def gather_vocab(model: CausalLM) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole embedding and LM head, all-gathered from every rank's slices (what an EAGLE
    head shares with its target; every rank must call this together)."""
    vocab = model.config.vocab_size
    embed = _gather_rows(model.model.embed_tokens.weight, vocab)
    if model.lm_head.weight is model.model.embed_tokens.weight:
        return embed, embed
    return embed, _gather_rows(model.lm_head.weight, vocab)


def _gather_rows(part: torch.Tensor, rows: int) -> torch.Tensor:
    whole = part.new_empty(dist.get_world_size() * part.shape[0], *part.shape[1:])
    _all_gather(whole, part.detach().contiguous())
    return whole[:rows]
