"""Finding and loading models: directories, GGUF files, hub ids offline, unsupported kinds."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from stride.engine import gguf_file, loader
from stride.engine.config import EngineConfig
from stride.engine.engine import Engine
from stride.engine.sequence import SamplingParams, Sequence
from stride.engine.spans import Span
from tests.helpers.adapters import random_adapter


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(
        tmp_path
    )
    with pytest.raises(ValueError, match="llama, mistral, qwen2, qwen3"):
        loader.load(str(tmp_path), torch.device("cpu"))


def test_hub_id_offline_gives_a_clear_error():
    with pytest.raises(loader.ModelNotFound, match="offline"):
        loader.resolve("no-such-org/no-such-model")


def test_missing_path_is_not_mistaken_for_a_hub_id(tmp_path):
    with pytest.raises(loader.ModelNotFound, match="neither"):
        loader.resolve(str(tmp_path / "absent"))


def test_gguf_path_is_converted_once_and_cached(default_engine):
    gguf = loader.default_gguf()
    first = loader.resolve(str(gguf))
    assert first == default_engine.path  # the default model is this very file, cached
    assert (first / "tokenizer.json").exists() and (first / gguf_file.GGUF_LINK).resolve() == gguf
    assert not list(first.glob("*.safetensors"))  # the weights stay quantized, in the GGUF
    config = json.loads((first / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert loader.resolve(str(gguf)) == first


def test_conversions_of_one_gguf_at_once_all_succeed(default_engine, tmp_path):
    """A server and a trainer starting on one file together (each converts it on first use)."""
    gguf, out = loader.default_gguf(), tmp_path / "cache" / "model"
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda _: gguf_file.convert(gguf, out), range(3)))
    assert gguf_file.is_gguf_dir(out) and (out / "tokenizer.json").exists()
    assert [p.name for p in out.parent.iterdir()] == ["model"]  # no copy left behind
    gguf_file.convert(gguf, out)  # again over a finished one
    assert gguf_file.is_gguf_dir(out)


def test_gguf_weights_are_transformers_bit_for_bit(default_engine, default_hf):
    """Stride dequantizes the GGUF's blocks itself (torch, at every start); in float32 every
    weight equals what transformers' GGUF loader (gguf's numpy reference) makes of them."""
    ours = default_engine.model.state_dict()
    theirs = default_hf.state_dict()
    assert set(theirs) <= set(ours)
    for name, weight in theirs.items():
        assert ours[name].dtype == torch.float32 and torch.equal(ours[name], weight), name


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q4_0", "Q5_1", "BF16"])
def test_dequantize_is_the_reference_bit_for_bit(kind):
    """Q4_1 and Q8_0 in torch, the other kinds through gguf's own numpy code."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    values = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    blocks = quantize(values, GGMLQuantizationType[kind])
    ours = gguf_file.dequantize(torch.from_numpy(blocks.reshape(-1)), kind, [4, 256])
    assert torch.equal(ours, torch.from_numpy(dequantize(blocks, GGMLQuantizationType[kind])))


def test_dtype_override(tiny_dir):
    engine = Engine(
        EngineConfig(model=str(tiny_dir), device="cpu", dtype="bfloat16", kv_cache_memory=1 << 20)
    )
    assert engine.dtype == torch.bfloat16 and engine.cache.k.dtype == torch.bfloat16


def test_reassembled_shares_the_weights_and_tokenizer_and_nothing_else(tiny_dir):
    """What an engine restarted in its process reuses (`CoreConfig.build(dead)`): the weight
    tensors themselves and the tokenizer, in modules of their own (the old ones' hooks, a
    MASK-slot adapter's, stay behind); it scores what the first engine scored."""
    config = EngineConfig(model=str(tiny_dir), device="cpu", kv_cache_memory=1 << 20)
    engine = Engine(config)
    random_adapter(engine.model).attach(engine.model)
    again = Engine(config, loader.reassembled(engine.loaded))
    old, new = engine.model, again.model
    assert again.tokenizer is engine.tokenizer and new is not old
    for (name, a), (_, b) in zip(old.named_parameters(), new.named_parameters(), strict=True):
        assert a.data_ptr() == b.data_ptr(), name
    assert new.rotary is not old.rotary and torch.equal(new.rotary.inv_freq, old.rotary.inv_freq)
    assert any(m._forward_hooks for m in old.modules())
    assert not any(m._forward_hooks for m in new.modules())
    assert torch.equal(logits(again, [5, 17, 42, 99]), logits(engine, [5, 17, 42, 99]))


def logits(engine: Engine, tokens: list[int]) -> torch.Tensor:
    seq = Sequence("s", [0], SamplingParams())
    engine.cache.reserve(seq, len(tokens))
    return engine.runner.forward([Span(seq, tokens, len(tokens))])[0]


def test_dummy_weights_need_only_the_config_and_tokenizer(tiny_dir, tmp_path):
    """Random weights (`--load-format dummy`): a directory without weights serves random values
    of the model's shapes (norms at one)."""
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_dir / name).read_bytes())
    assert not list(tmp_path.glob("*.safetensors"))
    with pytest.raises(ValueError, match="safetensors"):
        Engine(EngineConfig(model=str(tmp_path), device="cpu", kv_cache_memory=8 << 20))
    engine = Engine(EngineConfig(model=str(tmp_path), device="cpu", kv_cache_memory=8 << 20,
                                 random_weights=True))  # fmt: skip
    real = Engine(EngineConfig(model=str(tiny_dir), device="cpu", kv_cache_memory=8 << 20))
    dummy_params = dict(engine.model.named_parameters())
    for name, param in real.model.named_parameters():
        assert dummy_params[name].shape == param.shape and dummy_params[name].isfinite().all()
        if param.dim() == 2:
            assert not torch.equal(dummy_params[name], param)
