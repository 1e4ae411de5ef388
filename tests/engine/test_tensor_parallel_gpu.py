"""Tensor parallelism on two GPUs (NCCL, fused kernels, CUDA graphs with their collectives
captured, greedy bursts chained on the device): fp32 tokens equal one GPU's. Skipped with fewer
than two GPUs (CI); the lead's `nvidia-h100-x2` runs it."""

from __future__ import annotations

import pytest
import torch

from stride.engine.kernels import decode_attention as attention
from tests.helpers.parallel import generate

pytestmark = pytest.mark.skipif(
    attention.triton is None or torch.cuda.device_count() < 2, reason="needs two GPUs"
)

VARIANTS = ("ar", "ngram", "early_exit", "jacobi", "lookahead", "eagle")


@pytest.mark.parametrize(("arch", "tp", "all_reduce"), [
    ("llama", 2, "auto"), ("llama", 2, "nccl"), ("qwen2", 2, "auto"), ("llama", 4, "auto"),
])  # fmt: skip
def test_split_gpus_match_one(tiny_dirs, eagle_target, eagle_head, arch, tp, all_reduce):
    """Decode-sized all-reduces over peer memory (auto) or NCCL: the same tokens as one GPU."""
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    model = eagle_target if arch == "llama" else tiny_dirs[arch]
    head = {"draft_head": str(eagle_head)} if arch == "llama" else {}
    variants = VARIANTS if head else VARIANTS[:-1]
    one = generate(model, 1, variants, n=24, device="cuda", **head)
    split = generate(model, tp, variants, n=24, device="cuda", all_reduce=all_reduce, **head)
    assert split == one
