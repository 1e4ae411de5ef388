"""Structured outputs in the engine: every decoder keeps to the grammar, exactly.

Greedy constrained decoding must equal the argmax of the model's fp32 logits under the grammar's
mask (computed here from transformers and a fresh llguidance matcher, step by step); lossless
decoders (speculative with each drafter, Jacobi, lookahead) must give that same output, and
sampled speculative decoding the masked target distribution. Drafts the grammar forbids never
reach the forward pass, and the grammar state after any step equals a fresh matcher fed the
committed output (nothing rejected ever touched it). Free requests beside constrained ones
decode exactly as they do alone.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from stride.decoders import grammar, sampling
from stride.decoders.numbers import EXPONENT_DIGITS, MANTISSA_DIGITS, Scan
from stride.decoders.registry import DecodersConfig, build_decoders
from stride.engine.config import EngineConfig
from stride.engine.engine import Engine
from stride.engine.sequence import Constraint, SamplingParams, Sequence
from stride.scheduler.core import EngineCore
from stride.scheduler.outputs import GenerateRequest, RequestRejected
from stride.scheduler.policy import SchedulerConfig
from tests.helpers.models import make_model_dir

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "for"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "size", "tags", "ok"],
    "additionalProperties": False,
}
JSON = Constraint("json_schema", json.dumps(SCHEMA))
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 5, 6, 7],
    [20, 21, 22, 23],
    [40, 41, 40, 41, 40, 41, 40],
]
DECODERS = {
    "ar": ("ar", {}),
    "ngram": ("speculative", {"draft": "ngram", "num_speculative_tokens": 4, "adaptive": False}),
    "early_exit": (
        "speculative",
        {"draft": "early_exit", "num_speculative_tokens": 3, "adaptive": False, "exit_layer": 1},
    ),
    "draft_model": ("speculative", {"num_speculative_tokens": 3, "adaptive": False}),
    "jacobi": ("refine", {"method": "jacobi", "window": 4}),
    "lookahead": ("refine", {"method": "lookahead", "window": 4, "candidates": 2}),
}


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory) -> Path:
    """A second random tiny model with the same tokenizer: a draft model that is often wrong."""
    return make_model_dir(tmp_path_factory.mktemp("draft") / "other", seed=1)


def make(model: Path, draft: Path | None = None, **sched) -> EngineCore:
    engine = Engine(EngineConfig(model=str(model), device="cpu", kv_cache_memory=8 << 20))
    decoders = build_decoders(engine, DecodersConfig(draft_model=draft and str(draft)))
    return EngineCore(engine, SchedulerConfig(**sched), decoders)


def params(constraint: Constraint | None = JSON, n: int = 80, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": n, "temperature": 0.0, "constraint": constraint, **kw})


def run(core: EngineCore, requests: list[GenerateRequest]) -> dict[str, tuple[list[int], str]]:
    """Run to completion: each request's tokens and finish reason."""
    tokens: dict[str, list[int]] = {}
    ends: dict[str, str] = {}
    for r in requests:
        core.add(r)
    while core.has_work:
        for out in core.step():
            assert out.error is None, out.error
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                ends[out.request_id] = out.finish_reason
    return {rid: (tokens.get(rid, []), ends[rid]) for rid in ends}


def text(core: EngineCore, ids: list[int]) -> str:
    return core.engine.tokenizer.decode(ids, skip_special_tokens=True)


def masked_greedy(core: EngineCore, hf, prompt: list[int], constraint: Constraint, n: int):
    """The reference: transformers' fp32 logits, the grammar's mask from a fresh matcher,
    argmax, one token at a time, until the grammar ends."""
    matcher = core.intake.grammars.matcher(constraint)
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1:].float()
            bits = grammar.bitmask([(matcher, [])], logits.shape[-1])
            allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[: logits.shape[-1]]
            logits[0, torch.from_numpy(allowed == 0)] = float("-inf")
            token = int(logits.argmax())
            out.append(token)
            ids.append(token)
            if matcher.advance(token) or token in core.engine.eos_ids:
                break
    return out


