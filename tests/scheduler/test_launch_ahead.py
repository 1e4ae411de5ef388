"""Launching the next forward before decoding text (the GPU default) changes no output.

On the CPU the forward is synchronous, so `launch_ahead` buys nothing there, but the bookkeeping
is the same: these tests force it on and compare every output with the plain step order.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stride.decoders.registry import DecodersConfig, build_decoders
from stride.decoders.speculative import Speculative
from stride.engine.config import EngineConfig
from stride.engine.engine import Engine
from stride.engine.sequence import SamplingParams
from stride.scheduler.core import EngineCore
from stride.scheduler.outputs import GenerateRequest
from stride.scheduler.policy import SchedulerConfig
from tests.helpers.cores import make_core
from tests.helpers.models import make_model_dir


def _requests(spec: dict | None = None, sampled: bool = True) -> list[GenerateRequest]:
    """Ten requests; with `spec`, every other one decodes speculatively with those options."""
    reqs = []
    for i in range(10):
        params = SamplingParams(
            max_tokens=3 + 2 * i,
            temperature=0.0 if i % 3 or not sampled else 0.8,
            seed=i,
            ignore_eos=i % 2 == 0,
            stop=["e"] if i == 5 else [],
            logprobs=2 if i == 7 else None,
        )
        prompt = [5 + i, 9, 12 + i, 7, 5 + i, 9][: 2 + i % 5]
        if spec is not None and i % 2 == 0:
            reqs.append(GenerateRequest(f"r{i}", prompt, params, "speculative", dict(spec)))
        else:
            reqs.append(GenerateRequest(f"r{i}", prompt, params))
    return reqs


def _run(core, ahead: bool, reqs: list[GenerateRequest] | None = None) -> dict[str, tuple]:
    core.executor.launch_ahead = ahead
    reqs = reqs or _requests()
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
        from stride.engine.config import EngineConfig
        from stride.engine.engine import Engine
        from stride.scheduler.core import EngineCore

        engine = Engine(EngineConfig(model=str(tiny_dir), device="cuda", dtype="float32"))
        core = EngineCore(engine)
    assert _run(core, ahead=True) == _run(core, ahead=False)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("draft") / "other", seed=1)


def _spec_core(model: Path, draft: Path, measure_costs: bool) -> EngineCore:
    engine = Engine(EngineConfig(model=str(model), device="cpu", kv_cache_memory=16 << 20))
    decoders = build_decoders(engine, DecodersConfig(draft_model=str(draft)))
    if not measure_costs:  # K from sizes and acceptance only: the same in every run
        decoders["speculative"] = Speculative(
            engine, str(draft), saturation_tokens=1e9, measure_costs=False
        )
    return EngineCore(engine, SchedulerConfig(max_num_seqs=8), decoders)


@pytest.mark.parametrize("adaptive", ["off", "on", "measured"])
@pytest.mark.parametrize("draft", ["ngram", "early_exit", "model"])
def test_launch_ahead_changes_no_speculative_output(tiny_dir, draft_dir, draft, adaptive):
    """Speculative sequences mixed with plain ones: launch-ahead changes no token.

    "measured" times steps, so K (and with it a sampled request's draws) varies from run to
    run: there all requests are greedy, whose output does not depend on K.
    """
    measured = adaptive == "measured"
    results = []
    for ahead in (True, False):
        core = _spec_core(tiny_dir, draft_dir, measure_costs=measured)
        name = core.decoders["speculative"].draft_model.name if draft == "model" else draft
        spec = {"draft": name, "num_speculative_tokens": 3, "adaptive": adaptive != "off"}
        if draft == "early_exit":
            spec["exit_layer"] = 1
        results.append(_run(core, ahead, _requests(spec, sampled=not measured)))
    assert results[0] == results[1]
