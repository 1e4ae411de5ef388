"""The MASK-slot adapter: real rows compute the base model bit for bit, MASK rows compute what
training computes (the same hooks on a transformers model), merged into the fused kernels they
compute what the hooks do, and it saves and loads."""

from __future__ import annotations

import json

import pytest
import torch

from stride.engine.adapter import MASK_TOKEN, AdapterConfig, MaskAdapter
from stride.engine.config import EngineConfig
from stride.engine.engine import Engine
from stride.engine.sequence import SamplingParams, Sequence
from stride.engine.spans import Span
from tests.helpers import interpreter
from tests.helpers.adapters import SLOTS, random_adapter
from tests.helpers.models import load_hf

PROMPT = [100, 101, 102, 103, 104, 105, 106]


def engine_over(model_dir) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), device="cpu", kv_cache_memory=8 << 20))


def score(engine: Engine, tokens: list[int], positions: list[int] | None = None) -> torch.Tensor:
    """Every row's logits for `tokens` scored after nothing (a fresh sequence)."""
    seq = Sequence("s", [0], SamplingParams())
    engine.cache.reserve(seq, len(tokens))
    try:
        return engine.runner.forward([Span(seq, tokens, len(tokens), positions)])[0]
    finally:
        engine.cache.free(seq)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_real_rows_equal_the_base_model_bit_for_bit(tiny_dirs, arch):
    engine = engine_over(tiny_dirs[arch])
    plain = score(engine, PROMPT + [7] * SLOTS)  # before any adapter exists
    engine.runner.attach_adapter(random_adapter(engine.model))
    gated = score(engine, PROMPT + [MASK_TOKEN] * SLOTS)
    n = len(PROMPT)
    assert torch.equal(gated[:n], plain[:n])
    assert not torch.allclose(gated[n:], plain[n:])  # the slots do see the adapter
    # Without slots in the pass the hooks are inert: the whole pass is the base model.
    assert torch.equal(score(engine, PROMPT + [7] * SLOTS), plain)


def test_mask_rows_compute_what_training_computes(tiny_dir):
    """The engine's MASK rows equal a transformers model's with the same adapter hooked in
    (`stride.train.introspective` trains through the latter)."""
    engine = engine_over(tiny_dir)
    adapter = random_adapter(engine.model, seed=1)
    engine.runner.attach_adapter(adapter)
    tokens = PROMPT + [MASK_TOKEN] * SLOTS
    served = score(engine, tokens)
    hf = load_hf(tiny_dir)
    adapter.attach(hf)
    ids = torch.tensor([tokens]).clamp(min=0)
    rows = torch.arange(len(PROMPT), len(tokens))
    with torch.no_grad(), adapter.on_rows(rows):
        trained = hf(ids).logits[0].float()
    torch.testing.assert_close(served, trained, atol=1e-4, rtol=1e-4)


def test_save_and_load_round_trip(tiny_dir, tmp_path):
    engine = engine_over(tiny_dir)
    adapter = random_adapter(engine.model, seed=2)
    adapter.save(tmp_path / "a", dtype=torch.float32)
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["rank"] == 4 and config["slots"] == SLOTS
    loaded = MaskAdapter.load(tmp_path / "a", engine.model)
    assert loaded.config == AdapterConfig.read(tmp_path / "a")
    for (name, a), (_, b) in zip(
        adapter.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    adapter.save(tmp_path / "b")  # the default: bf16, half the bytes
    assert MaskAdapter.load(tmp_path / "b", engine.model).mask_embedding.dtype == torch.float32


def test_an_adapter_for_another_model_is_refused(tiny_dir, eagle_target, tmp_path):
    random_adapter(engine_over(eagle_target).model).save(tmp_path / "deep")
    with pytest.raises(ValueError, match="4 layers"):
        MaskAdapter.load(tmp_path / "deep", engine_over(tiny_dir).model)
    (tmp_path / "deep" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no MASK-slot adapter"):
        MaskAdapter.load(tmp_path / "deep", engine_over(tiny_dir).model)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs them compiled")
def test_the_fused_kernels_run_the_merged_adapter_as_the_hooks_do_under_the_interpreter():
    pytest.importorskip("triton")
    numpy = pytest.importorskip("numpy")
    if numpy.lib.NumpyVersion(numpy.__version__) >= "2.4.0":
        pytest.skip("Triton's interpreter cannot loop to a runtime bound under numpy >= 2.4")
    interpreter.run("from tests.helpers import fused_adapter; fused_adapter.check()", 600)