def test_greedy_constrained_output_is_the_masked_argmax(tiny_dir, tiny_hf):
    core = make(tiny_dir)
    for i, prompt in enumerate(PROMPTS):
        ((ids, reason),) = run(core, [GenerateRequest(str(i), prompt, params())]).values()
        assert ids == masked_greedy(core, tiny_hf, prompt, JSON, 80)
        assert reason == "stop"
        jsonschema.validate(json.loads(text(core, ids)), SCHEMA)


@pytest.mark.parametrize("name", list(DECODERS))
def test_every_decoder_keeps_to_the_grammar_and_equals_ar(tiny_dir, other_dir, name):
    decoder, options = DECODERS[name]
    reference = run(make(tiny_dir), [GenerateRequest(str(i), p, params())
                                     for i, p in enumerate(PROMPTS)])  # fmt: skip
    core = make(tiny_dir, other_dir if name == "draft_model" else None)
    got = run(core, [GenerateRequest(str(i), p, params(), decoder, options)
                     for i, p in enumerate(PROMPTS)])  # fmt: skip
    assert got == reference
    for ids, _ in got.values():
        jsonschema.validate(json.loads(text(core, ids)), SCHEMA)


def test_regex_choice_and_grammars(tiny_dir):
    core = make(tiny_dir)
    cases = {  # constraint -> what the whole output must match
        Constraint("regex", r"(yes|no), [0-9]{3}!"): r"(yes|no), [0-9]{3}!",
        Constraint("choice", json.dumps(["red", "green", "blue"])): r"red|green|blue",
        Constraint("grammar", 'start: "x=" NUM\nNUM: /[0-9]{2}/'): r"x=[0-9]{2}",
        Constraint("grammar", 'root ::= "go " [a-c]+ "."'): r"go [a-c]+\.",  # GBNF
    }
    for spec, pattern in cases.items():
        for decoder, options in (DECODERS["ar"], DECODERS["ngram"], DECODERS["jacobi"]):
            request = GenerateRequest("r", PROMPTS[0], params(spec, 40), decoder, options)
            ((ids, reason),) = run(core, [request]).values()
            assert re.fullmatch(pattern, text(core, ids)), (spec, text(core, ids))
            assert reason == "stop"


def test_a_bad_grammar_is_refused_at_admission(tiny_dir):
    core = make(tiny_dir)
    for bad in (Constraint("regex", "(unclosed"), Constraint("json_schema", '{"type": "nope"}')):
        with pytest.raises(RequestRejected) as e:
            core.add(GenerateRequest("r", [5, 6], params(bad)))
        assert e.value.param == "response_format"
    assert not core.seqs


def _paths(tokens: list[int], positions: list[int] | None, n: int) -> list[list[int]]:
    """A proposal's paths: one, or (lookahead) the window and each branch beside it, each
    starting again at the first proposed position."""
    proposed = tokens[-n:]
    if positions is None:
        return [proposed]
    at = positions[-n:]
    paths: list[list[int]] = []
    for token, position in zip(proposed, at, strict=True):
        if position == at[0]:
            paths.append([])
        paths[-1].append(token)
    return paths


class _Spy:
    """Records what each forward pass scored for constrained sequences, and every cut."""

    def __init__(self, core: EngineCore, monkeypatch) -> None:
        self.scored: list[tuple[Sequence, list[int]]] = []
        self.cuts = 0
        forward = core.engine.runner.forward

        def spying(chunks, *args, **kw):
            for c in chunks:
                if c.seq.grammar is not None and c.num_logits > 1:
                    for path in _paths(c.token_ids, c.positions, c.num_logits - 1):
                        self.scored.append((c.seq, path))
            return forward(chunks, *args, **kw)

        valid = grammar.Matcher.valid_prefix

        def counting(matcher, tokens):
            n = valid(matcher, tokens)
            self.cuts += n < len(tokens)
            return n

        monkeypatch.setattr(core.engine.runner, "forward", spying)
        monkeypatch.setattr(grammar.Matcher, "valid_prefix", counting)


