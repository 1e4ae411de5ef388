"""The engine: a loaded model, its KV cache sized from a memory budget, and the runner over both."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from stride.engine import loader
from stride.engine.kv_cache import KVCache
from stride.engine.roofline import ModelShape, device_peaks
from stride.engine.runner import ModelRunner

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    model: str | None = None  # None: the embedded default model
    served_name: str | None = None
    device: str = "auto"  # auto: cuda if available, else cpu
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    kv_cache_memory: int | None = None  # bytes; None: a share of free GPU memory / 1 GiB on CPU
    gpu_memory_utilization: float = 0.85
    block_size: int = 16
    max_model_len: int | None = None
    enable_prefix_caching: bool = True  # reuse the K/V of prompts' shared leading blocks
    # The device's roof (see `roofline`); None: measured when the engine starts.
    peak_bandwidth: float | None = None  # bytes/s, read plus written
    peak_flops: float | None = None  # FLOP/s in the engine's dtype


class Engine:
    def __init__(self, config: EngineConfig, loaded: loader.LoadedModel | None = None) -> None:
        """`loaded`: a model built already (benchmarks build random weights of real shapes);
        else `config.model` is loaded."""
        self.config = config
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu")
            if config.device == "auto"
            else config.device
        )
        dtype = None if config.dtype == "auto" else DTYPES[config.dtype]
        if loaded is None:
            loaded = loader.load(config.model, self.device, dtype, config.served_name)
        self.name = loaded.name
        self.path = loaded.path
        self.hf_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model = loaded.model
        self.dtype = next(self.model.parameters()).dtype
        self.max_model_len = min(
            config.max_model_len or 1 << 30,
            getattr(self.hf_config, "max_position_embeddings", None) or 1 << 30,
        )
        self.eos_ids = _eos_ids(loaded)
        self.shape = ModelShape.of(self.model, self.dtype)
        self.peaks = device_peaks(self.device, self.dtype, config.peak_bandwidth, config.peak_flops)
        log.info(
            "device peaks: %.0f GB/s, %.1f TFLOP/s (%s)",
            self.peaks.bandwidth / 1e9,
            self.peaks.flops / 1e12,
            "given" if config.peak_bandwidth and config.peak_flops else "measured",
        )
        self.cache = self._make_cache()  # after the measurement: it takes the free memory
        self.runner = ModelRunner(self.model, self.cache, self.device)

    def _make_cache(self) -> KVCache:
        attn = self.model.model.layers[0].self_attn
        per_block = KVCache.bytes_per_block(
            self.model.num_layers,
            attn.num_kv_heads,
            attn.head_dim,
            self.config.block_size,
            self.dtype,
        )
        budget = self.config.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * self.config.gpu_memory_utilization)
            else:
                budget = 1 << 30
        num_blocks = max(2, budget // per_block)
        log.info("KV cache: %d blocks of %d tokens", num_blocks, self.config.block_size)
        return KVCache(
            self.model.num_layers,
            attn.num_kv_heads,
            attn.head_dim,
            num_blocks,
            self.config.block_size,
            self.dtype,
            self.device,
            prefix_caching=self.config.enable_prefix_caching,
            model_key=f"{self.path}:{self.dtype}",
        )


def _eos_ids(loaded: loader.LoadedModel) -> set[int]:
    ids: set[int] = set()
    for source in (loaded.config.eos_token_id, loaded.tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    gen = loaded.path / "generation_config.json"
    if gen.exists():
        import json

        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else eos or [])
    return ids
