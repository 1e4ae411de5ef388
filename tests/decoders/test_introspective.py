"""Introspective strided decoding (refine method `introspective`) is lossless: greedy equals ar
token for token with a random adapter, alone and mixed with ar, speculative and prefills; sampled
output follows the target's distribution; each slot set sees exactly what training shows it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from stride.decoders.base import DecoderError, Scored, StepContext
from stride.decoders.introspective import Introspective, IntrospectiveState
from stride.decoders.refine import Refine
from stride.engine.adapter import MASK_TOKEN
from stride.engine.sequence import Constraint, SamplingParams, Sequence
from stride.engine.spans import Span
from stride.scheduler.outputs import GenerateRequest
from tests.helpers.adapters import SLOTS, introspective_core, pass_spans, random_adapter
from tests.helpers.cores import PROMPTS, chi2_pvalue, greedy, run

# Slots named: a pass every step (default options are adaptive: tests/decoders/test_payoff.py).
INTRO = {"type": "refine", "method": "introspective", "slots": SLOTS}


@pytest.fixture(scope="module")
def core(tiny_dir):
    return introspective_core(tiny_dir)


@pytest.fixture(scope="module")
def reference(core) -> dict[int, list[int]]:
    """Plain greedy decoding of every prompt, one request at a time."""
    out = {}
    for i, prompt in enumerate(PROMPTS):
        tokens, _ = run(core, [GenerateRequest("r", prompt, greedy(24))])
        out[i] = tokens["r"]
    return out


def intro(rid: str, prompt: list[int], params: SamplingParams, **options) -> GenerateRequest:
    options = {k: v for k, v in {**INTRO, **options}.items() if k != "type"}
    return GenerateRequest(rid, prompt, params, "refine", options)


@pytest.mark.parametrize("slots", [1, SLOTS, 5])
def test_alone_matches_greedy(core, reference, slots):
    for i, prompt in enumerate(PROMPTS):
        tokens, stats = run(core, [intro("i", prompt, greedy(24), slots=slots)])
        assert tokens["i"] == reference[i]
        assert stats["i"]["draft_tokens"] > 0  # proposals were made and verified
        assert stats["i"]["forward_passes"] <= len(tokens["i"])


def test_under_a_grammar_matches_constrained_greedy(core):
    """Proposals the grammar forbids are cut before they are scored: constrained introspective
    decoding equals constrained `ar` token for token, and its text parses."""
    fields = {"n": {"type": "integer", "minimum": 0, "maximum": 99},
              "s": {"type": "string", "maxLength": 4}}  # fmt: skip
    schema = {"type": "object", "properties": fields, "required": ["n", "s"],
              "additionalProperties": False}  # fmt: skip
    params = replace(greedy(64), constraint=Constraint("json_schema", json.dumps(schema)))
    for prompt in PROMPTS:
        want, _ = run(core, [GenerateRequest("r", prompt, params)])
        got, stats = run(core, [intro("i", prompt, params)])
        assert got["i"] == want["r"]
        assert stats["i"]["draft_tokens"] > 0
        json.loads(core.engine.tokenizer.decode(got["i"], skip_special_tokens=True))


def test_every_proposal_passes_when_the_bias_makes_the_choice(core):
    """A huge logit bias makes every choice token 7, the slots' too: after the prompt's pass each
    pass accepts every proposal plus one (the accepted rows' KV kept, the slots' dropped); near
    the end the request's length caps proposals and slots."""
    k, bias, n = SLOTS, {7: 100.0}, 1 + 4 * (SLOTS + 1)
    params = replace(greedy(n), logit_bias=bias)
    core.add(intro("i", PROMPTS[1], params, slots=k))
    per_pass, stats = [], {}
    while core.has_work:
        for out in core.step():
            per_pass.append(len(out.token_ids))
            stats = out.decoder_stats or stats
    ar, _ = run(core, [GenerateRequest("a", PROMPTS[1], params)])
    assert ar["a"] == [7] * n and sum(per_pass) == n
    assert per_pass[:3] == [1, k + 1, k + 1] and min(per_pass[1:-1]) >= 2  # the last: cap 0
    assert stats["accepted_tokens"] == stats["draft_tokens"] == n - len(per_pass)


