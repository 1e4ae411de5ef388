"""Bursts (several plain decode steps in one launch, each step's token fed to the next on the
device) change no output: the same tokens, text, stops and finish reasons as one step at a time,
and the KV cache ends empty. On the CPU each step of a burst is an eager pass; on a GPU they
replay the decode graph back to back with no host sync in between."""

from __future__ import annotations

import pytest
import torch

from stride.decoders.registry import build_decoders
from stride.decoders.speculative import Speculative
from stride.engine.config import EngineConfig
from stride.engine.engine import Engine
from stride.engine.sequence import SamplingParams
from stride.scheduler.core import EngineCore
from stride.scheduler.outputs import GenerateRequest
from stride.scheduler.policy import SchedulerConfig
from tests.helpers.cores import record


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
    # Sampled and seeded: drawn on the device, in bursts like the greedy ones, with a logit
    # bias and penalties too (beside a row whose logprobs are taken with the draw); with a bias
    # and logprobs: its draw needs the host between tokens, so while it runs there are no
    # bursts.
    sampled = SamplingParams(max_tokens=9, temperature=0.8, top_k=20, seed=3, ignore_eos=True)
    reqs.append(GenerateRequest("sampled", [6, 7, 8], sampled))
    unbounded = SamplingParams(max_tokens=7, temperature=1.1, top_p=0.9, seed=4, ignore_eos=True)
    reqs.append(GenerateRequest("top-p", [8, 7], unbounded))
    biased = SamplingParams(max_tokens=8, temperature=0.8, seed=6, logit_bias={9: 2.0, 4: -3.0},
                            presence_penalty=0.7)  # fmt: skip
    reqs.append(GenerateRequest("biased", [6, 9], biased))
    penalized = SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.4,
                               frequency_penalty=0.5)  # fmt: skip
    reqs.append(GenerateRequest("penalized", [9, 6, 9], penalized))
    scored = SamplingParams(max_tokens=8, temperature=0.8, seed=7, logprobs=2)
    reqs.append(GenerateRequest("scored", [7, 9], scored))
    host = SamplingParams(max_tokens=5, temperature=0.8, seed=5, logit_bias={9: 0.0}, logprobs=1)
    reqs.append(GenerateRequest("host", [6, 7, 9], host))
    return reqs


def _core(tiny_dir, device: str, steps: int) -> EngineCore:
    config = EngineConfig(model=str(tiny_dir), device=device, dtype="float32",
                          kv_cache_memory=16 << 20)  # fmt: skip
    return EngineCore(Engine(config), SchedulerConfig(max_num_seqs=12, fused_decode_steps=steps))


def _run(core: EngineCore) -> tuple[dict[str, tuple], list[tuple[int, set[str]]]]:
    """Outputs, and each multi-step launch: its steps and whom it ran."""
    calls = []
    decode_steps = core.engine.runner.decode_steps

    def counting(seqs, tokens, steps, *args, **kwargs):
        calls.append((steps, {s.request_id for s in seqs}))
        return decode_steps(seqs, tokens, steps, *args, **kwargs)

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
            record(results, out)
        step += 1
    cache = core.engine.cache
    assert cache.num_free_blocks == cache.num_usable_blocks
    return results, [c for c in calls if c[0] > 1]  # (1-step launches: see `executor`)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_bursts_change_no_output(tiny_dir, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    single, unfused_calls = _run(_core(tiny_dir, device, steps=1))
    fused, fused_calls = _run(_core(tiny_dir, device, steps=4))
    assert not unfused_calls and fused_calls
    assert fused == single  # seeded draws: the same on the host, and on the device in bursts
    assert any("sampled" in ids for _, ids in fused_calls)
    assert any("top-p" in ids for _, ids in fused_calls)
    assert any({"biased", "scored", "penalized"} <= ids for _, ids in fused_calls)
    assert not any("host" in ids for _, ids in fused_calls)
    assert all(r[2] is not None and r[3] for r in fused.values())  # finished; passes counted
    assert {r[2] for r in fused.values()} >= {"length", "stop"}


