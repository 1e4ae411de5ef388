"""MASK-slot adapters for tests: random ones (nothing about them is a no-op), and cores that
serve `introspective` with one beside ar and speculative decoding."""

from __future__ import annotations

from pathlib import Path

import torch

from stride.decoders.autoregressive import Autoregressive
from stride.decoders.base import StepContext
from stride.decoders.introspective import IntrospectiveState
from stride.decoders.refine import Refine
from stride.decoders.speculative import Speculative
from stride.engine.adapter import MaskAdapter
from stride.engine.config import EngineConfig
from stride.engine.engine import Engine
from stride.engine.sequence import Sequence
from stride.engine.spans import Span
from stride.scheduler.core import EngineCore
from stride.scheduler.policy import SchedulerConfig
from tests.helpers.cores import PROMPTS, greedy

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


def pass_spans(core: EngineCore) -> list[Span]:
    """One introspective pass's spans after a prefill of their prompts (a tail, proposals and
    slot sets under their mask; a tail and one set of slots, plainly causal; a tail and one
    proposal), and a lookahead-like masked span without slots beside them."""
    engine, decoder = core.engine, core.decoders["refine"].causal["introspective"]
    runner = engine.runner
    spans = []
    for i, (prompt, drafts) in enumerate(zip(PROMPTS, ([3, 9, 27], [], [5]), strict=False)):
        seq = Sequence(
            f"s{i}", prompt, greedy(8), "refine", {"method": "introspective", "slots": SLOTS}
        )
        engine.cache.reserve(seq, len(prompt) + 32)
        runner.forward([Span(seq, prompt[:-1], num_logits=0)])
        seq.num_cached = len(prompt) - 1
        seq.decoder_state = IntrospectiveState(proposals=drafts)
        extra = decoder.extra_tokens(seq, 64)
        prop = decoder.propose([seq], StepContext(set(), engine.device))[0]
        positions = [seq.num_cached] + prop.positions if prop.positions else None
        spans.append(Span(seq, prompt[-1:] + prop.tokens, 1 + extra, positions, prop.mask))
    other = Sequence("o", PROMPTS[3], greedy(8))
    engine.cache.reserve(other, len(PROMPTS[3]) + 8)
    runner.forward([Span(other, PROMPTS[3][:-1], num_logits=0)])
    other.num_cached = len(PROMPTS[3]) - 1
    branchy = torch.ones(5, 5, dtype=torch.bool).tril()
    branchy[3:, 1:3] = False  # rows 3-4 see the tail and themselves, not rows 1-2
    spans.append(Span(other, PROMPTS[3][-1:] + [5, 6, 7, 8], 5, mask=branchy))
    return spans