@pytest.mark.parametrize("name", ["ngram", "early_exit", "jacobi", "lookahead"])
def test_drafts_the_grammar_forbids_are_cut_and_the_state_rolls_back(tiny_dir, monkeypatch, name):
    """Every proposal scored for a constrained sequence is one the grammar allows (checked
    against a fresh matcher fed the committed output then), some were cut to get there, and
    after every step the sequence's matcher is where that fresh one is."""
    decoder, options = DECODERS[name]
    core = make(tiny_dir)
    spy = _Spy(core, monkeypatch)
    # Prompts full of non-JSON text: prompt lookup and guesses propose what the grammar forbids.
    for i, prompt in enumerate(PROMPTS):
        core.add(GenerateRequest(str(i), prompt * 3, params(), decoder, options))
    while core.has_work:
        before = [(seq, list(seq.output_ids)) for seq in core.seqs.values()]
        spy.scored.clear()
        core.step()
        for seq, proposal in spy.scored:
            output = dict((id(s), o) for s, o in before)[id(seq)]
            fresh = core.intake.grammars.matcher(JSON)
            for t in output:
                fresh.advance(t)
            assert fresh.valid_prefix(proposal) == len(proposal), (output, proposal)
        for seq in core.seqs.values():  # the matcher is at the committed output's end
            fresh = core.intake.grammars.matcher(JSON)
            for t in seq.output_ids:
                fresh.advance(t)
            vocab = core.engine.hf_config.vocab_size
            same = grammar.bitmask([(fresh, []), (seq.grammar, [])], vocab)
            assert (same[0] == same[1]).all()
    if name != "early_exit":  # (early exit draws its drafts under the mask: nothing to cut)
        assert spy.cuts > 0


def test_free_requests_beside_constrained_ones_are_unchanged(tiny_dir, other_dir):
    """Greedy and seeded sampled free requests decode the same alone and in a batch with
    constrained ones (every decoder in the batch)."""
    free = [
        GenerateRequest("free-greedy", PROMPTS[0], params(None, 24, ignore_eos=True)),
        GenerateRequest("free-sampled", PROMPTS[1],
                        SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)),
        GenerateRequest("free-spec", PROMPTS[2], params(None, 24, ignore_eos=True),
                        *DECODERS["ngram"]),
    ]  # fmt: skip
    alone = {}
    for r in free:
        alone.update(run(make(tiny_dir, other_dir), [replace(r)]))
    mixed = [replace(r) for r in free] + [
        GenerateRequest(f"c-{name}", PROMPTS[i % 3], params(), *DECODERS[name])
        for i, name in enumerate(DECODERS)
    ]
    core = make(tiny_dir, other_dir)
    together = run(core, mixed)
    assert {r.request_id: together[r.request_id] for r in free} == alone
    for rid, (ids, _) in together.items():
        if rid.startswith("c-"):
            jsonschema.validate(json.loads(text(core, ids)), SCHEMA)


