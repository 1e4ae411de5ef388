"""Fault isolation in the step loop: one request's failure is that request's, not the engine's.

Faults are injected where the core calls out (a decoder's batched `propose`/`commit`, its
per-sequence `extra_tokens`, the forward pass, detokenizing, admission) and trip on one
poisoned request. That request must fail with `internal_error`; every other request must end
normally with exactly the tokens greedy decoding gives without the poisoned one around (the
bisection that finds the culprit resets decoder state: speculation must stay lossless).
"""

from __future__ import annotations

import pytest

from stride.decoders.autoregressive import Autoregressive
from stride.decoders.registry import build_decoders
from stride.engine.config import EngineConfig
from stride.engine.engine import Engine
from stride.engine.sequence import SamplingParams
from stride.scheduler.core import EngineCore
from stride.scheduler.outputs import GenerateRequest, RequestOutput, RequestRejected
from stride.scheduler.policy import SchedulerConfig

POISON = 3  # a prompt starting with this token trips the injected faults
PROMPTS = [[5, 17, 42, 99, 7, 5, 17, 42], [8, 9, 10, 8, 9, 10, 8], [200, 100, 50], [11] * 6]
SPEC = {"draft": "ngram", "num_speculative_tokens": 3, "adaptive": False}


def make(model_dir) -> EngineCore:
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", kv_cache_memory=16 << 20))
    return EngineCore(engine, SchedulerConfig(), build_decoders(engine))


def greedy(n: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def run(core: EngineCore, requests: list[GenerateRequest]) -> dict[str, list[RequestOutput]]:
    for r in requests:
        core.add(r)
    outs: dict[str, list[RequestOutput]] = {}
    while core.has_work:
        for out in core.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def batch(decoder: str, options: dict | None = None) -> list[GenerateRequest]:
    """Two requests per prompt (so that the poisoned one has company in every batch)."""
    return [
        GenerateRequest(f"{decoder}{i}-{j}", p, greedy(), decoder, dict(options or {}))
        for i, p in enumerate(PROMPTS)
        for j in range(2)
    ]


def poisoned(decoder: str, options: dict | None = None) -> GenerateRequest:
    return GenerateRequest("poisoned", [POISON, 5, 6], greedy(), decoder, dict(options or {}))


def trip(obj, method: str) -> None:
    """Make `obj.method` raise whenever a poisoned sequence is among those it is called for."""
    original = getattr(obj, method)

    def tripped(seqs, *args):
        if any(s.prompt_ids[0] == POISON for s in (seqs if isinstance(seqs, list) else [seqs])):
            raise RuntimeError(f"injected {method} failure")
        return original(seqs, *args)

    setattr(obj, method, tripped)


@pytest.fixture(scope="module")
def reference(tiny_dir) -> dict[str, list[int]]:
    """Greedy tokens of every prompt, from plain decoding with nothing failing."""
    outs = run(make(tiny_dir), batch("ar"))
    return {rid: [t for o in os for t in o.token_ids] for rid, os in outs.items()}


def check(outs: dict[str, list[RequestOutput]], reference, decoder: str, core) -> None:
    bad = outs.pop("poisoned")
    assert [o.finished for o in bad].count(True) == 1 and bad[-1].finished
    assert bad[-1].error.code == "internal_error" and "injected" in bad[-1].error.message
    for rid, seq_outs in outs.items():
        assert [o.finished for o in seq_outs].count(True) == 1, rid
        assert seq_outs[-1].error is None and seq_outs[-1].finish_reason == "length"
        tokens = [t for o in seq_outs for t in o.token_ids]
        assert tokens == reference[rid.replace(decoder, "ar", 1)], rid
    assert not core.seqs and not core.decoders.suspects
    assert core.engine.cache.num_free_blocks == core.engine.cache.num_usable_blocks


@pytest.mark.parametrize("where", ["propose", "commit", "extra_tokens"])
@pytest.mark.parametrize("decoder, options", [("ar", None), ("speculative", SPEC)])
def test_a_failing_decoder_call_fails_only_its_culprit(
    tiny_dir, reference, where, decoder, options
):
    core = make(tiny_dir)
    trip(core.decoders[decoder], where)
    outs = run(core, [*batch(decoder, options), poisoned(decoder, options)])
    check(outs, reference, decoder, core)


def test_a_failing_forward_is_retried_without_its_culprit(tiny_dir, reference):
    core = make(tiny_dir)
    forward = core.engine.runner.forward

    def tripped(chunks, *args, **kw):
        if any(c.seq.prompt_ids[0] == POISON for c in chunks):
            raise RuntimeError("injected forward failure")
        return forward(chunks, *args, **kw)

    core.engine.runner.forward = tripped
    outs = run(core, [*batch("ar"), poisoned("ar")])
    check(outs, reference, "ar", core)


def test_a_forward_failing_for_everyone_breaks_the_step(tiny_dir):
    core = make(tiny_dir)
    for r in batch("ar"):
        core.add(r)

    def lost(chunks, *args, **kw):
        raise RuntimeError("device lost")

    core.engine.runner.forward = lost
    with pytest.raises(RuntimeError, match="device lost"):
        core.step()
    failed = core.fail_all("engine loop died")
    assert len(failed) == len(PROMPTS) * 2 and all(o.error.code == "engine_dead" for o in failed)


def test_failing_detokenizing_fails_only_its_request(tiny_dir, reference):
    core = make(tiny_dir)
    for r in [*batch("ar"), poisoned("ar")]:
        core.add(r)

    def broken(final: bool) -> str:
        raise UnicodeError("injected detokenizer failure")

    core._detok["poisoned"].take = broken
    outs: dict[str, list[RequestOutput]] = {}
    while core.has_work:
        for out in core.step():
            outs.setdefault(out.request_id, []).append(out)
    check(outs, reference, "ar", core)


def test_the_two_killers_of_issue_16_fail_alone(tiny_dir, reference):
    """A list as refine's method is refused at admission; an overflowing top_k (had it got
    past the schema) keeps every token, as no top-k does (settings travel as int64)."""
    core = make(tiny_dir)
    with pytest.raises(RequestRejected) as e:
        core.add(GenerateRequest("m", [5], greedy(4), "refine", {"method": ["jacobi"]}))
    assert e.value.code == "invalid_decoder"
    # (unseeded draws from a random model: without ignore_eos one may draw EOS first)
    killer = SamplingParams(max_tokens=4, temperature=1.0, top_k=10**20, ignore_eos=True)
    outs = run(core, [*batch("ar"), GenerateRequest("huge", [POISON, 5], killer)])
    huge = outs.pop("huge")
    assert huge[-1].finish_reason == "length" and sum(len(o.token_ids) for o in huge) == 4
    for rid, seq_outs in outs.items():
        assert [t for o in seq_outs for t in o.token_ids] == reference[rid], rid


def test_an_error_of_ours_at_admission_rejects_only_that_request(tiny_dir):
    core = make(tiny_dir)

    class Fragile(Autoregressive):
        def validate(self, params, options):
            raise TypeError("injected validation bug")

    core.decoders.decoders["fragile"] = Fragile()
    with pytest.raises(RequestRejected) as e:
        core.add(GenerateRequest("f", [5, 6], greedy(4), "fragile"))
    assert e.value.code == "internal_error"
    assert not core.seqs
    outs = run(core, [GenerateRequest("ok", [5, 6], greedy(4))])
    assert outs["ok"][-1].finish_reason == "length"
