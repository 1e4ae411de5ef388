"""Sampling rules on synthetic logits, and seeded / stopping behaviour through the engine."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import pytest
import torch

from stride.decoders import draw_kernels, sampling
from stride.decoders.speculative import draws
from stride.engine.sequence import SamplingParams, Sequence
from stride.scheduler.client import EngineClient
from stride.scheduler.outputs import GenerateRequest
from tests.helpers.cores import make_core


def rows(**params) -> list[sampling.Row]:
    return [sampling.Row(Sequence("r", [1, 2, 3], SamplingParams(**params)))]


def test_top_k_keeps_k_most_likely():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]])
    probs = sampling.probabilities(logits, rows(top_k=2))
    assert (probs[0] > 0).tolist() == [False, True, False, True, False]
    assert math.isclose(probs.sum().item(), 1.0, rel_tol=1e-6)


def test_a_top_k_holds_on_the_device_beside_rows_without_one():
    """A device draw keeps a row's top-k when another sampled row in its batch has none (and
    nobody asks for top-p): the row with top_k=2 draws only its two most likely tokens."""
    logits = torch.zeros(2, 64)
    logits[:, 10], logits[:, 20] = 0.5, 0.4  # nearly flat: without its top-k, row 0 roams
    seqs = [Sequence(f"r{i}", [1, 2, 3], SamplingParams(temperature=1.0, seed=i, top_k=k))
            for i, k in enumerate((2, 0))]  # fmt: skip
    drawn = set()
    for position in range(200):
        s = sampling.settings(seqs, [3 + position] * 2, logits.device)
        drawn.add(sampling.device_sample(logits, s)[0].item())
    assert drawn == {10, 20}


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs_in = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    probs = sampling.probabilities(probs_in.log(), rows(top_p=0.8))
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))


def test_min_p_drops_tokens_below_fraction_of_max():
    probs_in = torch.tensor([[0.6, 0.3, 0.08, 0.02]])
    probs = sampling.probabilities(probs_in.log(), rows(min_p=0.1))
    assert (probs[0] > 0).tolist() == [True, True, True, False]


SETTINGS = [
    dict(temperature=0.0),
    dict(temperature=0.7),
    dict(temperature=1.3, min_p=0.01),
    dict(temperature=0.9, top_k=20),
    dict(temperature=0.9, top_k=64, min_p=0.001),
    dict(temperature=0.8, top_p=0.9),
    dict(temperature=1.0, top_k=100, top_p=0.95),
]


@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: ",".join(map(str, p.items())))
def test_the_loops_distributions_rank_only_what_their_rows_need(params):
    """`row_probabilities` (the device loop's, from per-row tensors) equals `probabilities` (the
    host's) at the rank `ranks` gives a row's settings and with the whole vocabulary sorted; a
    sampled row's distribution at another rank differs (its truncation dropped, or made)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 300)  # flat enough that top-p keeps more than TOP_MAX
    seqs = [Sequence(f"r{i}", [1, 2], SamplingParams(**params)) for i in range(3)]
    floats = torch.tensor([s.params.draw_row for s in seqs], dtype=torch.float32)
    expected = sampling.probabilities(logits, [sampling.Row(s) for s in seqs])
    need = draws.ranks(s.params for s in seqs)
    for rank in (0, draw_kernels.TOP_MAX, draws.RANK_ALL):
        got = draws.row_probabilities(logits, floats, rank)
        if rank in (need, draws.RANK_ALL) or seqs[0].params.greedy:
            torch.testing.assert_close(got, expected)
        else:
            assert not torch.allclose(got, expected, atol=1e-4)


def test_a_batch_ranks_what_serves_all_its_sampled_rows():
    top_k, plain, top_p = (SamplingParams(temperature=1.0, **kw)
                           for kw in ({"top_k": 20}, {}, {"top_p": 0.9}))  # fmt: skip
    greedy = SamplingParams(temperature=0.0, top_p=0.5)
    assert draws.ranks([greedy, plain]) == 0
    assert draws.ranks([greedy, top_k, top_k]) == draw_kernels.TOP_MAX
    assert draws.ranks([plain, top_k]) == draws.RANK_ALL
    assert draws.ranks([top_p]) == draws.RANK_ALL
    assert draws.ranks([SamplingParams(temperature=1.0, top_k=65)]) == draws.RANK_ALL


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 2.0]])
    cold = sampling.probabilities(logits, rows(temperature=0.5))
    hot = sampling.probabilities(logits, rows(temperature=2.0))
    assert cold[0, 1] > hot[0, 1] > 0.5


