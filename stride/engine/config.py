"""What an engine is asked to be: its model, device, dtype, KV-cache budget and ranks.

Plain data, read by the engine on rank 0 (`engine`), sent by it to the worker process of every
other rank (`workers`), which builds its share of the model from it (`worker`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    # Ranks the model is split over (one device each; `parallel`): this process is rank 0, and
    # starts a worker process for each other rank. The KV-cache budget is per rank.
    tensor_parallel_size: int = 1
    # How ranks sum decode-sized products on GPUs (`collectives`): auto, over peer memory where
    # the GPUs map each other's; nccl, always NCCL.
    all_reduce: str = "auto"
    random_weights: bool = False  # the checkpoint's shapes with random values (benchmarks)
