"""The device loop's choice for adaptive EAGLE requests (`loop_policy`): from measured rates,
plain decoding unless a shape pays, every candidate tried, retried ever less often while it
loses (a few cycles a try); and requests
under it decode exactly what `ar` does, drafting only in the loop (run eagerly on the CPU)."""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from stride.decoders.rates import MIN_GAIN, bucket
from stride.decoders.speculative.device_tree import TreeShape
from stride.decoders.speculative.eagle import keep_recent
from stride.decoders.speculative.loop_policy import DEFAULT_TREE, Choice, LoopPolicy, Spent, menu
from stride.engine.sequence import SamplingParams
from stride.scheduler.outputs import GenerateRequest
from tests.helpers.cores import PROMPTS, alone_then_together, greedy, run
from tests.helpers.eagle import eagle_core, free, record_bursts

CHAIN, TREE = TreeShape.chain(4), TreeShape.of(32, 4, 4)
SHAPES = (CHAIN, TREE)
TRY, BURST = LoopPolicy.TRY_CYCLES, 8  # the cycles of a try, and of the chosen shape's bursts


def took(seconds: float) -> Spent:
    """A burst in a row whose wall time was all its cycles' device time."""
    return Spent(seconds, seconds, in_a_row=True)


def test_menus_follow_the_requests_tree_options():
    options = {"num_speculative_tokens": 4, "tree_nodes": None, "tree_topk": 8}
    assert menu(options) == (CHAIN, DEFAULT_TREE)
    assert menu({**options, "tree_nodes": 0}) == (CHAIN,)
    assert menu({**options, "tree_nodes": 32, "tree_topk": 4}) == (CHAIN, TREE)


def test_plain_first_then_each_shape_then_the_fastest():
    loop = LoopPolicy(max_batch=8, max_cycles=BURST)
    assert loop.choose(1, SHAPES, None, 0) is None  # plain decoding not timed yet
    assert loop.choose(1, SHAPES, 1e-3, 4) == Choice(CHAIN, TRY)  # untried: tried in order
    loop.measured(1, CHAIN, 4, took(4 * 2e-3), 4 * 3, 4)  # 1,500 tok/s against 1,000 plain
    assert loop.choose(1, SHAPES, 1e-3, 8) == Choice(TREE, TRY)
    loop.measured(1, TREE, 4, took(4 * 3e-3), 4 * 6, 8)  # 2,000 tok/s
    assert loop.choose(1, SHAPES, 1e-3, 12) == Choice(TREE, BURST)
    assert loop.choose(8, SHAPES, 1e-3, 12) == Choice(CHAIN, TRY)  # a bucket measures its own


def test_plain_unless_a_shape_beats_it_by_the_margin():
    loop = LoopPolicy(max_batch=8, max_cycles=BURST)
    plain_s = 1e-3  # 8 sequences: 8,000 tok/s
    loop.measured(8, CHAIN, 8, took(8 * 2e-3), 8 * 8 * 2 * MIN_GAIN * 0.99, 0)
    loop.measured(8, TREE, 8, took(8 * 4e-3), 8 * 8 * 3, 0)  # 6,000 tok/s
    assert loop.choose(8, SHAPES, plain_s, 10) is None
    assert loop.plain_steps(8, SHAPES, 10) == LoopPolicy.RETRY_EVERY - 10
    assert loop.plain_steps(9, SHAPES, 10) == LoopPolicy.RETRY_EVERY  # past the loop


def test_a_burst_after_plain_steps_is_priced_without_its_switch():
    """A burst after plain steps carries the head's catch-up over the tokens decoded plainly
    meanwhile, which bursts in a row do not pay: it is priced at its cycles' device time and the
    host's share that bursts in a row showed at its bucket, not at its wall time."""
    loop = LoopPolicy(max_batch=8, max_cycles=BURST)
    # A try after plain steps: 4 cycles of 1 ms on the device, 10 ms of wall time with the switch.
    loop.measured(8, CHAIN, TRY, Spent(10e-3, TRY * 1e-3, in_a_row=False), 8 * TRY * 2, 0)
    assert loop.rates[(3, CHAIN)].seconds == pytest.approx(1e-3)  # (no host share known yet)
    # Bursts in a row: 8 cycles of 1 ms on the device in 10 ms of wall time, a host share of 1/4.
    for step in range(1, 30):
        loop.measured(8, TREE, BURST, Spent(10e-3, BURST * 1e-3, in_a_row=True), 8 * 16, step)
    assert loop.rates[(3, TREE)].seconds == pytest.approx(1.25e-3, rel=1e-3)
    assert loop.host_share[3] == pytest.approx(0.25, rel=1e-3)
    loop.measured(8, CHAIN, TRY, Spent(10e-3, TRY * 1e-3, in_a_row=False), 8 * TRY * 2, 30)
    chain = loop.rates[(3, CHAIN)].seconds
    assert 1e-3 < chain < 1.25e-3  # moving towards 1.25 ms, nowhere near the try's 2.5 ms