def test_penalties_and_bias():
    seq = Sequence(
        "r", [0], SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, logit_bias={3: 5.0})
    )
    seq.token_ids += [1, 1, 2]
    out = sampling.adjust(torch.zeros(1, 4), [sampling.Row(seq)], eos_ids=set())
    # token 1: twice (-2 frequency, -0.5 presence); token 2: once; token 3: +5 bias.
    torch.testing.assert_close(out, torch.tensor([[0.0, -2.5, -1.5, 5.0]]))


def test_repetition_penalty_divides_positive_multiplies_negative():
    seq = Sequence("r", [0, 1], SamplingParams(repetition_penalty=2.0))
    out = sampling.adjust(torch.tensor([[4.0, -4.0, 4.0]]), [sampling.Row(seq)], eos_ids=set())
    torch.testing.assert_close(out, torch.tensor([[2.0, -8.0, 4.0]]))


def test_min_tokens_bans_eos_until_reached():
    seq = Sequence("r", [0], SamplingParams(min_tokens=2, stop_token_ids=[3]))
    out = sampling.adjust(torch.zeros(1, 4), [sampling.Row(seq)], eos_ids={2})
    assert out[0, 2] == -math.inf and out[0, 3] == -math.inf and out[0, 1] == 0
    seq.token_ids += [1, 1]
    assert sampling.adjust(torch.zeros(1, 4), [sampling.Row(seq)], eos_ids={2})[0, 2] == 0


def test_logprobs_with_alternatives():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    (lp,) = sampling.logprobs(logits, [2], rows(logprobs=2))
    ref = torch.log_softmax(logits, -1)[0]
    assert lp.token_id == 2 and math.isclose(lp.logprob, ref[2].item(), rel_tol=1e-6)
    assert [t for t, _ in lp.top] == [1, 2]


def _generate(core, reqs):
    for r in reqs:
        core.add(r)
    out: dict[str, list[int]] = {}
    while core.has_work:
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    return out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.9, top_k=30, top_p=0.9, seed=-5),
    ],
    ids=["temperature", "top-k-top-p"],
)
def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_dir, params):
    """The same tokens alone or among many others (greedy, truncated, unseeded), on the host
    (a logit bias of 0 with logprobs takes that path) or on the device: in bursts of several
    steps, or in one-step launches kept in flight (overlap, which the CPU can run too)."""
    prompt = [5, 6, 7, 8]
    alone = _generate(make_core(tiny_dir), [GenerateRequest("x", prompt, params)])["x"]
    others = [
        GenerateRequest(
            f"o{i}",
            [9 + i] * (3 + i),
            SamplingParams(
                max_tokens=20 - i,
                temperature=0.0 if i % 3 == 0 else 0.8,
                top_p=0.9 if i % 2 else 1.0,
                top_k=0 if i % 4 else 12,
            ),
        )
        for i in range(12)
    ]
    host = replace(params, logit_bias={3: 0.0}, logprobs=1)
    for mine, steps, overlap in [(params, 4, False), (params, 1, True), (host, 4, True)]:
        for crowd in ([], others):
            core = make_core(tiny_dir, max_num_seqs=16, fused_decode_steps=steps)
            core.executor.overlap = overlap
            reqs = crowd[:2] + [GenerateRequest("x", prompt, mine)] + crowd[2:]
            assert _generate(core, reqs)["x"] == alone
    other_seed = replace(params, seed=99)
    assert _generate(make_core(tiny_dir), [GenerateRequest("x", prompt, other_seed)])["x"] != alone


ADJUSTMENTS = {
    "bias": lambda first: {"logit_bias": {first: -100.0, 3: 2.5, 11: -2.0}},
    "penalties": lambda first: {"presence_penalty": 1.5, "frequency_penalty": 1.0},
    "repetition": lambda first: {"repetition_penalty": 1.8},
    "all": lambda first: {"logit_bias": {first: -100.0}, "repetition_penalty": 1.3,
                          "presence_penalty": 0.5, "frequency_penalty": 0.5},  # fmt: skip
}