def _speculative_run(
    tiny_dir, steps: int, decoder: str, overlap: bool = False
) -> tuple[list[int], list, list, int]:
    """Greedy decoding of a prompt that holds every token id (a probe's n-gram lookup always
    finds a draft): its tokens, the speculative decoder's step count at each burst and at each
    probe's plan, and how many tokens were drafted. `overlap`: bursts stay in flight (see
    `executor`); a burst launched before the one before it committed is counted at the step
    it starts at."""
    config = EngineConfig(model=str(tiny_dir), device="cpu", dtype="float32",
                          kv_cache_memory=16 << 20)  # fmt: skip
    engine = Engine(config)
    decoders = build_decoders(engine)
    # Costs from sizes, not clocks. At a saturation of half a token a scored draft costs about
    # a step: drafts at the prior's acceptance (0.6) do not pay, a probe's (0.9) would.
    spec = decoders["speculative"] = Speculative(engine, saturation_tokens=0.5,
                                                 measure_costs=False)  # fmt: skip
    core = EngineCore(engine, SchedulerConfig(fused_decode_steps=steps), decoders)
    core.executor.overlap = overlap
    fused_at, probes_at = [], []
    decode_steps, plan = engine.runner.decode_steps, spec.policy.plan

    def counting(seqs, tokens, n, sample, offsets=None):
        fused_at.append(spec.policy.seen.steps + seqs[0].pending)  # (launches not committed yet)
        return decode_steps(seqs, tokens, n, sample, offsets)

    def planned(seq, state, batch):
        made = plan(seq, state, batch)
        steps = spec.policy.seen.steps
        if made.probing and steps not in probes_at:  # (planned again in propose)
            probes_at.append(steps)
        return made

    engine.runner.decode_steps, spec.policy.plan = counting, planned
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    options = {"draft": "ngram", "adaptive": True} if decoder == "speculative" else {}
    core.add(GenerateRequest("r", list(range(384)), params, decoder, options))
    tokens, drafted = [], 0
    while core.has_work:
        for out in core.step():
            tokens += out.token_ids
            drafted += (out.decoder_stats or {}).get("draft_tokens", 0)
    return tokens, fused_at, probes_at, drafted


@pytest.mark.parametrize("overlap", [False, True])
def test_quiet_speculative_steps_run_as_bursts_and_probes_stay_on_schedule(tiny_dir, overlap):
    """A speculative request whose drafts do not pay (adaptive K = 0 between probes) runs its
    quiet steps as bursts, as `ar` does, with `ar`'s tokens; its probes draft in the same steps,
    also when bursts stay in flight (the last one before a probe is waited for)."""
    ar = _speculative_run(tiny_dir, 1, "ar")[0]
    single, unfused, probes, drafted = _speculative_run(tiny_dir, 1, "speculative")
    fused, fused_at, fused_probes, fused_drafted = _speculative_run(
        tiny_dir, 4, "speculative", overlap
    )
    assert single == fused == ar
    assert not unfused and len(fused_at) >= 8  # 40 tokens: 4 at a time, a probe every 16 steps
    assert len(probes) >= 2 and fused_probes == probes and fused_drafted == drafted == len(probes)
    assert fused_at[0] < probes[0] < fused_at[-1]  # fused before a probe and after it


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_logprobs_are_taken_in_bursts(tiny_dir, device):
    """Rows asking for logprobs (greedy and seeded sampled) run in bursts too, their logprobs
    taken on the device beside each draw: the same tokens and logprobs as one step at a time,
    where the host takes them."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    params = {
        "greedy": SamplingParams(max_tokens=9, temperature=0.0, logprobs=3, ignore_eos=True),
        "sampled": SamplingParams(max_tokens=11, temperature=0.9, top_k=30, seed=8, logprobs=0,
                                  ignore_eos=True),  # fmt: skip
        "plain": SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
    }
    runs = []
    for steps in (1, 4):
        core = _core(tiny_dir, device, steps)
        launches = []
        decode_steps = core.engine.runner.decode_steps

        def counting(seqs, tokens, n, *args, _launches=launches, _steps=decode_steps, **kw):
            _launches.append((n, {s.request_id for s in seqs}))
            return _steps(seqs, tokens, n, *args, **kw)

        core.engine.runner.decode_steps = counting
        for i, (name, p) in enumerate(params.items()):
            core.add(GenerateRequest(name, [4 + i, 9, 13], p))
        outs: dict[str, list] = {name: [] for name in params}
        while core.has_work:
            for out in core.step():
                outs[out.request_id] += list(zip(out.token_ids, out.logprobs, strict=True))
        runs.append((outs, [ids for n, ids in launches if n > 1]))
    (single, single_bursts), (burst, bursts) = runs
    assert not single_bursts and any({"greedy", "sampled"} <= ids for ids in bursts)
    assert [t for t, _ in burst["plain"]] == [t for t, _ in single["plain"]]
    assert all(lp is None for _, lp in burst["plain"])
    for name in ("greedy", "sampled"):
        assert [t for t, _ in burst[name]] == [t for t, _ in single[name]]
        for (token, got), (_, want) in zip(burst[name], single[name], strict=True):
            assert got.token_id == token and [i for i, _ in got.top] == [i for i, _ in want.top]
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert [v for _, v in got.top] == pytest.approx([v for _, v in want.top], abs=1e-4)
        assert len(burst[name][0][1].top) == params[name].logprobs