def test_constrained_sequences_join_bursts_and_keep_to_the_grammar(tiny_dir, tiny_hf):
    """With fused bursts on, greedy and untruncated sampled constrained requests join them,
    drawn from the raw logits and checked as they commit (the first refused token and those
    after it dropped, that token drawn again under the mask): the tokens are those of one step
    at a time, the masked argmax for greedy ones; a free request beside them decodes as it
    does alone, and a truncated sampled one never joins a burst."""
    requests = [
        GenerateRequest("c", PROMPTS[0], params()),
        GenerateRequest("s", PROMPTS[2], params(n=40, temperature=1.0, seed=3)),
        GenerateRequest("f", PROMPTS[1], params(None, 24, ignore_eos=True)),
        GenerateRequest("k", PROMPTS[1], params(n=40, temperature=1.0, seed=4, top_k=5)),
    ]
    core = make(tiny_dir, fused_decode_steps=8)
    bursts, decode_steps = [], core.engine.runner.decode_steps

    def recorded(seqs, tokens, steps, *args, **kwargs):
        bursts.append(({s.request_id for s in seqs}, steps))
        return decode_steps(seqs, tokens, steps, *args, **kwargs)

    core.engine.runner.decode_steps = recorded
    together = run(core, [replace(r) for r in requests[:3]])
    together.update(run(core, [replace(requests[3])]))
    alone = {}
    for r in requests:
        alone.update(run(make(tiny_dir), [replace(r)]))
    assert together == alone
    assert together["c"][0] == masked_greedy(core, tiny_hf, PROMPTS[0], JSON, 80)
    joined = set().union(*(ids for ids, steps in bursts if steps > 1))
    assert {"c", "s", "f"} <= joined and "k" not in joined


def test_a_constraint_is_compiled_once_per_sequence_using_it_at_once(tiny_dir, monkeypatch):
    """Sequences of one constraint share up to `LANES` compilations (their masks then fill in
    parallel): a new one while every compilation has a live matcher, none while one is free;
    each copy masks what a fresh matcher masks and moves on its own, and constrained requests
    decode as with one compilation."""
    monkeypatch.setattr(grammar, "LANES", 3)
    core = make(tiny_dir)
    grammars, vocab = core.intake.grammars, core.engine.hf_config.vocab_size
    for _ in range(4):  # one at a time: one compilation
        grammars.matcher(JSON)
    roots = grammars._compiled[JSON]
    assert len(roots.compiled) == 1 and roots.live == [0]
    matchers = [grammars.matcher(JSON) for _ in range(7)]
    assert len(roots.compiled) == 3 and sorted(roots.live) == [2, 2, 3]
    del matchers[:3]
    assert sum(roots.live) == 4
    matchers.append(grammars.matcher(JSON))  # to the least used lane, no new compilation
    assert len(roots.compiled) == 3 and max(roots.live) - min(roots.live) <= 1
    for token in core.engine.tokenizer.encode('{"name": "ab'):
        matchers[2].advance(token)
    masks = grammar.bitmask([(m, []) for m in matchers], vocab)
    fresh = grammar.bitmask([(make(tiny_dir).intake.grammars.matcher(JSON), [])], vocab)[0]
    assert all((row == fresh).all() for i, row in enumerate(masks) if i != 2)
    after = matcher_after(make(tiny_dir), JSON, '{"name": "ab')
    assert (masks[2] == grammar.bitmask([(after, [])], vocab)[0]).all()
    requests = [GenerateRequest(f"c{i}", PROMPTS[i % 3], params()) for i in range(5)]
    lanes = run(core, [replace(r) for r in requests])
    monkeypatch.setattr(grammar, "LANES", 1)
    assert run(make(tiny_dir), [replace(r) for r in requests]) == lanes


# ---- sampled: the masked target distribution ---------------------------------------------------

DIGITS = Constraint("regex", "[0-9]{2,8}")


def _masked_joint(core: EngineCore, hf, prompt: list[int], p: SamplingParams) -> torch.Tensor:
    """p(t1, t2) of the target with the grammar's mask, then temperature and top-k."""

    def dist(ids: list[int], pending: list[int]) -> torch.Tensor:
        seq = Sequence("x", prompt, p)
        seq.grammar = core.intake.grammars.matcher(DIGITS)
        logits = hf(torch.tensor([ids])).logits[0, -1:].float()
        row = sampling.Row(seq, pending)
        return sampling.probabilities(sampling.adjust(logits, [row], set()), [row])[0]

    with torch.no_grad():
        first = dist(prompt, [])
        joint = torch.zeros(first.numel(), first.numel(), dtype=torch.float64)
        for t in first.nonzero()[:, 0].tolist():
            joint[t] = first[t].double() * dist(prompt + [t], [t]).double()
    return joint