def test_each_slot_set_sees_the_tail_and_the_proposals_before_it(tiny_dir):
    """In the tree-shaped pass, slot set a computes what a plain causal pass of [tail, d1..da,
    k slots] computes (what training computes): the mask and positions are right."""
    core = introspective_core(tiny_dir)
    engine, decoder = core.engine, core.decoders["refine"].causal["introspective"]
    prompt, drafts, k = PROMPTS[2], [3, 9, 27], SLOTS
    seq = Sequence("s", prompt, greedy(8), "refine", {"method": "introspective", "slots": k})
    seq.decoder_state = IntrospectiveState(proposals=list(drafts))
    extra = decoder.extra_tokens(seq, 64)
    assert extra == len(drafts) + (len(drafts) + 1) * k
    prop = decoder.propose([seq], StepContext(set(), engine.device))[0]
    engine.cache.reserve(seq, len(prompt) + extra)
    span = Span(seq, prompt + prop.tokens, 1 + extra, list(range(len(prompt))) + prop.positions,
                prop.mask)  # fmt: skip
    tree = engine.runner.forward([span])[0]
    engine.cache.free(seq)
    m = len(drafts)
    for a in range(m + 1):
        alone = Sequence("t", prompt, greedy(8))
        tokens = prompt + drafts[:a] + [MASK_TOKEN] * k
        engine.cache.reserve(alone, len(tokens))
        plain = engine.runner.forward([Span(alone, tokens, a + k + 1)])[0]
        engine.cache.free(alone)
        start = 1 + m + a * k
        torch.testing.assert_close(tree[start : start + k], plain[1 + a :], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(tree[: a + 1], plain[: a + 1], atol=1e-5, rtol=1e-5)


def test_slot_spans_as_decode_rows_score_what_the_padded_path_does(tiny_dir):
    """A pass's spans after a prefill (a tail, proposals and slot sets under their mask; a tail
    and one set of slots, plainly causal) beside a lookahead-like masked span, scored as decode
    rows (`_forward_rows`, the GPU's path for them) and on the padded path: the same logits in
    fp32, the adapter on the slots' rows in both."""
    core = introspective_core(tiny_dir)
    runner = core.engine.runner
    spans = pass_spans(core)
    assert spans[1].mask is None and MASK_TOKEN in spans[1].token_ids  # (the plain causal case)
    padded = runner._forward_eager(spans, None)
    rows = runner._forward_rows(spans)
    for a, b in zip(padded, rows, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_commit_keeps_the_accepted_prefix_and_proposes_from_the_set_after_it(tiny_dir):
    """Crafted logits: the real rows accept d1, d2 and reject d3; the commit keeps their KV,
    adds the bonus, and the next proposals are set 2's argmax (not set 0's, not set 3's)."""
    vocab, k = 50, 2
    decoder = Introspective(random_adapter(introspective_core(tiny_dir).engine.model, slots=k))
    seq = Sequence("s", [1, 2, 3], greedy(20), "refine", {"method": "introspective", "slots": k})
    seq.num_cached = 2
    seq.decoder_state = IntrospectiveState(proposals=[10, 11, 12])
    n = decoder.extra_tokens(seq, 64)
    prop = decoder.propose([seq], StepContext(set(), torch.device("cpu")))[0]
    logits = torch.zeros(1 + n, vocab)
    for row, token in enumerate([10, 11, 40, 41]):  # row r: the target's choice after d1..dr
        logits[row, token] = 1.0
    for a in range(4):  # slot set a proposes 20 + a, 30 + a
        start = 4 + a * k
        logits[start, 20 + a] = logits[start + 1, 30 + a] = 1.0
    ctx = StepContext(set(), torch.device("cpu"))
    (commit,) = decoder.commit([seq], [prop], Scored(logits=[logits]), ctx)
    assert commit.tokens == [10, 11, 40] and commit.kv_keep == 2
    assert seq.decoder_state.proposals == [22, 32]


def test_mixed_batch_with_ar_speculative_and_prefills(tiny_dir, reference):
    core = introspective_core(tiny_dir, max_num_batched_tokens=24)
    spec = {"draft": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    first = [intro(f"i{i}", p, greedy(24)) for i, p in enumerate(PROMPTS)]
    first += [GenerateRequest(f"a{i}", p, greedy(24)) for i, p in enumerate(PROMPTS[:2])]
    late = [GenerateRequest(f"s{i}", p, greedy(24), "speculative", spec)
            for i, p in enumerate(PROMPTS)]  # fmt: skip
    late += [intro(f"j{i}", p + p, greedy(24), slots=2) for i, p in enumerate(PROMPTS)]
    tokens, _ = run(core, first, late)
    for i in range(len(PROMPTS)):
        assert tokens[f"i{i}"] == tokens[f"s{i}"] == reference[i]
    for i in range(2):
        assert tokens[f"a{i}"] == reference[i]
    for i, p in enumerate(PROMPTS):
        alone, _ = run(core, [GenerateRequest("r", p + p, greedy(24))])
        assert tokens[f"j{i}"] == alone["r"]


def test_preemption_and_penalties_match_greedy(tiny_dir):
    """A tight KV cache preempts sequences (their proposals are dropped and made again);
    penalties, bias and min_tokens apply to real rows as ar applies them."""
    kw = dict(repetition_penalty=1.3, frequency_penalty=0.2, logit_bias={5: 2.0}, min_tokens=5)
    params = replace(greedy(40), **kw)
    big = introspective_core(tiny_dir)
    ar, _ = run(big, [GenerateRequest(f"a{i}", p, params) for i, p in enumerate(PROMPTS)])
    small = introspective_core(tiny_dir, kv_bytes=6 * 8192, max_num_seqs=8)
    tokens, _ = run(small, [intro(f"i{i}", p, params) for i, p in enumerate(PROMPTS)])
    assert small.preempted
    for i in range(len(PROMPTS)):
        assert tokens[f"i{i}"] == ar[f"a{i}"]


def exact_joint3(tiny_hf, prompt: list[int], params: SamplingParams) -> dict[tuple, float]:
    """p(t1, t2, t3) of the target under bias, temperature and top-k, for every triple."""
    from stride.decoders import sampling

    def dist(ids: list[int]) -> torch.Tensor:
        logits = tiny_hf(torch.tensor([ids])).logits[0, -1:].float()
        rows = [sampling.Row(Sequence("x", ids, params))]
        return sampling.probabilities(sampling.adjust(logits, rows, set()), rows)[0]

    out: dict[tuple, float] = {(): 1.0}
    with torch.no_grad():
        for _ in range(3):
            grown = {}
            for prefix, p in out.items():
                d = dist(prompt + list(prefix)).double()
                for t in d.nonzero()[:, 0].tolist():
                    grown[prefix + (t,)] = p * d[t].item()
            out = grown
    return out


def test_sampled_output_follows_the_target_distribution(tiny_dir, tiny_hf):
    """Seeded sampled requests of three tokens: the first from the prompt's pass, then a pass
    that verifies one slot proposal by the rejection rule (q: the slot's distribution). The
    joint of the three tokens is the target's (chi-square), and a wrong one is rejected. (A
    bias keeps both p and q on three tokens, so that proposals pass and fail alike.)"""
    prompt, n = PROMPTS[2], 1500
    bias = {5: 30.0, 6: 30.0, 7: 30.0}
    params = SamplingParams(
        max_tokens=3, temperature=1.5, top_k=3, logit_bias=bias, ignore_eos=True
    )
    core = introspective_core(tiny_dir, max_waiting=n, max_num_seqs=256)
    requests = [intro(str(i), prompt, replace(params, seed=i), slots=2) for i in range(n)]
    tokens, stats = run(core, requests)
    drafted = sum(s["draft_tokens"] for s in stats.values())
    accepted = sum(s["accepted_tokens"] for s in stats.values())
    assert 0 < accepted < drafted  # the rule both accepted and rejected proposals
    joint = exact_joint3(tiny_hf, prompt, params)
    cells = sorted(joint)
    counts = torch.zeros(len(cells), dtype=torch.float64)
    index = {c: i for i, c in enumerate(cells)}
    for t in tokens.values():
        counts[index[tuple(t)]] += 1  # (a KeyError: a triple outside the target's support)
    probs = torch.tensor([joint[c] for c in cells])
    pvalue = chi2_pvalue(counts, probs)
    print(f"chi-square p-value {pvalue:.3g}")
    assert pvalue > 1e-3
    wrong = exact_joint3(tiny_hf, prompt, replace(params, temperature=0.8))
    wrong_probs = torch.tensor([wrong.get(c, 0.0) for c in cells])
    wrong_pvalue = chi2_pvalue(counts, wrong_probs + 1e-12)
    print(f"wrong distribution: p-value {wrong_pvalue:.3g}")
    assert wrong_pvalue < 1e-3


def test_bad_requests_are_refused(core, tiny_dir):
    refine = core.decoders["refine"]
    with pytest.raises(DecoderError, match="option 'slots'"):
        refine.validate(greedy(4), {"method": "introspective", "slots": 0})
    with pytest.raises(DecoderError, match="no option 'window'"):
        refine.validate(greedy(4), {"method": "introspective", "window": 2})
    assert refine.validate(greedy(4), {"method": "introspective"}) == {
        "method": "introspective", "slots": SLOTS, "adaptive": True
    }  # fmt: skip
    assert refine.validate(greedy(4), {"method": "introspective", "slots": 2}) == {
        "method": "introspective", "slots": 2, "adaptive": False
    }  # fmt: skip
    with pytest.raises(DecoderError, match="--mask-adapter"):
        Refine().validate(greedy(4), {"method": "introspective"})


def test_the_shipped_adapter_of_a_model_is_picked_by_its_name(tmp_path, monkeypatch):
    from stride import adapters

    monkeypatch.setattr(adapters, "ADAPTERS", tmp_path)
    (tmp_path / "SmolLM2-135M-Instruct").mkdir()
    assert adapters.pick(None, "SmolLM2-135M-Instruct.Q4_1.gguf") is None  # no config.json
    (tmp_path / "SmolLM2-135M-Instruct" / "config.json").write_text("{}")
    found = adapters.pick(None, "/x/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert found == str(tmp_path / "SmolLM2-135M-Instruct")
    assert adapters.pick("/mine", "SmolLM2-135M-Instruct") == "/mine"
    assert adapters.pick(None, "other-model") is None


def test_logprobs_match_greedy(core):
    """The committed tokens' logprobs (and top alternatives) are AR's, row for row."""
    got = {}
    for name, request in (
        ("ar", GenerateRequest("a", PROMPTS[0], replace(greedy(12), logprobs=2))),
        ("intro", intro("i", PROMPTS[0], replace(greedy(12), logprobs=2))),
    ):
        core.add(request)
        got[name] = []
        while core.has_work:
            for out in core.step():
                got[name].extend(out.logprobs)
    assert [lp.token_id for lp in got["intro"]] == [lp.token_id for lp in got["ar"]]
    for a, b in zip(got["intro"], got["ar"], strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_the_server_config_loads_and_attaches_the_adapter(tiny_dir, tmp_path, reference):
    """`--mask-adapter DIR` (DecodersConfig.mask_adapter): the refine decoder offers the
    method, and the engine's runner runs the adapter on MASK rows."""
    from stride.decoders.registry import DecodersConfig, build_decoders
    from stride.engine.config import EngineConfig
    from stride.engine.engine import Engine
    from stride.scheduler.core import EngineCore

    engine = Engine(EngineConfig(model=str(tiny_dir), device="cpu", kv_cache_memory=8 << 20))
    random_adapter(engine.model, seed=3).save(tmp_path, dtype=torch.float32)
    decoders = build_decoders(engine, DecodersConfig(mask_adapter=str(tmp_path)))
    assert engine.runner.adapter is decoders["refine"].causal["introspective"].adapter
    core = EngineCore(engine, decoders=decoders)
    tokens, _ = run(core, [intro("i", PROMPTS[3], greedy(24))])
    assert tokens["i"] == reference[3]
    bare = build_decoders(
        Engine(EngineConfig(model=str(tiny_dir), device="cpu", kv_cache_memory=8 << 20))
    )
    assert "introspective" not in bare["refine"].causal


@pytest.mark.parametrize("adapter", ["random", "shipped"])
def test_default_model_matches_greedy(default_engine, adapter):
    """SmolLM2-135M-Instruct with a random adapter, and with the one shipped for it: equal to
    greedy AR, mixed in one batch."""
    from stride import adapters
    from stride.decoders.autoregressive import Autoregressive
    from stride.engine.adapter import MaskAdapter
    from stride.scheduler.core import EngineCore

    if adapter == "shipped":
        path = adapters.shipped_adapter(default_engine.name)
        if path is None:
            pytest.skip("no adapter is shipped for the default model yet")
        loaded = MaskAdapter.load(path, default_engine.model)
    else:
        loaded = random_adapter(default_engine.model, rank=8, slots=4)
    default_engine.runner.attach_adapter(loaded)
    decoders = {"ar": Autoregressive(), "refine": Refine(adapter=loaded)}
    core = EngineCore(default_engine, decoders=decoders)
    tok = default_engine.tokenizer
    chats = ["Write a Python function that adds two numbers.", "Name three colors."]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True)
        for c in chats
    ]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    batch = [GenerateRequest(f"a{i}", p, greedy(24)) for i, p in enumerate(prompts)]
    batch += [intro(f"i{i}", p, greedy(24)) for i, p in enumerate(prompts)]
    got, stats = run(core, batch)
    for i in range(len(prompts)):
        assert got[f"i{i}"] == got[f"a{i}"]
        assert stats[f"i{i}"]["draft_tokens"] > 0


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_other_archs_match_greedy(arch, tiny_dirs):
    """Biased projections (qwen2) and normed queries and keys (qwen3) take the adapter alike."""
    core = introspective_core(tiny_dirs[arch])
    for i, prompt in enumerate(PROMPTS[:2]):
        ar, _ = run(core, [GenerateRequest("a", prompt, greedy(16))])
        got, _ = run(core, [intro("i", prompt, greedy(16), slots=2)])
        assert got["i"] == ar["a"], i
