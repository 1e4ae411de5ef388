"""Shared fixtures: tiny random models on disk, engines over them, the real default model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stride.engine.config import EngineConfig
from stride.engine.engine import Engine
from stride.scheduler.outputs import GenerateRequest
from tests.helpers.cores import PROMPTS, greedy, run
from tests.helpers.eagle import eagle_core, random_head
from tests.helpers.models import load_hf, make_model_dir

# One thread: tiny models gain nothing from more, and on a shared 2-core box the pytest process,
# the servers tests spawn (OMP_NUM_THREADS=1) and others' tests contend; an OpenMP team waiting
# for a descheduled member (spin-waits) made steps 10x slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """One tiny random model per supported architecture, written once per session."""
    root = tmp_path_factory.mktemp("models")
    return {
        arch: make_model_dir(root / arch, arch) for arch in ("llama", "qwen2", "qwen3", "mistral")
    }


@pytest.fixture(scope="session")
def tiny_dir(tiny_dirs) -> Path:
    return tiny_dirs["llama"]


@pytest.fixture(scope="session")
def tiny_hf(tiny_dir):
    return load_hf(tiny_dir)


@pytest.fixture(scope="session")
def default_engine() -> Engine:
    """The real SmolLM2-135M-Instruct (its tokenizer converted once into STRIDE_CACHE)."""
    return Engine(EngineConfig(device="cpu", kv_cache_memory=256 << 20))


@pytest.fixture(scope="session")
def default_hf(default_engine):
    """transformers' own float32 load of the default model's GGUF file (its dequantizer, not
    Stride's): the reference the default model's weights and outputs must equal exactly."""
    from transformers import AutoModelForCausalLM

    from stride.engine.gguf_file import transformers_kwargs

    path = default_engine.path
    return AutoModelForCausalLM.from_pretrained(
        path, **transformers_kwargs(path), dtype=torch.float32
    )


@pytest.fixture(scope="session")
def eagle_target(tmp_path_factory) -> Path:
    """A tiny target deep enough for EAGLE-3's low, middle and high layers."""
    return make_model_dir(tmp_path_factory.mktemp("eagle") / "target", layers=4)


@pytest.fixture(scope="session")
def eagle_head(eagle_target, tmp_path_factory) -> Path:
    return random_head(eagle_target, tmp_path_factory.mktemp("eagle") / "head")


@pytest.fixture(scope="session")
def eagle_ref(eagle_target) -> dict[int, list[int]]:
    """Plain greedy decoding of every prompt on the EAGLE target, one request at a time."""
    out = {}
    for i, prompt in enumerate(PROMPTS + [list(range(30, 90))]):
        core = eagle_core(eagle_target, None)
        tokens, _ = run(core, [GenerateRequest("r", prompt, greedy(24))])
        out[i] = tokens["r"]
    return out


@pytest.fixture(scope="session")
def default_server():
    """A live server of the default model on loopback, shared by the modules that use one."""
    from stride.server.app import ServerConfig
    from tests.helpers.servers import LiveServer

    live = LiveServer(ServerConfig(engine=EngineConfig(device="cpu", kv_cache_memory=256 << 20)))
    yield live
    live.stop()
