"""Launching the next forward before decoding text (the GPU default) changes no output.

On the CPU the forward is synchronous, so `launch_ahead` buys nothing there, but the bookkeeping
is the same: these tests force it on and compare every output with the plain step order.
"""

from __future__ import annotations

import pytest
import torch

from stride.engine.sequence import SamplingParams
from stride.scheduler.outputs import GenerateRequest
from tests.conftest import make_core


def _requests() -> list[GenerateRequest]:
    reqs = []
    for i in range(10):
        params = SamplingParams(
            max_tokens=3 + 2 * i,
            temperature=0.0 if i % 3 else 0.8,
            seed=i,
            ignore_eos=i % 2 == 0,
            stop=["e"] if i == 5 else [],
            logprobs=2 if i == 7 else None,
        )
        reqs.append(GenerateRequest(f"r{i}", [5 + i, 9, 12 + i, 7][: 2 + i % 3], params))
    return reqs


def _run(core, ahead: bool) -> dict[str, tuple]:
    core.launch_ahead = ahead
    reqs = _requests()
    for req in reqs[:6]:
        core.add(req)
    results: dict[str, list] = {}
    step = 0
    while core.has_work or step < 4:
        if step == 2:
            core.abort("r1")  # leaves while a forward for it may be in flight
        if step == 3:
            for req in reqs[6:]:
                core.add(req)  # arrive while everyone decodes
        for out in core.step():
            tokens, text, lps, end = results.setdefault(out.request_id, [[], "", [], None])
            results[out.request_id] = [
                tokens + out.token_ids,
                text + out.text,
                lps
                + [
                    None if lp is None else (lp.token_id, round(lp.logprob, 4))
                    for lp in out.logprobs
                ],
                out.finish_reason,
            ]
        step += 1
    assert core.engine.cache.num_free_blocks == core.engine.cache.num_usable_blocks
    return {k: tuple(map(str, v)) for k, v in results.items()}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_launch_ahead_changes_no_output(tiny_dir, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    core = make_core(tiny_dir, max_num_seqs=8)
    if device == "cuda":
        from stride.engine.engine import Engine, EngineConfig
        from stride.scheduler.core import EngineCore

        engine = Engine(EngineConfig(model=str(tiny_dir), device="cuda", dtype="float32"))
        core = EngineCore(engine)
    assert _run(core, ahead=True) == _run(core, ahead=False)
