"""Finding and loading models: directories, GGUF files, hub ids offline, unsupported kinds."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from stride.engine import loader
from stride.engine.engine import Engine, EngineConfig


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(
        tmp_path
    )
    with pytest.raises(ValueError, match="llama, mistral, qwen2, qwen3"):
        loader.load(str(tmp_path), torch.device("cpu"))


def test_hub_id_offline_gives_a_clear_error():
    with pytest.raises(RuntimeError, match="offline"):
        loader.resolve("no-such-org/no-such-model")


def test_missing_path_is_not_mistaken_for_a_hub_id(tmp_path):
    with pytest.raises(ValueError, match="neither"):
        loader.resolve(str(tmp_path / "absent"))


def test_gguf_path_is_converted_once_and_cached(default_engine):
    gguf = loader.default_gguf()
    first = loader.resolve(str(gguf))
    assert first == default_engine.path  # the default model is this very file, cached
    assert (first / "model.safetensors").exists() and (first / "tokenizer.json").exists()
    assert loader.resolve(str(gguf)) == first


def test_dtype_override(tiny_dir):
    engine = Engine(
        EngineConfig(model=str(tiny_dir), device="cpu", dtype="bfloat16", kv_cache_memory=1 << 20)
    )
    assert engine.dtype == torch.bfloat16 and engine.cache.k.dtype == torch.bfloat16