@pytest.mark.parametrize("adjust", list(ADJUSTMENTS))
@pytest.mark.parametrize("temperature", [0.0, 0.4])
def test_biases_and_penalties_are_added_on_the_device_as_the_host_adds_them(
    tiny_dir, temperature, adjust
):
    """Rows with a logit bias or penalties and no logprobs are drawn on the device, in bursts
    and in launches kept in flight (their penalties count the tokens of the launch before,
    still in flight, on the device), beside rows without: the tokens the host's draw gives
    (with logprobs a row is drawn there), and not the unadjusted ones."""
    plain = SamplingParams(max_tokens=24, temperature=temperature, seed=7, ignore_eos=True)
    prompts = {"x": [5, 6, 7, 8, 5, 6], "y": [8, 7, 8, 7]}
    unadjusted = _generate(make_core(tiny_dir), [GenerateRequest("x", prompts["x"], plain)])["x"]
    params = replace(plain, **ADJUSTMENTS[adjust](unadjusted[0]))
    mine = {"x": params, "y": replace(params, seed=8)}
    host = {
        name: _generate(make_core(tiny_dir), [GenerateRequest(name, prompts[name],
                                                              replace(p, logprobs=1))])[name]
        for name, p in mine.items()
    }  # fmt: skip
    assert host["x"] != unadjusted
    others = [GenerateRequest(f"o{i}", [9 + i] * 3, replace(plain, seed=i)) for i in range(3)]
    for steps, overlap in [(4, False), (1, True), (4, True)]:
        core = make_core(tiny_dir, max_num_seqs=8, fused_decode_steps=steps)
        core.executor.overlap = overlap
        launched = _launches(core)
        reqs = [GenerateRequest(name, prompts[name], p) for name, p in mine.items()]
        made = _generate(core, [reqs[0], *others[:2], reqs[1], *others[2:]])
        assert {name: made[name] for name in mine} == host
        assert {"x", "y"} <= set(launched)  # (drawn on the device)


def _launches(core) -> list[str]:
    """The request ids of every row of the core's decode launches, as they launch."""
    launched: list[str] = []
    decode_steps = core.engine.runner.decode_steps

    def counting(seqs, *args, **kwargs):
        launched.extend(s.request_id for s in seqs)
        return decode_steps(seqs, *args, **kwargs)

    core.engine.runner.decode_steps = counting
    return launched


def test_stop_string_split_across_tokens(tiny_dir):
    core = make_core(tiny_dir)
    tok = core.engine.tokenizer
    free = _generate(
        core,
        [
            GenerateRequest(
                "a",
                tok.encode("Hello"),
                SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
            )
        ],
    )["a"]
    text = tok.decode(free)
    # Two characters straddling the boundary between the 3rd and 4th tokens' text.
    boundary = len(tok.decode(free[:3]))
    stop = text[boundary - 1 : boundary + 1]
    start = text.find(stop)
    assert len(stop) == 2 and 0 <= start

    outs = []
    core.add(
        GenerateRequest(
            "b",
            tok.encode("Hello"),
            SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop]),
        )
    )
    while core.has_work:
        outs.extend(core.step())
    streamed = "".join(o.text for o in outs)
    assert streamed == text[:start]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop


def test_stop_token_ids_and_max_tokens(tiny_dir):
    core = make_core(tiny_dir)
    free = _generate(
        core,
        [
            GenerateRequest(
                "a", [5, 6], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            )
        ],
    )["a"]
    core.add(
        GenerateRequest(
            "b",
            [5, 6],
            SamplingParams(
                max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[free[4]]
            ),
        )
    )
    outs = []
    while core.has_work:
        outs.extend(core.step())
    tokens = [t for o in outs for t in o.token_ids]
    assert tokens == free[: free.index(free[4]) + 1]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == free[4]


@pytest.fixture
def client(tiny_dir):
    c = EngineClient(make_core(tiny_dir))
    yield c
    c.shutdown()


def test_n_samples_through_the_client(client):
    async def go():
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
        got: dict[int, list[int]] = {}
        finals = 0
        async for index, out in client.generate(GenerateRequest("n", [5, 6, 7], params), n=3):
            got.setdefault(index, []).extend(out.token_ids)
            finals += out.finished
        return got, finals

    got, finals = asyncio.run(go())
    assert sorted(got) == [0, 1, 2] and finals == 3
    assert all(len(t) == 8 for t in got.values())
    assert len({tuple(t) for t in got.values()}) > 1  # distinct seeds, distinct samples


def test_cancel_frees_kv_within_a_step(client):
    cache = client.core.engine.cache

    async def go():
        params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
        stream = client.generate(GenerateRequest("c", list(range(5, 60)), params))
        async for _, out in stream:
            if out.token_ids:
                break
        used = cache.num_usable_blocks - cache.num_free_blocks
        await stream.aclose()  # what a disconnecting HTTP client does
        for _ in range(200):
            if cache.num_free_blocks == cache.num_usable_blocks and not client.core.has_work:
                return used
            await asyncio.sleep(0.01)
        raise AssertionError("KV not freed after abort")

    assert asyncio.run(go()) > 0
