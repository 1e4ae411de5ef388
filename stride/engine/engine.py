"""The engine: a loaded model, its KV cache sized from a memory budget, and the runner over both."""

from __future__ import annotations

import logging

import torch

from stride.engine import loader
from stride.engine.config import DTYPES, EngineConfig
from stride.engine.kv_cache import KVCache
from stride.engine.model import CausalLM
from stride.engine.parallel import Layout, agree_min
from stride.engine.roofline import DevicePeaks, ModelShape, device_peaks
from stride.engine.runner import ModelRunner
from stride.engine.workers import MirroredKVCache, MirroredRunner, Workers

log = logging.getLogger(__name__)


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
        world = config.tensor_parallel_size
        self.workers: Workers | None = None
        if world > 1:
            if loaded is not None:
                raise ValueError("a model built beforehand cannot be split over ranks")
            self.workers = Workers.start(config, self.device)
        if loaded is None:
            layout = None
            if self.workers is not None:
                layout = Layout.of(loader.load_config(config.model), world, 0)
            loaded = loader.load(
                config.model, self.device, dtype, config.served_name, layout, config.random_weights
            )
        self.loaded = loaded  # (what a restart in this process reuses: `loader.reassembled`)
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
        whole = self.model
        if world > 1:  # the roofline of every rank together: the whole model, world devices
            with torch.device("meta"):  # (no memory: shapes only)
                whole = CausalLM(self.hf_config).to(self.dtype)
            self.shape = ModelShape.of(whole, self.dtype)
            self.peaks = DevicePeaks(self.peaks.bandwidth * world, self.peaks.flops * world)
        self.num_params = sum(p.numel() for p in whole.parameters())  # every rank's, together
        log.info(
            "device peaks: %.0f GB/s, %.1f TFLOP/s (%s)",
            self.peaks.bandwidth / 1e9,
            self.peaks.flops / 1e12,
            "given" if config.peak_bandwidth and config.peak_flops else "measured",
        )
        key = f"{self.path}:{self.dtype}"  # the root of every block hash
        self.cache = make_cache(config, self.model, self.dtype, self.device, key, self.workers)
        if self.workers is None:
            self.runner = ModelRunner(self.model, self.cache, self.device)
        else:
            self.runner = MirroredRunner(self.workers, self.model, self.cache, self.device,
                                         all_reduce=config.all_reduce)  # fmt: skip

    def whole_vocab(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The whole embedding and LM head of a model split over ranks (what an EAGLE head
        shares with its target), gathered from every rank; None for a model held whole."""
        return None if self.workers is None else self.runner.gather_vocab()


def make_cache(
    config: EngineConfig,
    model: CausalLM,
    dtype: torch.dtype,
    device: torch.device,
    model_key: str,
    workers: Workers | None = None,
    parallel: bool = False,
) -> KVCache:
    """The KV cache for `model`'s layers (a rank's share of the heads under tensor parallelism,
    `parallel`; then every rank takes as many blocks as the tightest one can hold). `workers`:
    rank 0's, which mirror what the cache copies."""
    attn = model.model.layers[0].self_attn
    per_block = KVCache.bytes_per_block(
        model.num_layers, attn.num_kv_heads, attn.head_dim, config.block_size, dtype
    )
    budget = config.kv_cache_memory
    if budget is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * config.gpu_memory_utilization)
        else:
            budget = 1 << 30
    num_blocks = max(2, budget // per_block)
    if workers is not None or parallel:
        num_blocks = agree_min(num_blocks, device)
    log.info("KV cache: %d blocks of %d tokens", num_blocks, config.block_size)
    args = (model.num_layers, attn.num_kv_heads, attn.head_dim, num_blocks, config.block_size)
    caching = config.enable_prefix_caching
    if workers is not None:
        return MirroredKVCache(workers, *args, dtype, device, caching, model_key)
    return KVCache(*args, dtype, device, prefix_caching=caching, model_key=model_key)


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
