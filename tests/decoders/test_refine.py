"""Jacobi and lookahead decoding reproduce greedy AR token for token (fp32), alone and mixed."""

from __future__ import annotations

import pytest
import torch

from stride.decoders.autoregressive import Autoregressive
from stride.decoders.refine import Refine
from stride.engine.sequence import SamplingParams
from stride.scheduler.core import EngineCore
from stride.scheduler.outputs import GenerateRequest, RequestRejected
from tests.helpers.cores import run
from tests.helpers.models import VOCAB_SIZE, load_hf, make_model_dir
from tests.helpers.refine import TEXT_PROMPTS, make_refine_core, reqs

METHODS = [
    {"method": "jacobi"},
    {"method": "jacobi", "window": 3},
    {"method": "lookahead"},
    {"method": "lookahead", "window": 2, "ngram": 3, "candidates": 6},
]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


@pytest.fixture(scope="module")
def core(tiny_dir) -> EngineCore:
    return make_refine_core(tiny_dir)


@pytest.mark.parametrize("options", METHODS, ids=lambda o: "-".join(map(str, o.values())))
def test_alone_matches_greedy(core, options):
    ar, _ = run(core, reqs(core, "ar", {}))
    got, stats = run(core, reqs(core, "refine", options))
    for i in range(len(TEXT_PROMPTS)):
        assert got[f"refine{i}"] == ar[f"ar{i}"]
        s = stats[f"refine{i}"]
        assert s["decoder"] == "refine"
        assert s["forward_passes"] <= len(got[f"refine{i}"])
        assert s["tokens_per_pass"] >= 1.0


def test_jacobi_converges_on_a_fixed_point(core):
    """A huge logit bias makes every prediction the same token: after one pass the refined
    guesses are all right, so each later pass commits the whole window plus one."""
    window, bias = 4, {7: 100.0}
    opts = {"method": "jacobi", "window": window}
    got, stats = run(core, reqs(core, "refine", opts, n=1 + 2 * (window + 1), logit_bias=bias))
    ar, _ = run(core, reqs(core, "ar", {}, n=1 + 2 * (window + 1), logit_bias=bias))
    for i in range(len(TEXT_PROMPTS)):
        assert got[f"refine{i}"] == ar[f"ar{i}"] == [7] * 11
        assert stats[f"refine{i}"]["forward_passes"] == 3  # 1 + 5 + 5 tokens


@pytest.fixture(scope="module")
def memoryless_dir(tmp_path_factory):
    """A tiny model whose attention output is zero: the next token depends on the last alone."""
    path = make_model_dir(tmp_path_factory.mktemp("memoryless"), layers=1)
    hf = load_hf(path)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    hf.save_pretrained(path)
    return path, hf


def test_lookahead_verifies_prompt_ngrams(memoryless_dir):
    """The prompt holds the chain a, f(a), f(f(a)), ...: every n-gram from it is the model's own
    continuation, so each pass accepts a whole candidate (ngram - 1 tokens) plus one."""
    path, hf = memoryless_dir
    with torch.no_grad():
        succ = hf(torch.arange(VOCAB_SIZE)[:, None]).logits[:, -1].argmax(-1).tolist()
    chain = [11]
    while len(chain) < 40:
        chain.append(succ[chain[-1]])
    core = make_refine_core(path)
    prompt = chain[:30] + [chain[0]]
    opts = {"method": "lookahead", "window": 1, "ngram": 4, "candidates": 8}
    got, stats = run(core, [GenerateRequest("la", prompt, greedy(13), "refine", opts)])
    ar, _ = run(core, [GenerateRequest("ar", prompt, greedy(13))])
    assert got["la"] == ar["ar"] == chain[1:14]
    assert stats["la"]["forward_passes"] == 4  # 4 + 4 + 4 tokens, then the last one alone


def test_mixed_batch_with_penalties_matches_greedy(core):
    """AR, Jacobi and lookahead in one batch, with penalties, bias and min_tokens applied alike."""
    kw = dict(repetition_penalty=1.3, frequency_penalty=0.2, logit_bias={5: 2.0}, min_tokens=5)
    ar, _ = run(core, reqs(core, "ar", {}, n=20, **kw))
    mixed = (
        reqs(core, "refine", METHODS[0], n=20, **kw)
        + [
            GenerateRequest(f"la{r.request_id}", r.prompt_ids, r.params, "refine", METHODS[3])
            for r in reqs(core, "ar", {}, n=20, **kw)
        ]
        + reqs(core, "ar", {}, n=20, **kw)
    )
    got, _ = run(core, mixed)
    for i in range(len(TEXT_PROMPTS)):
        assert got[f"refine{i}"] == ar[f"ar{i}"]
        assert got[f"laar{i}"] == ar[f"ar{i}"]
        assert got[f"ar{i}"] == ar[f"ar{i}"]


