"""Cores that serve `refine` beside `ar`, and the greedy requests refine tests send them: what
the Jacobi/lookahead tests and the payoff tests share."""

from __future__ import annotations

from pathlib import Path

from stride.decoders.autoregressive import Autoregressive
from stride.decoders.refine import Refine
from stride.engine.config import EngineConfig
from stride.engine.engine import Engine
from stride.engine.sequence import SamplingParams
from stride.scheduler.core import EngineCore
from stride.scheduler.outputs import GenerateRequest
from stride.scheduler.policy import SchedulerConfig

TEXT_PROMPTS = [
    "def add(a, b): return a + b\ndef add(a, b):",
    "Once upon a time there was a small model that could count: 1, 2, 3,",
    "Hello, world!",
]


def make_refine_core(model_dir: Path | str | None, kv_bytes: int = 16 << 20, **sched) -> EngineCore:
    engine = Engine(
        EngineConfig(
            model=None if model_dir is None else str(model_dir),
            device="cpu",
            kv_cache_memory=kv_bytes,
        )
    )
    decoders = {"ar": Autoregressive(), "refine": Refine()}
    return EngineCore(engine, SchedulerConfig(**sched), decoders=decoders)


def reqs(core, decoder: str, options: dict, n: int = 24, **kw) -> list[GenerateRequest]:
    """One greedy request of `n` tokens per text prompt, ids `<decoder><i>`; `kw`: more
    sampling parameters (penalties, stop tokens, logprobs)."""
    tok = core.engine.tokenizer
    return [
        GenerateRequest(
            f"{decoder}{i}",
            tok.encode(p),
            SamplingParams(max_tokens=n, temperature=0.0, **kw),
            decoder,
            dict(options),
        )
        for i, p in enumerate(TEXT_PROMPTS)
    ]
