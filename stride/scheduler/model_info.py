"""What the HTTP edge needs to know about the loaded model: plain data, so it crosses processes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stride.scheduler.core import EngineCore


@dataclass
class ModelInfo:
    name: str
    tokenizer: Any
    max_model_len: int
    capacity: int  # tokens one sequence can hold: the context length, or less if the KV is small
    vocab_size: int
    max_waiting: int
    device: str  # e.g. "cpu", "cuda:0", "2 x cuda" (split over ranks); for the ready line
    dtype: str  # e.g. "float32"
    kv_tokens: int  # tokens the whole KV cache holds
    peak_bandwidth: float  # the device's roof (bytes/s, FLOP/s): measured at start, or given
    peak_flops: float

    @classmethod
    def of(cls, core: EngineCore) -> ModelInfo:
        engine, cache = core.engine, core.engine.cache
        return cls(
            name=engine.name,
            tokenizer=engine.tokenizer,
            max_model_len=engine.max_model_len,
            capacity=min(engine.max_model_len, cache.num_usable_blocks * cache.block_size),
            vocab_size=engine.hf_config.vocab_size,
            max_waiting=core.config.max_waiting,
            device=str(engine.device)
            if engine.workers is None
            else f"{engine.config.tensor_parallel_size} x {engine.device.type}",
            dtype=str(engine.dtype).removeprefix("torch."),
            kv_tokens=cache.num_usable_blocks * cache.block_size,
            peak_bandwidth=engine.peaks.bandwidth,
            peak_flops=engine.peaks.flops,
        )