@pytest.mark.parametrize("draft", ["draft_model", "early_exit"])
def test_sampled_speculative_follows_the_masked_target(tiny_dir, tiny_hf, other_dir, draft):
    prompt, n = PROMPTS[1], 1200
    p = SamplingParams(max_tokens=2, temperature=1.5, top_k=6, ignore_eos=True, constraint=DIGITS)
    decoder, options = DECODERS[draft]
    core = make(tiny_dir, other_dir, max_waiting=n)
    requests = [GenerateRequest(str(i), prompt, replace(p, seed=i), decoder, options)
                for i in range(n)]  # fmt: skip
    stats: dict[str, dict] = {}
    tokens: dict[str, list[int]] = {}
    for r in requests:
        core.add(r)
    while core.has_work:
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                stats[out.request_id] = out.decoder_stats
    assert sum(s.get("draft_tokens", 0) for s in stats.values()) > 0
    joint = _masked_joint(core, tiny_hf, prompt, p)
    cells = joint.flatten().nonzero()[:, 0]
    counts = torch.zeros(joint.numel(), dtype=torch.float64)
    for t in tokens.values():
        assert len(t) == 2
        counts[t[0] * joint.shape[1] + t[1]] += 1
    assert counts.sum() == counts[cells].sum()  # nothing the grammar or top-k rules out
    assert _pvalue(counts[cells], joint.flatten()[cells]) > 1e-3
    # The same test tells a wrong distribution apart: the masked target at another temperature.
    wrong = _masked_joint(core, tiny_hf, prompt, replace(p, temperature=0.8))
    assert _pvalue(counts[cells], wrong.flatten()[cells]) < 1e-3


def _pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs / probs.sum() * observed.sum()
    return chisquare(observed.numpy(), expected.numpy()).pvalue


# ---- numbers stay within a double's digits, whatever the model prefers -------------------------

