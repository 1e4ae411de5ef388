"""MASK-slot adapters for tests: random ones (nothing about them is a no-op), and cores that
serve `introspective` with one beside ar and speculative decoding."""

from __future__ import annotations

from pathlib import Path

import torch

from stride.decoders.autoregressive import Autoregressive
from stride.decoders.refine import Refine
from stride.decoders.speculative import Speculative
from stride.engine.adapter import MaskAdapter
from stride.engine.config import EngineConfig
from stride.engine.engine import Engine
from stride.scheduler.core import EngineCore
from stride.scheduler.policy import SchedulerConfig

SLOTS = 3


def random_adapter(model, seed: int = 0, rank: int = 4, slots: int = SLOTS) -> MaskAdapter:
    """An adapter for `model` whose every parameter is random."""
    adapter = MaskAdapter.new(model, rank, slots)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return adapter


def introspective_core(
    model_dir: Path, adapter: Path | None = None, kv_bytes: int = 16 << 20, **sched
) -> EngineCore:
    """ar, speculative and refine over `model_dir`, refine with the adapter saved in `adapter`
    (None: a random one)."""
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", kv_cache_memory=kv_bytes))
    loaded = random_adapter(engine.model) if adapter is None else None
    if loaded is None:
        loaded = MaskAdapter.load(adapter, engine.model)
    engine.runner.attach_adapter(loaded)
    decoders = {
        "ar": Autoregressive(),
        "speculative": Speculative(engine, measure_costs=False),
        "refine": Refine(adapter=loaded),
    }
    return EngineCore(engine, SchedulerConfig(**sched), decoders=decoders)