def test_a_candidate_not_chosen_is_retried_and_its_rate_follows():
    loop = LoopPolicy(max_batch=8, max_cycles=BURST)
    loop.measured(1, CHAIN, 8, took(8 * 1e-3), 8 * 3, 0)  # 3,000 tok/s
    loop.measured(1, TREE, 8, took(8 * 4e-3), 8 * 4, 0)  # 1,000
    step = 0
    for step in range(8, LoopPolicy.RETRY_EVERY, 8):
        assert loop.choose(1, SHAPES, 1e-3, step) == Choice(CHAIN, BURST)
        loop.measured(1, CHAIN, 8, took(8 * 1e-3), 8 * 3, step)
    assert loop.choose(1, SHAPES, 1e-3, step + 8) == Choice(TREE, TRY)  # due again
    for _ in range(12):  # its cycles got cheaper: it wins once its average follows
        loop.measured(1, TREE, 8, took(8 * 1e-3), 8 * 4, step + 8)
    assert loop.choose(1, SHAPES, 1e-3, step + 16) == Choice(TREE, BURST)


def test_a_candidate_that_keeps_losing_is_retried_ever_less_often():
    loop = LoopPolicy(max_batch=8, max_cycles=BURST)
    plain_s = 1e-3  # 1,000 tok/s; neither shape pays
    loop.measured(1, CHAIN, TRY, took(TRY * 2e-3), TRY * 1, 0)
    loop.measured(1, TREE, TRY, took(TRY * 4e-3), TRY * 2, 0)
    tries: dict[TreeShape, list[int]] = {CHAIN: [0], TREE: [0]}
    for step in range(1, 4000):
        choice = loop.choose(1, SHAPES, plain_s, step)
        if choice is not None:
            assert choice.cycles == TRY
            tries[choice.shape].append(step)
            loop.measured(1, choice.shape, TRY, took(TRY * 4e-3), TRY * 2, step)  # it loses again
        assert loop.plain_steps(1, SHAPES, step) >= 1
    for steps in tries.values():
        gaps = [b - a for a, b in zip(steps, steps[1:], strict=False)]
        assert gaps[0] - LoopPolicy.RETRY_EVERY in (0, 1)  # (one try a step: one waits a step)
        assert gaps[1:5] == [128, 256, 512, 1024] and set(gaps[5:]) == {LoopPolicy.MAX_WAIT}


def test_adaptive_eagle_requests_draft_only_in_the_loop_and_decode_exactly(
    eagle_target, eagle_head
):
    prompts = PROMPTS[:3]
    plain = [GenerateRequest(str(i), p, greedy(40)) for i, p in enumerate(prompts)]
    ref, _ = run(eagle_core(eagle_target, None), plain)
    core = eagle_core(eagle_target, eagle_head, fused_decode_steps=4)
    spec = core.decoders["speculative"]
    spec.device_loop = True  # (the loop, run eagerly: what a GPU runs as graphs)
    ran, hosted = record_bursts(core), []
    real_draft = spec.eagle.draft
    spec.eagle.draft = lambda *a: hosted.append(a) or real_draft(*a)
    options = {"draft": "eagle", "num_speculative_tokens": 3}
    alone, together = alone_then_together(core, prompts, greedy(40), "speculative", options)
    assert alone == ref
    assert together == ref
    assert not hosted  # no step drafted on the host
    shapes = {shape for _, shape, _ in ran}
    assert shapes <= {TreeShape.chain(3), DEFAULT_TREE} and shapes
    assert spec.loop.rates  # the loop measured its bursts
    assert free(core)


def arrivals(core, params: SamplingParams, options: dict) -> dict[str, list[int]]:
    """Two requests, the second arriving while the first decodes: their tokens."""
    out: dict[str, list[int]] = {}
    for i, prompt in enumerate(PROMPTS[:2]):
        core.add(GenerateRequest(str(i), prompt, replace(params, seed=i), "speculative", options))
        for _ in range(3 if i == 0 else 10**4):
            for o in core.step() if core.has_work else ():
                out.setdefault(o.request_id, []).extend(o.token_ids)
    return out