NUMBERS = {
    "type": "object",
    "properties": {"n": {"type": "number"}, "s": {"type": "string", "maxLength": 24}},
    "required": ["n", "s"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("written", "in_number", "digits"),
    [
        ('{"a": "1234567', False, 0),  # inside a string
        ('{"a": "x\\"99", "b": 12', True, 2),  # an escaped quote does not end the string
        ('{"b": -0.0012', True, 4),  # the leading 0 is free, the zeros after the point are not
        ('{"b": 0', True, 0),
        ("[1.5e+12", True, 2),  # the exponent's digits, counted apart
        ("[12, true", False, 0),
    ],
)
def test_the_number_scan_follows_strings_and_numbers(written, in_number, digits):
    scan = Scan().feed(written.encode())
    assert (scan.in_number, scan.digits if in_number else 0) == (in_number, digits)


def test_the_number_scan_is_the_same_fed_in_pieces():
    """Token by token (where most pieces change nothing and skip the byte loop) as at once."""
    written = '{"a": "x\\"9 y", "b": [-0.0012, 12, true, "z"], "c": 1.5e+12, "d": "w", "e": 3'
    whole = Scan().feed(written.encode())
    for size in (1, 2, 3, 5):
        scan = Scan()
        for i in range(0, len(written), size):
            scan = scan.feed(written[i : i + size].encode())
            assert scan == Scan().feed(written[: i + size].encode())
        assert scan == whole


def allowed_tokens(core: EngineCore, matcher: grammar.Matcher) -> list[str]:
    vocab = core.engine.hf_config.vocab_size
    flags = np.unpackbits(grammar.bitmask([(matcher, [])], vocab).view(np.uint8), bitorder="little")
    return [core.engine.tokenizer.decode([t]) for t in np.flatnonzero(flags[:vocab])]


def matcher_after(core: EngineCore, constraint: Constraint, written: str) -> grammar.Matcher:
    matcher = core.intake.grammars.matcher(constraint)
    for token in core.engine.tokenizer.encode(written):
        assert not matcher.advance(token)
    return matcher


def test_a_number_at_its_bound_may_only_end(tiny_dir):
    core = make(tiny_dir)
    numbers = Constraint("json_schema", json.dumps(NUMBERS))
    for written, more in [('{"n": ' + "1" * MANTISSA_DIGITS, False),
                          ('{"n": -0.' + "1" * (MANTISSA_DIGITS - 1), True),
                          ('{"n": 1e' + "2" * EXPONENT_DIGITS, False)]:  # fmt: skip
        tokens = allowed_tokens(core, matcher_after(core, numbers, written))
        assert any(t.isdigit() for t in tokens) == more, written
        assert "," in tokens and ("." not in tokens or more), written
    # a string takes digits without end, and a grammar that asks for a longer number gets it
    long_string = '{"n": 1, "s": "' + "1" * (MANTISSA_DIGITS + 2)
    assert "1" in allowed_tokens(core, matcher_after(core, numbers, long_string))
    const = Constraint("json_schema", json.dumps({"const": 10**25}))
    assert "0" in allowed_tokens(core, matcher_after(core, const, "1" + "0" * MANTISSA_DIGITS))


@pytest.mark.parametrize("name", ["ar", "ngram", "jacobi"])
def test_a_model_that_loves_digits_writes_a_bounded_number(tiny_dir, name):
    core = make(tiny_dir)
    tokenizer = core.engine.tokenizer
    digits = [t for t in range(len(tokenizer)) if tokenizer.decode([t]).isdigit()]
    params = SamplingParams(
        max_tokens=120, temperature=0.0, logit_bias=dict.fromkeys(digits, 40.0),
        constraint=Constraint("json_schema", json.dumps(NUMBERS)),
    )  # fmt: skip
    decoder, options = DECODERS[name]
    request = GenerateRequest("r", PROMPTS[1], params, decoder, options)
    ((ids, reason),) = run(core, [request]).values()
    written = text(core, ids)
    answer = json.loads(written)
    jsonschema.validate(answer, NUMBERS)
    mantissa = re.split("[eE]", re.search(r'"n": (-?[0-9.eE+-]+)', written).group(1))[0]
    mantissa = mantissa.lstrip("-").removeprefix("0")
    assert sum(c.isdigit() for c in mantissa) == MANTISSA_DIGITS, written
    assert answer["s"].isdigit() and len(answer["s"]) == 24, written  # strings are not bounded
    assert reason == "stop"


def test_a_token_the_matcher_allows_alone_is_one_the_mask_allows(tiny_dir):
    """`Matcher.allows` (a greedy draw's check of its argmax) never allows what the mask would
    not: every token, at every state of seeded walks through each kind of constraint, numbers
    driven to their bound and past it where the grammar asks for that. `Matcher.take` (the
    check at commit) takes what `allows` allows and nothing else, and where it refuses a token
    and names the token to take instead (`Matcher.instead`), the mask allows that one alone.
    The walks alternate taking and advancing."""
    core = make(tiny_dir)
    vocab, eos = core.engine.hf_config.vocab_size, core.engine.eos_ids
    digits = {t for t in range(vocab) if core.engine.tokenizer.decode([t]).isdigit()}
    constraints = [
        JSON,
        Constraint("json_schema", json.dumps(NUMBERS)),
        Constraint("json_schema", json.dumps({"const": 10**25})),
        Constraint("regex", "[a-c]{1,3}x"),
        Constraint("choice", '["yes", "no"]'),
    ]
    rng = np.random.default_rng(0)
    surely = masked = instead = 0
    for constraint in constraints:
        for _ in range(4):
            matcher = core.intake.grammars.matcher(constraint)
            for _ in range(60):
                bits = grammar.bitmask([(matcher, [])], vocab)
                mask = np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab].astype(bool)
                forced = matcher.forced()
                assert forced == matcher.ll.compute_ff_tokens()
                allows = np.array([matcher.allows(t, forced) for t in range(vocab)])
                assert not (allows & ~mask).any(), np.flatnonzero(allows & ~mask)
                surely, masked = surely + allows.sum(), masked + mask.sum()
                # refused: the first token refused, and the first the matcher would accept
                # (another spelling of forced text, a number past its bound)
                refused = np.flatnonzero(~allows)[:1].tolist()
                refused += [t for t in np.flatnonzero(~allows) if matcher.valid_prefix([t])][:1]
                for t in refused:
                    assert not matcher.take(t) and matcher.refused
                if refused and matcher.instead is not None:
                    assert np.flatnonzero(mask).tolist() == [matcher.instead]
                    instead += 1
                choices = np.flatnonzero(mask)
                favoured = [t for t in choices if t in digits] or list(choices)
                token = int(rng.choice(favoured if rng.random() < 0.7 else choices))
                if allows[token] and rng.random() < 0.5:
                    assert matcher.take(token) and not matcher.refused
                    stopped = matcher.stopped
                else:
                    stopped = matcher.advance(token)
                assert stopped == matcher.ll.is_stopped()
                if token in eos or stopped:
                    break
    assert surely > 0.9 * masked  # (the check is no mask: it allows nearly all the mask does)
    assert instead > 0  # (the walks pass through forced text)


