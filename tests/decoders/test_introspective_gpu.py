"""Introspective refinement on the GPU: its passes replay graphs of their own, the adapter merged
into the fused kernels for the MASK slots' rows, beside plain rows on the plain graphs; they
score what the adapter's hooks on the module forward score and decode exactly what plain
decoding does in fp32; in bf16 the adapter still leaves real rows bit for bit alone."""

from __future__ import annotations

import pytest
import torch

from stride.engine import fused
from stride.engine.adapter import MASK_TOKEN
from stride.engine.config import EngineConfig
from stride.engine.engine import Engine
from stride.engine.sequence import SamplingParams, Sequence
from stride.engine.spans import Span, prepare
from stride.scheduler.core import EngineCore
from stride.scheduler.outputs import GenerateRequest
from tests.helpers.adapters import SLOTS, pass_spans, random_adapter
from tests.helpers.cores import PROMPTS, greedy, run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
INTRO = {"method": "introspective", "slots": SLOTS}  # every step a pass: not adaptive


def cuda_core(model_dir, dtype: str) -> EngineCore:
    from stride.decoders.autoregressive import Autoregressive
    from stride.decoders.refine import Refine

    engine = Engine(
        EngineConfig(model=str(model_dir), device="cuda", dtype=dtype, kv_cache_memory=64 << 20)
    )
    adapter = random_adapter(engine.model).to("cuda", engine.dtype)
    engine.runner.attach_adapter(adapter)
    return EngineCore(engine, decoders={"ar": Autoregressive(), "refine": Refine(adapter=adapter)})


def test_greedy_equals_plain_decoding_on_the_gpu(tiny_dir):
    core = cuda_core(tiny_dir, "float32")
    assert core.engine.runner.graphs is not None  # plain rows replay graphs beside the slots
    ref = {}
    for i, prompt in enumerate(PROMPTS):
        tokens, _ = run(core, [GenerateRequest("r", prompt, greedy(24))])
        ref[i] = tokens["r"]
        tokens, stats = run(core, [GenerateRequest("i", prompt, greedy(24), "refine", INTRO)])
        assert tokens["i"] == ref[i], i
        assert stats["i"]["draft_tokens"] > 0
    batch = [GenerateRequest(f"a{i}", p, greedy(24)) for i, p in enumerate(PROMPTS)]
    batch += [GenerateRequest(f"i{i}", p, greedy(24), "refine", INTRO)
              for i, p in enumerate(PROMPTS)]  # fmt: skip
    tokens, _ = run(core, batch)
    for i in range(len(PROMPTS)):
        assert tokens[f"a{i}"] == tokens[f"i{i}"] == ref[i]


@pytest.mark.parametrize("few_rows", [0, 64], ids=["many-rows", "few-row-gemv"])
def test_slot_spans_replay_what_the_hooks_score(tiny_dir, monkeypatch, few_rows):
    """A pass's spans (slots under a mask, slots plainly causal, a masked span without slots
    beside them) through the graphs, the slots' spans on the adapted ones, against decode rows
    of the module forward with the adapter's hooks: the same logits in fp32, every row, on the
    many-rows kernels and on the few-row GEMV (the rows' count picks one; here the test does)."""
    monkeypatch.setattr(fused, "ADAPTED_FEW_ROWS", few_rows)
    core = cuda_core(tiny_dir, "float32")
    runner = core.engine.runner
    assert runner.graphs.adapted
    spans = pass_spans(core)
    assert all(runner._graphable(c) for c in spans)
    graphed = runner.forward(spans)
    hooked = runner._forward_rows(spans)
    for a, b in zip(graphed, hooked, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_real_rows_are_untouched_in_bf16(tiny_dir):
    """The module forward in bf16 with and without the adapter on the slots' rows: the real
    rows' hidden states are the same bits (the same kernels over the same batch)."""
    core = cuda_core(tiny_dir, "bfloat16")
    engine = core.engine
    adapter = engine.runner.adapter
    prompt, slots = PROMPTS[2], 3
    seq = Sequence("s", [0], SamplingParams())
    tokens = prompt + [MASK_TOKEN] * slots
    engine.cache.reserve(seq, len(tokens))
    meta, packed, positions, _ = prepare([Span(seq, tokens, 1)], engine.cache.block_size, "cuda")
    rows = torch.arange(len(prompt), len(tokens), device="cuda")
    with torch.inference_mode():
        kv = (engine.cache.k.clone(), engine.cache.v.clone())
        plain = engine.model(packed.clamp(min=0), positions, kv, meta)
        kv = (engine.cache.k.clone(), engine.cache.v.clone())
        with adapter.on_rows(rows):
            gated = engine.model(packed.clamp(min=0), positions, kv, meta)
    engine.cache.free(seq)
    n = len(prompt)
    assert torch.equal(gated[:n], plain[:n]) and not torch.equal(gated[n:], plain[n:])
