"""Fused decode steps (several greedy decode steps in one engine step, each step's token fed to the
next on the device) change no output: the same tokens, text, stops and finish reasons as one step
at a time, and the KV cache ends empty. On the CPU each fused step is an eager pass; on a GPU they
replay the decode graph back to back with no host sync in between."""

from __future__ import annotations

import pytest
import torch

from stride.engine.engine import Engine, EngineConfig
from stride.engine.sequence import SamplingParams
from stride.scheduler.core import EngineCore
from stride.scheduler.outputs import GenerateRequest
from stride.scheduler.policy import SchedulerConfig


def _requests() -> list[GenerateRequest]:
    reqs = []
    for i in range(6):
        params = SamplingParams(
            max_tokens=3 + 5 * i,
            temperature=0.0,
            ignore_eos=i % 2 == 0,
            stop=["e"] if i == 3 else [],
            stop_token_ids=[7, 11] if i == 4 else [],
        )
        reqs.append(GenerateRequest(f"r{i}", [5 + i, 9, 12 + i, 7][: 1 + i % 4], params))
    # Sampled: while it runs, steps are not fused (its draw needs the host between tokens).
    sampled = SamplingParams(max_tokens=5, temperature=0.8, seed=3, ignore_eos=True)
    reqs.append(GenerateRequest("sampled", [6, 7, 8], sampled))
    return reqs


def _core(tiny_dir, device: str, steps: int) -> EngineCore:
    config = EngineConfig(model=str(tiny_dir), device=device, dtype="float32",
                          kv_cache_memory=16 << 20)  # fmt: skip
    return EngineCore(Engine(config), SchedulerConfig(max_num_seqs=8, fused_decode_steps=steps))


def _run(core: EngineCore) -> tuple[dict[str, tuple], int]:
    calls = []
    decode_steps = core.engine.runner.decode_steps

    def counting(chunks, steps, sample):
        calls.append(steps)
        return decode_steps(chunks, steps, sample)

    core.engine.runner.decode_steps = counting
    reqs = _requests()
    for req in reqs[:4]:
        core.add(req)
    results: dict[str, tuple] = {}
    step = 0
    while core.has_work or step < 6:
        if step == 5:
            for req in reqs[4:]:
                core.add(req)  # arrive while others decode
        for out in core.step():
            tokens, text, _, _ = results.get(out.request_id, ((), "", None, None))
            stats = out.decoder_stats
            results[out.request_id] = (
                tokens + tuple(out.token_ids),
                text + out.text,
                out.finish_reason,
                stats and stats["forward_passes"] >= len(tokens) + len(out.token_ids),
            )
        step += 1
    cache = core.engine.cache
    assert cache.num_free_blocks == cache.num_usable_blocks
    return results, len(calls)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fused_decode_steps_change_no_output(tiny_dir, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    single, unfused_calls = _run(_core(tiny_dir, device, steps=1))
    fused, fused_calls = _run(_core(tiny_dir, device, steps=4))
    assert unfused_calls == 0 and fused_calls > 0
    assert fused == single
    assert all(r[2] is not None and r[3] for r in fused.values())  # finished; passes counted
    assert {r[2] for r in fused.values()} >= {"length", "stop"}
