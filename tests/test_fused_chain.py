"""Chained fused bursts (`EngineCore._chain`: the next burst launched before the last one is
committed, its first tokens taken on the device) change no output: the same tokens, text and
finish reasons as one step at a time, through stops mid-burst, aborts, arrivals mid-chain,
max_tokens that are no multiple of the burst, and speculative rows at K = 0; the KV cache's
blocks stay accounted for after every step and end free. On the CPU each burst runs eagerly and
synchronously, but the order of launches and commits is the GPU's."""

from __future__ import annotations

import pytest
import torch

from stride.decoders.registry import build_decoders
from stride.decoders.speculative import Speculative
from stride.engine.engine import Engine, EngineConfig
from stride.engine.sequence import SamplingParams
from stride.scheduler.core import EngineCore
from stride.scheduler.outputs import GenerateRequest
from stride.scheduler.policy import SchedulerConfig

ABORTED = "r1"


def _requests() -> list[GenerateRequest]:
    reqs = []
    for i in range(7):
        params = SamplingParams(
            max_tokens=6 + 5 * i,  # mostly no multiple of the burst length (4)
            temperature=0.0,
            ignore_eos=i % 2 == 0,
            stop=["e"] if i == 3 else [],
            stop_token_ids=[7, 11] if i == 4 else [],
        )
        prompt = [5 + i, 9, 12 + i, 7, 30 + i][: 1 + i % 5]
        if i in (2, 5):  # adaptive speculative whose drafts do not pay: K = 0 between probes
            options = {"draft": "ngram", "adaptive": True}
            reqs.append(GenerateRequest(f"r{i}", prompt, params, "speculative", options))
        elif i == 6:  # a fixed K = 0: decodes as `ar` for good
            options = {"num_speculative_tokens": 0}
            reqs.append(GenerateRequest(f"r{i}", prompt, params, "speculative", options))
        else:
            reqs.append(GenerateRequest(f"r{i}", prompt, params))
    return reqs


def _core(tiny_dir, device: str, steps: int, chain: bool) -> EngineCore:
    config = EngineConfig(model=str(tiny_dir), device=device, dtype="float32",
                          kv_cache_memory=16 << 20)  # fmt: skip
    engine = Engine(config)
    decoders = build_decoders(engine)
    # Costs from sizes, not clocks: the same plans in every run.
    decoders["speculative"] = Speculative(engine, saturation_tokens=0.5, measure_costs=False)
    core = EngineCore(engine, SchedulerConfig(max_num_seqs=8, fused_decode_steps=steps), decoders)
    core.chain_fused = chain
    return core


def _check_blocks(core: EngineCore) -> None:
    """Every block is free or held by exactly one running sequence, which holds its cache."""
    cache = core.engine.cache
    held = [b for s in core.scheduler.running for b in s.block_table]
    assert len(set(held)) == len(held)
    assert not set(held) & set(cache._free)
    assert len(held) + cache.num_free_blocks == cache.num_usable_blocks
    for seq in core.scheduler.running:
        assert seq.num_cached <= len(seq.block_table) * cache.block_size


def _run(core: EngineCore) -> tuple[dict[str, tuple], list[bool], int]:
    """Results per request; for each chained launch, whether it came while the burst it
    continues was still uncommitted (one burst in flight); bursts in flight at the abort."""
    in_flight = 0
    chained_while_uncommitted: list[bool] = []
    decode_steps, commit_fused = core.engine.runner.decode_steps, core._commit_fused

    def launching(seqs, tokens, *args, **kwargs):
        nonlocal in_flight
        if isinstance(tokens, torch.Tensor):
            chained_while_uncommitted.append(in_flight == 1)
        in_flight += 1
        return decode_steps(seqs, tokens, *args, **kwargs)

    def committing(*args, **kwargs):
        nonlocal in_flight
        in_flight -= 1
        return commit_fused(*args, **kwargs)

    core.engine.runner.decode_steps, core._commit_fused = launching, committing
    reqs = _requests()
    for req in reqs[:4]:
        core.add(req)
    results: dict[str, tuple] = {}
    step = 0
    while core.has_work or step < 6:
        outs = []
        if step == 2:
            aborted_in_flight = in_flight
            outs.append(core.abort(ABORTED))  # leaves between steps, a burst for it in flight
        if step == 5:
            for req in reqs[4:]:
                core.add(req)  # arrive while a chain runs
        for out in outs + core.step():
            tokens, text, _, _ = results.get(out.request_id, ((), "", None, None))
            stats = out.decoder_stats
            results[out.request_id] = (
                tokens + tuple(out.token_ids),
                text + out.text,
                out.finish_reason,
                stats and stats["forward_passes"] >= len(tokens) + len(out.token_ids),
            )
        _check_blocks(core)
        step += 1
    cache = core.engine.cache
    assert cache.num_free_blocks == cache.num_usable_blocks
    return results, chained_while_uncommitted, aborted_in_flight


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_chained_bursts_change_no_output(tiny_dir, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    single, single_chained, _ = _run(_core(tiny_dir, device, steps=1, chain=True))
    chained, chained_launches, aborted_in_flight = _run(_core(tiny_dir, device, 4, chain=True))
    assert not single_chained
    assert len(chained_launches) >= 4 and all(chained_launches) and aborted_in_flight == 1

    # The aborted request stopped at a different point in each run: one output extends the other.
    short, long = sorted((single.pop(ABORTED), chained.pop(ABORTED)), key=lambda r: len(r[0]))
    assert short[2] == long[2] == "abort"
    assert long[0][: len(short[0])] == short[0] and long[1].startswith(short[1])
    assert chained == single
    assert all(r[2] is not None and r[3] for r in chained.values())  # finished; passes counted
    assert {r[2] for r in chained.values()} >= {"length", "stop"}


def test_chained_bursts_match_unchained_ones(tiny_dir):
    """The same bursts, chained or not: the same tokens and the same number of tokens per
    launch (a chain ends where unchained fused steps would stop fusing)."""
    runs = []
    for chain in (False, True):
        core = _core(tiny_dir, "cpu", steps=4, chain=chain)
        bursts: list[int] = []
        decode_steps = core.engine.runner.decode_steps

        def counting(seqs, tokens, steps, *args, _d=decode_steps, _b=bursts, **kwargs):
            _b.append(steps)
            return _d(seqs, tokens, steps, *args, **kwargs)

        core.engine.runner.decode_steps = counting
        params = SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True)
        for i in range(3):
            core.add(GenerateRequest(f"r{i}", [5 + i, 9, 12], params))
        tokens: dict[str, list[int]] = {}
        while core.has_work:
            for out in core.step():
                tokens.setdefault(out.request_id, []).extend(out.token_ids)
        runs.append((tokens, bursts))
    assert runs[0] == runs[1]
    assert sum(runs[0][1]) == 22  # the first token comes from the prefill