def masked_rows(monkeypatch) -> list[int]:
    """The rows of every mask filled from now on, one entry per `mask_logits` call."""
    rows, mask_logits = [], grammar.mask_logits

    def counted(logits, at, jobs):
        rows.append(len(at))
        return mask_logits(logits, at, jobs)

    monkeypatch.setattr(grammar, "mask_logits", counted)
    return rows


def test_greedy_constrained_draws_ask_for_masks_only_where_the_argmax_is_refused(
    tiny_dir, tiny_hf, monkeypatch
):
    """The masked argmax, exactly, with a mask filled only for the rows whose raw argmax the
    grammar does not surely allow."""
    rows = masked_rows(monkeypatch)
    core = make(tiny_dir)
    requests = [GenerateRequest(str(i), p, params()) for i, p in enumerate(PROMPTS)]
    got = run(core, requests)
    for i, prompt in enumerate(PROMPTS):
        assert got[str(i)][0] == masked_greedy(core, tiny_hf, prompt, JSON, 80)
    # (a random model's argmax is mostly refused: a few rows go without a mask)
    assert 0 < sum(rows) < sum(len(ids) for ids, _ in got.values())


@pytest.mark.parametrize(
    "settings",
    [{"temperature": 1.0}, {"temperature": 0.7, "min_tokens": 5}, {"temperature": 1.0, "top_k": 5}],
)
def test_sampled_constrained_draws_are_those_of_the_mask_everywhere(
    tiny_dir, monkeypatch, settings
):
    """Seeded sampled requests under a grammar draw the same tokens whether each row's mask is
    filled every step or only where the token drawn from the raw logits is refused (untruncated
    rows: the same noise picks the same token among fewer whenever that token is left); rows
    with a top-k always take the mask."""
    rows = masked_rows(monkeypatch)
    requests = [GenerateRequest(str(i), p, params(n=60, seed=11 + i, **settings))
                for i, p in enumerate(PROMPTS)]  # fmt: skip
    got = run(make(tiny_dir), requests)
    first = sum(rows)
    with monkeypatch.context() as every_step:
        every_step.setattr(sampling, "checked_alone", lambda row: False)
        assert run(make(tiny_dir), requests) == got
    core = make(tiny_dir)
    for ids, reason in got.values():  # (a valid prefix where max_tokens cut it short)
        if reason == "stop":
            jsonschema.validate(json.loads(text(core, ids)), SCHEMA)
    made = sum(len(ids) for ids, _ in got.values())
    assert (first < made) == ("top_k" not in settings)
