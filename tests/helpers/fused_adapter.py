"""The check of the fused kernels with a MASK-slot adapter merged in (`FusedForward.adapt`)
against the adapter's hooks on the module forward, on the CPU under Triton's interpreter (a
subprocess started with TRITON_INTERPRET=1; on a GPU the runner's adapted graphs are checked
instead, tests/decoders/test_introspective_gpu.py)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from stride.engine import fused
from stride.engine.adapter import MASK_TOKEN
from stride.engine.config import EngineConfig
from stride.engine.engine import Engine
from stride.engine.sequence import SamplingParams, Sequence
from stride.engine.spans import Span, decode_rows
from tests.helpers.adapters import random_adapter
from tests.helpers.models import make_model_dir


def check() -> None:
    """A tail, two proposals and three MASK slots as decode rows after a prefill: on the few-row
    GEMV (each slot's row picking the merged weights) and on the many-rows kernels (each product
    twice), the fused forward's hidden states are the hooks' (fp32, up to rounding), its real
    rows bit for bit the unadapted fused forward's, its slots' rows not."""
    model_dir = make_model_dir(Path(tempfile.mkdtemp()) / "llama", "llama")
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", kv_cache_memory=8 << 20))
    model = engine.model
    adapter = random_adapter(model)
    engine.runner.attach_adapter(adapter)
    fast = fused.FusedForward(model)
    fast.adapt(adapter)
    seq = Sequence("s", [0], SamplingParams())
    prompt = [5, 7, 9, 11, 13]
    engine.cache.reserve(seq, 32)
    engine.runner.forward([Span(seq, prompt[:-1], num_logits=0)])
    seq.num_cached = len(prompt) - 1
    tokens = prompt[-1:] + [21, 22] + [MASK_TOKEN] * 3
    span = Span(seq, tokens, len(tokens))
    meta, ids, positions, _ = decode_rows([span], engine.cache.block_size, "cpu")
    slots = torch.tensor([i for i, t in enumerate(tokens) if t == MASK_TOKEN])
    real = len(tokens) - len(slots)

    def kv() -> tuple[torch.Tensor, torch.Tensor]:
        return engine.cache.k.clone(), engine.cache.v.clone()

    with torch.inference_mode():
        with adapter.on_rows(slots):
            hooked = model(ids.clamp(min=0), positions, kv(), meta)
        for few_rows in (fused.FEW_ROWS, 1):  # the few-row GEMV; the many-rows kernels
            fast.few_rows = few_rows
            adapted = fast(ids, positions, kv(), meta, adapted=True)
            plain = fast(ids.clamp(min=0), positions, kv(), meta)
            torch.testing.assert_close(adapted, hooked, atol=1e-4, rtol=1e-4)
            assert torch.equal(adapted[:real], plain[:real]), few_rows
            assert not torch.allclose(adapted[real:], plain[real:]), few_rows
