"""EAGLE heads over a tiny target: random heads in the published layout, cores that draft
with them (the fixtures `eagle_target`, `eagle_head`, `eagle_ref` are in
tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from stride.decoders.registry import DecodersConfig, build_decoders
from stride.engine.config import EngineConfig
from stride.engine.eagle import save_head
from stride.engine.engine import Engine
from stride.scheduler.core import EngineCore
from stride.scheduler.policy import SchedulerConfig
from stride.train import eagle as trainer
from tests.helpers.models import load_hf

K = 4
CHAIN = dict(draft="eagle", num_speculative_tokens=K, adaptive=False)
TREE = dict(draft="eagle", num_speculative_tokens=K, adaptive=False, tree_nodes=12, tree_topk=3)


def random_head(model_dir: Path, out: Path, draft_vocab: int | None = None, seed: int = 0):
    """A random EAGLE-3 head for the target (decisive weights: few near-ties), saved in the
    published layout; a draft vocabulary of the lowest `draft_vocab` ids if given."""
    hf = load_hf(model_dir)
    vocab = hf.config.vocab_size
    ids = torch.arange(draft_vocab or vocab)
    head = trainer.new_head(hf, ids)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    save_head(head, out)
    return out


def eagle_core(model: Path, head: Path | None, kv_bytes: int = 8 << 20, **sched) -> EngineCore:
    """A core whose speculative decoder drafts with `head` (None: no head)."""
    engine = Engine(EngineConfig(model=str(model), device="cpu", kv_cache_memory=kv_bytes))
    decoders = build_decoders(engine, DecodersConfig(draft_head=head and str(head)))
    return EngineCore(engine, SchedulerConfig(**sched), decoders)


def free(core: EngineCore) -> bool:
    cache = core.engine.cache
    return cache.num_free_blocks == cache.num_usable_blocks


def record_bursts(core: EngineCore) -> list[tuple]:
    """Every run of `core`'s EAGLE device loop from now on: (sequences, shape, cycles)."""
    cycles = core.decoders["speculative"].eagle.cycles
    ran, real = [], cycles.run

    def recorded(seqs, roots, shape, n):
        ran.append((len(seqs), shape, n))
        return real(seqs, roots, shape, n)

    cycles.run = recorded
    return ran