@pytest.mark.parametrize("bursts", [True, False], ids=["bursts", "no bursts"])
def test_fixed_k_requests_draft_in_bursts_only_where_bursts_run(eagle_target, eagle_head, bursts):
    """Where the loop's bursts run, a greedy request of a fixed K drafts in them only: the step
    beside another request's prefill, which cannot be a burst, decodes it plainly (on a GPU a
    step drafted on the host costs several cycles). Without bursts it drafts on the host. Its
    tokens are `ar`'s either way. A sampled chain drafts at every step (its accepted drafts are
    the head's draws), so its tokens are those of the host path, seed for seed."""
    options = {"draft": "eagle", "num_speculative_tokens": 3, "adaptive": False}
    plain = [GenerateRequest(str(i), p, greedy(40)) for i, p in enumerate(PROMPTS[:2])]
    ref, _ = run(eagle_core(eagle_target, None), plain)
    sampled = SamplingParams(max_tokens=40, temperature=0.8, ignore_eos=True)
    host = arrivals(eagle_core(eagle_target, eagle_head), sampled, options)
    for params, stepwise in ((greedy(40), bursts), (sampled, False)):
        core = eagle_core(eagle_target, eagle_head, fused_decode_steps=4 if bursts else 1)
        spec = core.decoders["speculative"]
        spec.device_loop = True
        ran, hosted = record_bursts(core), []
        real_draft = spec.eagle.draft
        spec.eagle.draft = lambda *a, d=real_draft, h=hosted: h.append(a) or d(*a)
        out = arrivals(core, params, options)
        assert out == (ref if params.greedy else host)
        assert bool(ran) == bursts and bool(hosted) != stepwise
        assert free(core)


def test_requests_the_loop_cannot_run_decode_plainly_in_full_bursts(eagle_target, eagle_head):
    """Rows the device loop cannot run (it hands back nothing but tokens), here ones with
    logprobs, greedy and sampled: their plain steps come as the executor's bursts, as `ar`'s
    do, not one step at a time waiting for a loop try that cannot start; the tokens are `ar`'s,
    seed for seed."""
    options = {"draft": "eagle", "num_speculative_tokens": 3}
    sampled = SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True, logprobs=2)
    logprobs = replace(greedy(24), logprobs=2)
    for params in (sampled, logprobs):
        core = eagle_core(eagle_target, eagle_head, fused_decode_steps=4)
        spec = core.decoders["speculative"]
        spec.device_loop = True
        ran = record_bursts(core)
        ref, _ = run(core, [GenerateRequest(str(i), p, params) for i, p in enumerate(PROMPTS[:2])])
        steps = count_steps(core)
        reqs = [GenerateRequest(str(i), p, params, "speculative", options)
                for i, p in enumerate(PROMPTS[:2])]  # fmt: skip
        out, _ = run(core, reqs)
        assert out == ref and not ran
        assert len(steps) <= 24 // 4 + 3  # (the prefill, then bursts of 4 passes)
        assert free(core)


def test_a_try_that_could_not_start_waits_for_its_retry():
    loop, fast = LoopPolicy(8, BURST), 1e-3
    assert loop.choose(1, SHAPES, fast, 0) == Choice(CHAIN, TRY)
    loop.declined(1, CHAIN, 0)
    assert loop.choose(1, SHAPES, fast, 1) == Choice(TREE, TRY)
    loop.declined(1, TREE, 1)
    assert loop.choose(1, SHAPES, fast, 2) is None
    assert loop.plain_steps(1, SHAPES, 2) == LoopPolicy.RETRY_EVERY - 2
    assert loop.choose(1, SHAPES, fast, LoopPolicy.RETRY_EVERY) == Choice(CHAIN, TRY)


def test_a_try_that_cannot_start_counts_as_tried(eagle_target, eagle_head, monkeypatch):
    """A burst the loop policy chose but that cannot start (here no graph wide enough: `fits`)
    counts as a try: the plain steps up to the next one come as the executor's bursts, not one
    step at a time; the tokens are `ar`'s."""
    options = {"draft": "eagle", "num_speculative_tokens": 3}
    core = eagle_core(eagle_target, eagle_head, fused_decode_steps=4)
    spec = core.decoders["speculative"]
    spec.device_loop = True
    monkeypatch.setattr(spec.eagle.cycles, "fits", lambda *a: False)
    ref, _ = run(core, [GenerateRequest("r", PROMPTS[0], greedy(40))])
    steps = count_steps(core)
    out, _ = run(core, [GenerateRequest("r", PROMPTS[0], greedy(40), "speculative", options)])
    assert out == ref
    assert spec.loop.tried  # (the policy chose shapes, which could not start)
    assert len(steps) <= 40 // 4 + 8  # (the prefill, the steps that time plain ones, bursts)
    assert free(core)