def test_staggered_arrivals_and_preemption_match_greedy(tiny_dir):
    """A tight KV cache forces preemption; the decoders' state survives being dropped."""
    core = make_refine_core(tiny_dir)
    ar, _ = run(core, reqs(core, "ar", {}, n=40))
    small = make_refine_core(tiny_dir, kv_bytes=7 * 8192, max_num_seqs=8)
    tok = small.engine.tokenizer
    pending = [
        GenerateRequest(f"r{i}", tok.encode(p), greedy(40), "refine", METHODS[2 * (i % 2)])
        for i, p in enumerate(TEXT_PROMPTS)
    ]
    got: dict[str, list[int]] = {}
    preempted = 0
    while pending or small.has_work:
        if pending:
            small.add(pending.pop(0))
        preempted = max([preempted] + [s.num_preemptions for s in small.seqs.values()])
        for out in small.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
    assert preempted > 0
    for i in range(len(TEXT_PROMPTS)):
        assert got[f"r{i}"] == ar[f"ar{i}"]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_other_archs_match_greedy(arch, tiny_dirs):
    core = make_refine_core(tiny_dirs[arch])
    ar, _ = run(core, reqs(core, "ar", {}, n=16))
    for options in METHODS[1], METHODS[3]:
        got, _ = run(core, reqs(core, "refine", options, n=16))
        assert all(got[f"refine{i}"] == ar[f"ar{i}"] for i in range(len(TEXT_PROMPTS)))


def test_stop_rules_hold(core):
    """max_tokens is exact and a stop token ends the output even mid-window."""
    ar, _ = run(core, reqs(core, "ar", {}, n=7))
    got, _ = run(core, reqs(core, "refine", {"method": "jacobi", "window": 16}, n=7))
    assert got == {k.replace("ar", "refine"): v for k, v in ar.items()}
    stop = ar["ar1"][3]
    ar, _ = run(core, reqs(core, "ar", {}, n=20, stop_token_ids=[stop]))
    got, _ = run(core, reqs(core, "refine", METHODS[2], n=20, stop_token_ids=[stop]))
    assert got["refine1"] == ar["ar1"] and got["refine1"][-1] == stop


@pytest.mark.parametrize(
    "params, options, message",
    [
        (SamplingParams(temperature=0.7), {"method": "jacobi"}, "greedy"),
        (SamplingParams(temperature=1.0), {"method": "lookahead"}, "greedy"),
        (greedy(4), {"method": "beam"}, "unknown refine method"),
        (greedy(4), {"method": "jacobi", "window": 0}, "window"),
        (greedy(4), {"method": "jacobi", "ngram": 3}, "no option .ngram.; valid options: window"),
        (greedy(4), {"method": ["jacobi"]}, "unknown refine method"),
        (greedy(4), {"method": {"name": "jacobi"}}, "unknown refine method"),
        (greedy(4), {"method": "diffusion"}, "--diffusion-model"),
    ],
)
def test_bad_requests_are_rejected(core, params, options, message):
    with pytest.raises(RequestRejected, match=message):
        core.add(GenerateRequest("bad", [1, 2, 3], params, "refine", options))
    assert not core.has_work


def test_default_model_matches_greedy(default_engine):
    """SmolLM2-135M-Instruct: both methods equal greedy AR, mixed in one batch."""
    core = EngineCore(default_engine, decoders={"ar": Autoregressive(), "refine": Refine()})
    tok = default_engine.tokenizer
    chats = ["Write a Python function that adds two numbers.", "Name three colors."]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True)
        for c in chats
    ]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    batch = [
        GenerateRequest(f"{d}{m}{i}", p, greedy(16), d, {"method": m} if m else {})
        for i, p in enumerate(prompts)
        for d, m in (("ar", ""), ("refine", "jacobi"), ("refine", "lookahead"))
    ]
    got, _ = run(core, batch)
    for i in range(len(prompts)):
        assert got[f"refinejacobi{i}"] == got[f"ar{i}"]
        assert got[f"refinelookahead{i}"] == got[f"ar{i}"]


def test_logprobs_match_greedy(core):
    """The committed tokens' logprobs (and top alternatives) are AR's, row for row."""
    got = {}
    for decoder, options in (("ar", {}), ("refine", METHODS[0]), ("refine", METHODS[2])):
        for r in reqs(core, decoder, options, n=12, logprobs=2)[:1]:
            core.add(r)
        lps = []
        while core.has_work:
            for out in core.step():
                lps.extend(out.logprobs)
        got[decoder + options.get("method", "")] = lps
    for name in ("refinejacobi", "refinelookahead"):
        assert [lp.token_id for lp in got[name]] == [lp.token_id for lp in got["ar"]]
        for a, b in zip(got[name], got["ar"], strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
