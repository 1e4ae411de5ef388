"""Shared fixtures: tiny random models on disk, engines over them, the real default model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stride.engine.engine import Engine, EngineConfig
from stride.scheduler.core import EngineCore
from stride.scheduler.policy import SchedulerConfig
from tests.tiny import load_hf, make_model_dir

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


def make_core(model_dir: Path | str | None, kv_bytes: int = 16 << 20, **sched) -> EngineCore:
    engine = Engine(
        EngineConfig(
            model=None if model_dir is None else str(model_dir),
            device="cpu",
            kv_cache_memory=kv_bytes,
        )
    )
    return EngineCore(engine, SchedulerConfig(**sched))


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
def default_server():
    """A live server of the default model on loopback, shared by the modules that use one."""
    from stride.server.app import ServerConfig
    from tests.server_harness import LiveServer

    live = LiveServer(ServerConfig(engine=EngineConfig(device="cpu", kv_cache_memory=256 << 20)))
    yield live
    live.stop()