def test_adaptive_requests_that_sample_draft_sampled_chains_in_the_loop(eagle_target, eagle_head):
    """A batch with sampled rows is offered the sampled chain alone (`menu(..., sampled=True)`):
    adaptive requests, sampled or beside a sampled one, draft only in the loop, in that chain."""
    core = eagle_core(eagle_target, eagle_head, fused_decode_steps=4)
    spec = core.decoders["speculative"]
    spec.device_loop = True
    ran, hosted = record_bursts(core), []
    real_draft = spec.eagle.draft
    spec.eagle.draft = lambda *a: hosted.append(a) or real_draft(*a)
    options = {"draft": "eagle", "num_speculative_tokens": 3}
    sampled = SamplingParams(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True)
    requests = [GenerateRequest("s", PROMPTS[0], sampled, "speculative", options),
                GenerateRequest("g", PROMPTS[1], greedy(40), "speculative", options)]  # fmt: skip
    tokens, _ = run(core, requests)
    assert len(tokens["s"]) == len(tokens["g"]) == 40
    assert menu(options, sampled=True) == (TreeShape.chain(3, sampled=True),)
    assert {shape for _, shape, _ in ran} == {TreeShape.chain(3, sampled=True)}
    assert not hosted
    assert free(core)


def test_loop_bursts_that_lose_on_the_clock_give_way_to_plain_epochs(eagle_target, eagle_head):
    """Requests the device loop drafts have epochs of their own (`Speculative.payoffs`): here
    the loop policy always picks a chain of 3, and each burst's commit takes 50 ms more than it
    prices, so after the first epochs the loop runs only in tries of drafting; the tokens are
    `ar`'s."""
    prompts = PROMPTS[:2]
    plain = [GenerateRequest(str(i), p, greedy(160)) for i, p in enumerate(prompts)]
    ref, _ = run(eagle_core(eagle_target, None), plain)
    core = eagle_core(eagle_target, eagle_head, fused_decode_steps=4)
    spec = core.decoders["speculative"]
    spec.device_loop = True
    ran, measured = record_bursts(core), spec.loop.measured

    def slow(*args):  # (after the loop priced the burst: a cost it does not see)
        measured(*args)
        time.sleep(0.05)

    spec.loop.measured = slow
    spec.loop.choose = lambda *args: Choice(TreeShape.chain(3), BURST)
    options = {"draft": "eagle", "num_speculative_tokens": 3, "tree_nodes": 0}
    reqs = [GenerateRequest(str(i), p, greedy(160), "speculative", options)
            for i, p in enumerate(prompts)]  # fmt: skip
    out, _ = run(core, reqs)
    assert out == ref
    assert 0 < len(ran) <= 15  # (with no epochs: 44 bursts, one every other step)
    payoff = spec.payoffs[True]
    assert payoff.epochs >= 3 and payoff.rates[bucket(2)][False] > payoff.rates[bucket(2)][True]
    assert free(core)


def count_steps(core) -> list[int]:
    """Every step of `core` from now on (one entry each)."""
    steps, real = [], core.step

    def counted():
        steps.append(1)
        return real()

    core.step = counted
    return steps


def test_a_bursts_price_leaves_out_the_heads_catch_up_after_plain_steps(eagle_target, eagle_head):
    """A burst after plain steps (or a prefill) first has the head catch up on the tokens it
    has not read: here that takes 1 s, and the chain's cycle is priced nowhere near its share."""
    core = eagle_core(eagle_target, eagle_head, fused_decode_steps=4)
    spec = core.decoders["speculative"]
    spec.device_loop = True
    eagle, catch_up = spec.eagle, spec.eagle._catch_up
    slowed = []

    def slow(seqs):
        if not all(eagle.caught_up(s) for s in seqs):
            slowed.append(len(seqs))
            time.sleep(1.0)
        return catch_up(seqs)

    eagle._catch_up = slow
    options = {"draft": "eagle", "num_speculative_tokens": 3, "tree_nodes": 0}
    reqs = [
        GenerateRequest(str(i), p, greedy(40), "speculative", options)
        for i, p in enumerate(PROMPTS[:3])
    ]
    run(core, reqs)
    assert slowed and spec.loop.rates
    assert list(spec.loop.rates) == [(bucket(3), TreeShape.chain(3))]
    assert spec.loop.rates[(bucket(3), TreeShape.chain(3))].seconds < 1.0 / LoopPolicy.TRY_CYCLES
    assert free(core)


def test_features_held_while_not_drafting_are_bounded_to_the_latest():
    rows = torch.arange(3000.0)[:, None]
    seq = SimpleNamespace(features=[rows[:2000], *rows[2000:].split(1)])
    keep_recent(seq, rows=1024)
    assert len(seq.features) == 1 and torch.equal(seq.features[0], rows[-1024:])
    few = SimpleNamespace(features=list(rows[:40].split(1)))
    keep_recent(few, rows=1024)
    assert len(few.features) == 40
