"""Engines split over ranks (tensor parallelism), run greedy to the end: what the CPU and GPU
tensor-parallel tests share."""

from __future__ import annotations

from pathlib import Path

from stride.decoders.registry import DecodersConfig, build_decoders
from stride.engine.config import EngineConfig
from stride.engine.engine import Engine
from stride.scheduler.core import EngineCore
from stride.scheduler.outputs import GenerateRequest
from tests.helpers.cores import PROMPTS, greedy, run
from tests.helpers.eagle import CHAIN, TREE
from tests.helpers.servers import wait_gone

VARIANTS = {
    "ar": ("ar", {}),
    "ngram": ("speculative", {"draft": "ngram", "num_speculative_tokens": 3, "adaptive": False}),
    "early_exit": (
        "speculative",
        {"draft": "early_exit", "exit_layer": 1, "num_speculative_tokens": 3, "adaptive": False},
    ),
    "draft_model": ("speculative", {"num_speculative_tokens": 3, "adaptive": False}),
    "jacobi": ("refine", {"method": "jacobi", "window": 3}),
    "lookahead": ("refine", {"method": "lookahead", "window": 2, "ngram": 3, "candidates": 4}),
    "diffusion": ("refine", {"method": "diffusion", "block_size": 4, "threshold": 0.5}),
    "eagle": ("speculative", CHAIN),
    "eagle_tree": ("speculative", TREE),  # accepted tree paths move K/V: copies on every rank
}


def make_core(
    model: Path | None, tp: int, device: str = "cpu", all_reduce: str = "auto", **decoders
) -> EngineCore:
    engine = Engine(
        EngineConfig(
            model=None if model is None else str(model),
            device=device,
            dtype="float32",
            kv_cache_memory=16 << 20,
            tensor_parallel_size=tp,
            all_reduce=all_reduce,
        )
    )
    try:
        return EngineCore(engine, None, build_decoders(engine, DecodersConfig(**decoders)))
    except BaseException:
        if engine.workers is not None:
            engine.workers.close()
        raise


def requests(variants, prompts, n: int) -> list[GenerateRequest]:
    return [
        GenerateRequest(f"{name}-{i}", prompt, greedy(n), *VARIANTS[name])
        for name in variants
        for i, prompt in enumerate(prompts)
    ]


ONE_DEVICE: dict[tuple, dict[str, list[int]]] = {}  # TP=1 runs, the reference of several tests


def generate(
    model,
    tp: int,
    variants,
    prompts=PROMPTS,
    n: int = 16,
    device: str = "cpu",
    all_reduce: str = "auto",
    **decoders,
):
    """Every prompt with every variant, greedy, on an engine split over `tp` ranks (on GPUs,
    decode-sized all-reduces over peer memory with `all_reduce` "auto", else NCCL)."""
    key = (str(model), tuple(variants), str(prompts), n, device, tuple(sorted(decoders.items())))
    if tp == 1 and key in ONE_DEVICE:
        return ONE_DEVICE[key]
    core = make_core(model, tp, device, all_reduce, **decoders)
    try:
        tokens, _ = run(core, requests(variants, prompts, n))
        if tp > 1:
            assert len(core.engine.workers.pids) == tp - 1
            if device == "cuda":  # (GPUs of one host map each other's memory)
                peer = core.engine.runner.forward_fn.peer
                assert (peer is not None) == (all_reduce == "auto")
        else:
            ONE_DEVICE[key] = tokens
        return tokens
    finally:
        if core.engine.workers is not None:
            pids = set(core.engine.workers.pids)
            core.engine.workers.close()
            wait_gone(pids, timeout=30)
