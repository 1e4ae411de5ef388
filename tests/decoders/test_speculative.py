"""Speculative decoding: exact greedy equality, the exact sampling distribution, KV bookkeeping."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from stride.decoders.autoregressive import Autoregressive
from stride.decoders.base import Proposal, Scored, StepContext
from stride.decoders.rates import bucket
from stride.decoders.registry import DecodersConfig, build_decoders
from stride.decoders.speculative import Speculative
from stride.decoders.speculative.drafters import Draft, Drafter, NgramDrafter
from stride.decoders.speculative.loop_policy import StepCosts, Timings, choose_k
from stride.decoders.speculative.policy import AdaptivePolicy, StepPlans
from stride.decoders.speculative.verify import verify
from stride.engine.config import EngineConfig
from stride.engine.engine import Engine
from stride.engine.sequence import SamplingParams, Sequence
from stride.engine.spans import Span
from stride.scheduler.core import EngineCore
from stride.scheduler.outputs import GenerateRequest, RequestRejected
from stride.scheduler.policy import SchedulerConfig
from tests.helpers.cores import PROMPTS, chi2_pvalue, exact_joint, greedy, joint_pvalue, run
from tests.helpers.models import make_model_dir

K = 4


def timed(spec_cost: float, plain_steps: int) -> Timings:
    """A bucket's costs as measured: a plain step of 1 s and, at every size a step may have
    here, a draft-scoring one of `spec_cost` × that."""
    return Timings(plain_s=1.0, spec_at=dict.fromkeys(range(1, 1024), spec_cost),
                   plain_steps=plain_steps)  # fmt: skip


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory) -> Path:
    """Another random tiny model with the same tokenizer: a draft that is often wrong."""
    return make_model_dir(tmp_path_factory.mktemp("draft") / "other", seed=1)


@pytest.fixture(scope="module")
def blind_dir(tmp_path_factory, tiny_dir) -> Path:
    """A draft whose final norm is zero: all logits tie, so it always drafts token 0."""
    path = make_model_dir(tmp_path_factory.mktemp("draft") / "blind", seed=2)
    file = path / "model.safetensors"
    state = load_file(file)
    state["model.norm.weight"].zero_()
    save_file(state, file, metadata={"format": "pt"})
    return path


def make(model: Path, draft: Path | None = None, kv_bytes: int = 8 << 20, **sched) -> EngineCore:
    engine = Engine(EngineConfig(model=str(model), device="cpu", kv_cache_memory=kv_bytes))
    decoders = build_decoders(engine, DecodersConfig(draft_model=draft and str(draft)))
    return EngineCore(engine, SchedulerConfig(**sched), decoders)


def spec(draft: str, k: int = K, adaptive: bool = False, **extra) -> dict:
    return dict(draft=draft, num_speculative_tokens=k, adaptive=adaptive, **extra)


@pytest.fixture(scope="module")
def reference(tiny_dir) -> dict[int, list[int]]:
    """Plain greedy decoding of every prompt, one request at a time."""
    out = {}
    for i, prompt in enumerate(PROMPTS + [list(range(30, 90))]):
        tokens, _ = run(make(tiny_dir), [GenerateRequest("r", prompt, greedy(24))])
        out[i] = tokens["r"]
    return out


# ---- the rejection rule on synthetic distributions ------------------------------------------


def _sample_rule(p, q, n, wrong=False, seed=0):
    """n runs of the rule with K = len(q); returns the committed tokens per run (≥ 1 each)."""
    g = torch.Generator().manual_seed(seed)
    k, vocab = q.shape
    drafts = torch.multinomial(q, n, replacement=True, generator=g).T  # [n, k]
    u = torch.rand(n, k, generator=g)
    pp, qq = p.expand(n, -1, -1), q.expand(n, -1, -1)
    accepted, dist = verify(pp, qq, drafts, torch.full((n,), k), u)
    if wrong:  # the classic mistake: resample from p instead of the residual
        dist = pp[torch.arange(n), accepted]
    last = torch.multinomial(dist, 1, generator=g)[:, 0]
    return drafts, accepted, last


def _committed_at(pos, drafts, accepted, last):
    """Token committed at draft position `pos` for the runs that got that far."""
    reached = accepted >= pos
    token = torch.where(accepted > pos, drafts[:, min(pos, drafts.shape[1] - 1)], last)
    return token[reached]


@pytest.mark.parametrize("wrong", [False, True])
def test_rejection_rule_reproduces_the_target_distribution(wrong):
    torch.manual_seed(0)
    vocab, k, n = 6, 2, 40_000
    p = torch.softmax(torch.randn(k + 1, vocab) * 1.5, -1)
    q = torch.softmax(torch.randn(k, vocab) * 1.5, -1)
    drafts, accepted, last = _sample_rule(p, q, n, wrong=wrong)
    pvalues = []
    for pos in range(k + 1):
        tokens = _committed_at(pos, drafts, accepted, last)
        observed = torch.bincount(tokens, minlength=vocab).double()
        pvalues.append(chi2_pvalue(observed, p[pos]))
    if wrong:
        assert min(pvalues) < 1e-6, pvalues
    else:
        assert min(pvalues) > 1e-3, pvalues


def test_rejection_rule_edge_cases():
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]])  # greedy target: 1 then 2
    one_hot = torch.eye(3)[None, :1]
    u = torch.full((1, 1), 0.999)
    acc, dist = verify(p, one_hot, torch.tensor([[1]]), torch.tensor([1]), u)
    assert acc.item() == 1 and dist.argmax().item() == 2  # accepted, bonus from the next row
    acc, dist = verify(p, torch.eye(3)[None, 2:], torch.tensor([[2]]), torch.tensor([1]), u)
    assert acc.item() == 0 and dist.argmax().item() == 1  # rejected, residual is the argmax
    acc, dist = verify(p, one_hot, torch.tensor([[1]]), torch.tensor([0]), u)
    assert acc.item() == 0 and torch.equal(dist[0], p[0, 0])  # no real draft: plain p


# ---- greedy: token for token equal to plain decoding ----------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        spec("ngram"),
        spec("early_exit", exit_layer=1),
        spec("early_exit", exit_layer=2),
        spec("ngram", adaptive=True),
        spec("early_exit", k=2, adaptive=True, exit_layer=1),
    ],
    ids=["ngram", "early_exit-1", "early_exit-2", "ngram-adaptive", "early_exit-adaptive"],
)
def test_greedy_equals_plain_decoding_alone(tiny_dir, reference, options):
    core = make(tiny_dir)
    for i, prompt in enumerate(PROMPTS):
        tokens, stats = run(
            core, [GenerateRequest("s", prompt, greedy(24), "speculative", options)]
        )
        assert tokens["s"] == reference[i]
        assert stats["s"]["decoder"] == "speculative"
    assert core.engine.cache.num_free_blocks == core.engine.cache.num_usable_blocks


@pytest.mark.parametrize("draft", ["same", "other", "blind"])
def test_greedy_mixed_batch_with_ar_and_prefill(tiny_dir, other_dir, blind_dir, reference, draft):
    draft_dir = {"same": tiny_dir, "other": other_dir, "blind": blind_dir}[draft]
    core = make(tiny_dir, draft_dir, max_num_batched_tokens=48)
    model = str(draft_dir)
    kinds = [
        ("ar", {}),
        ("speculative", spec("ngram")),
        ("speculative", spec("early_exit", exit_layer=1)),
        ("speculative", spec(model)),
        ("speculative", spec(model, k=3, adaptive=True)),
    ]
    requests = [
        GenerateRequest(f"{i}-{j}", PROMPTS[i], greedy(24), dec, opts)
        for j, (dec, opts) in enumerate(kinds)
        for i in (0, 3)
    ]
    # a long prompt arriving mid-run: chunked prefill shares the steps with speculation
    late = [GenerateRequest("long", list(range(30, 90)), greedy(24), "speculative", spec(model))]
    tokens, stats = run(core, requests, late)
    for r in requests:
        assert tokens[r.request_id] == reference[int(r.request_id.split("-")[0])], r
    assert tokens["long"] == reference[len(PROMPTS)]
    assert core.engine.cache.num_free_blocks == core.engine.cache.num_usable_blocks
    drafter_cache = core.decoders["speculative"].draft_model.engine.cache
    assert drafter_cache.num_free_blocks == drafter_cache.num_usable_blocks
    if draft == "same":  # a perfect drafter: every draft accepted
        assert stats["0-3"]["acceptance_rate"] == 1.0


def test_greedy_under_preemption(tiny_dir, other_dir, reference):
    """A KV cache too small for everyone: preempted sequences drop their draft state too."""
    core = make(tiny_dir, other_dir, kv_bytes=7 * 8192)  # 7 blocks of 16 tokens (6 usable)
    requests = [
        GenerateRequest(str(i), p, greedy(24), "speculative", spec(str(other_dir), k=3))
        for i, p in enumerate(PROMPTS)
    ]
    tokens, _ = run(core, requests)
    assert core.preempted
    for i in range(len(PROMPTS)):
        assert tokens[str(i)] == reference[i]
    drafter = core.decoders["speculative"].draft_model
    assert drafter.engine.cache.num_free_blocks == drafter.engine.cache.num_usable_blocks
    assert not drafter.cursors
    assert core.engine.cache.num_free_blocks == core.engine.cache.num_usable_blocks


def test_perfect_and_always_wrong_drafters(tiny_dir, blind_dir, reference):
    n = 4 * (K + 1)
    perfect = make(tiny_dir, tiny_dir)
    for draft in (str(tiny_dir), "early_exit"):
        options = spec(draft, exit_layer=2) if draft == "early_exit" else spec(draft)
        tokens, stats = run(
            perfect, [GenerateRequest("p", PROMPTS[1], greedy(n), "speculative", options)]
        )
        assert stats["p"]["mean_accepted_length"] == K + 1
        assert stats["p"]["accepted_per_position"] == [4] * K
        assert tokens["p"] == reference[1][:n]

    assert 0 not in reference[1]  # the blind draft's token 0 is never the target's choice
    wrong = make(tiny_dir, blind_dir)
    tokens, stats = run(
        wrong, [GenerateRequest("w", PROMPTS[1], greedy(24), "speculative", spec(str(blind_dir)))]
    )
    assert stats["w"]["mean_accepted_length"] == 1.0
    assert stats["w"]["accepted_tokens"] == 0 and stats["w"]["draft_tokens"] > 0
    assert tokens["w"] == reference[1]


# ---- the KV caches after speculation hold exactly what plain prefill computes ----------------


def _prefill_kv(engine: Engine, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    seq = Sequence("probe", tokens, SamplingParams())
    engine.cache.reserve(seq, len(tokens))
    engine.runner.forward([Span(seq, tokens, 1)])
    slots = torch.tensor(engine.cache.slots(seq, 0, len(tokens)))
    kv = engine.cache.k[:, slots].clone(), engine.cache.v[:, slots].clone()
    engine.cache.free(seq)
    return kv


def _step_until(core: EngineCore, rid: str, n_out: int) -> Sequence:
    while core.seqs[rid].num_output_tokens < n_out:
        core.step()
    return core.seqs[rid]


def test_early_exit_shares_the_target_kv_cache_correctly(tiny_dir):
    """Draft KV written into layers < L is overwritten by verification; committed KV is exact."""
    core = make(tiny_dir)
    core.add(
        GenerateRequest(
            "s", PROMPTS[0], greedy(40), "speculative", spec("early_exit", exit_layer=1)
        )
    )
    seq = _step_until(core, "s", 20)
    n = seq.num_cached
    slots = torch.tensor(core.engine.cache.slots(seq, 0, n))
    got_k, got_v = core.engine.cache.k[:, slots], core.engine.cache.v[:, slots]
    fresh = Engine(EngineConfig(model=str(tiny_dir), device="cpu", kv_cache_memory=1 << 20))
    want_k, want_v = _prefill_kv(fresh, seq.token_ids[:n])
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got_v, want_v, atol=1e-5, rtol=1e-4)


def test_draft_model_kv_rolls_back_to_the_accepted_prefix(tiny_dir, other_dir):
    core = make(tiny_dir, other_dir)
    core.add(GenerateRequest("s", PROMPTS[2], greedy(40), "speculative", spec(str(other_dir))))
    seq = _step_until(core, "s", 20)
    assert seq.stats.draft_tokens > seq.stats.accepted_tokens  # there were rejections
    drafter = core.decoders["speculative"].draft_model
    cursor = drafter.cursors["s"].kv
    n = cursor.num_cached
    assert n <= seq.num_tokens
    slots = torch.tensor(drafter.engine.cache.slots(cursor, 0, n))
    fresh = Engine(EngineConfig(model=str(other_dir), device="cpu", kv_cache_memory=1 << 20))
    want_k, want_v = _prefill_kv(fresh, seq.token_ids[:n])
    torch.testing.assert_close(drafter.engine.cache.k[:, slots], want_k, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(drafter.engine.cache.v[:, slots], want_v, atol=1e-5, rtol=1e-4)


# ---- sampling end to end: the joint distribution of two tokens ------------------------------


@pytest.mark.parametrize("draft", ["other", "early_exit"])
def test_sampled_output_follows_the_target_distribution(tiny_dir, tiny_hf, other_dir, draft):
    prompt, n = PROMPTS[2], 1200
    params = SamplingParams(max_tokens=2, temperature=1.5, top_k=4, ignore_eos=True)
    options = (
        spec(str(other_dir), k=2) if draft == "other" else spec("early_exit", k=2, exit_layer=1)
    )
    core = make(tiny_dir, other_dir, max_waiting=n)
    requests = [  # seeded: each request's draws are keyed by its own seed
        GenerateRequest(str(i), prompt, replace(params, seed=i), "speculative", options)
        for i in range(n)
    ]
    tokens, stats = run(core, requests)
    assert sum(s.get("draft_tokens", 0) for s in stats.values()) > 0
    pvalue = joint_pvalue(tokens, exact_joint(tiny_hf, prompt, params))
    print(f"chi-square p-value {pvalue:.3g}")
    assert pvalue > 1e-3
    # The same test rejects a wrong distribution: the target's at a lower temperature.
    wrong = exact_joint(tiny_hf, prompt, SamplingParams(temperature=0.8, top_k=4))
    wrong_pvalue = joint_pvalue(tokens, wrong)
    print(f"wrong distribution: p-value {wrong_pvalue:.3g}")
    assert wrong_pvalue < 1e-3


# ---- admission and the adaptive policy -----------------------------------------------------


def test_invalid_options_are_rejected_naming_valid_drafters(tiny_dir):
    core = make(tiny_dir)
    bad = [
        ({"draft": "nope"}, "valid drafters: ngram, early_exit"),
        ({"num_speculative_tokens": -1}, "num_speculative_tokens"),
        ({"adaptive": "yes"}, "adaptive"),
        ({"draft": "ngram", "exit_layer": 1}, "exit_layer"),
        ({"draft": "early_exit", "exit_layer": 9}, "exit_layer"),
        ({"colour": 1}, "has no option 'colour'; valid options: draft, num_speculative_tokens"),
        ({"draft": ["ngram"]}, "draft"),
        ({"num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"ngram_max": 4.0}, "ngram_max"),
    ]
    for options, message in bad:
        with pytest.raises(RequestRejected, match=message):
            core.add(GenerateRequest("x", [5], greedy(2), "speculative", options))
    assert not core.seqs


def test_adaptive_policy_speculates_only_when_it_pays():
    cpu = StepCosts(saturation=16)
    assert choose_k(0.8, 1, 4, cpu) == 4
    assert choose_k(0.8, 64, 4, cpu) == 0  # compute-bound: extra tokens cost as much as steps
    assert choose_k(0.05, 1, 4, replace(cpu, draft=0.5)) == 0  # drafts rarely pass
    assert choose_k(0.8, 1, 4, replace(cpu, draft=1.0)) == 0  # a drafter as dear as the target
    # measured: plain steps replay CUDA graphs, draft-scoring steps run eagerly at 5x the time
    assert choose_k(0.8, 1, 4, StepCosts(256, plain=1.0, spec=5.0)) == 0
    gpu = [choose_k(0.7, b, 6, StepCosts(256, draft=0.1)) for b in (1, 64, 512)]
    assert gpu[0] >= gpu[1] >= gpu[2] and gpu[0] > 0 and gpu[2] == 0


def test_adaptive_policy_prices_a_pass_by_what_its_row_count_measured():
    """A CPU whose products cost one row's up to 3 rows and twice that from 4 (MKL): measured,
    that step is what the policy prices, not the saturation's straight line."""
    cpu = StepCosts(saturation=16, draft=0.02)
    assert choose_k(0.6, 1, 6, cpu) == 3  # the straight line: 4 rows look cheap
    measured = {t: (1.0 if t <= 3 else 2.2) / (1 + t / 16) for t in range(2, 8)}
    assert choose_k(0.6, 1, 6, replace(cpu, spec_at=measured)) == 2
    # a row count nobody measured is priced from the largest one measured below it
    assert choose_k(0.6, 1, 6, replace(cpu, spec_at={2: measured[2]})) == 3
    assert replace(cpu, spec_at={2: 0.5}).scoring(3) == 0.5 * (1 + 3 / 16)
    # ... else from the smallest measured above it
    assert replace(cpu, spec_at={4: 2.5, 6: 3.0}).scoring(2) == 2.5 * (1 + 2 / 16)


def test_a_drafting_steps_measured_cost_leaves_its_drafts_to_the_drafters_price():
    """A drafting step's wall time holds its drafters' forwards; `draft` prices those, so the
    scoring pass's measured cost must not hold them a second time."""
    policy, drafter = AdaptivePolicy(saturation=16), NgramDrafter()
    ctx = StepContext(eos_ids=set(), device=torch.device("cpu"))
    ctx.timing = 1 + 1 / 16  # a plain step of one row: 1 s per token-count factor
    for _ in range(policy.PLAIN_WARMUP):
        policy.measured(1, 1, False, ctx)
    policy.proposed(1, StepPlans(reserved=True, planned=True), quiet=False, pays=True)
    policy.drafter_timed(drafter, 0.25, positions=1, rows=1)
    ctx.timing = 0.25 + (1 + 2 / 16)  # the drafter's forward, then a 2-row pass as dear as 1
    policy.measured(1, 2, True, ctx)
    assert policy.seen.timings[bucket(1)].spec_at[2] == pytest.approx(1.0)
    assert policy.costs(drafter, 1).draft == pytest.approx(0.25 / (1 + 1 / 16))


def test_the_smallest_draft_scoring_pass_is_measured_first():
    """While nothing is measured at a batch size, a sequence drafts one token at most: on a CPU
    whose 4-row pass costs 3 plain ones, a first measurement of that pass would price the cheap
    2-row one (priced from the nearest size measured) out of ever being tried."""
    policy, drafter = AdaptivePolicy(saturation=16), NgramDrafter()
    ctx = StepContext(eos_ids=set(), device=torch.device("cpu"))

    def step(tokens: int, cost: float) -> None:
        ctx.timing = cost * (1 + tokens / 16)
        policy.proposed(1, StepPlans(reserved=tokens > 1), quiet=False, pays=tokens > 1 or None)
        policy.measured(1, tokens, tokens > 1, ctx)

    for _ in range(policy.PLAIN_WARMUP):
        step(1, 1.0)
    assert policy.choose(0.9, 1, 6, drafter) == 1
    step(2, 1.0)
    assert policy.choose(0.9, 1, 6, drafter) > 1  # measured: the rest priced from it
    step(4, 3.0)
    costs = policy.costs(drafter, 1)
    assert costs.scoring(3) == pytest.approx(1 + 3 / 16)  # from the 2-row pass
    assert costs.scoring(5) == pytest.approx(3.0 * (1 + 5 / 16))  # from the 4-row pass
    assert policy.choose(0.6, 1, 6, drafter) == 2


def test_a_step_drafts_only_if_its_drafts_pay_for_it_at_this_batch_size(tiny_dir):
    """Injected step costs per batch size: what drafting costs, not when, decides K."""
    engine = Engine(EngineConfig(model=str(tiny_dir), device="cpu", kv_cache_memory=8 << 20))
    dec = Speculative(engine, saturation_tokens=256)  # a GPU's saturation
    ctx = StepContext(eos_ids=set(), device=torch.device("cpu"))
    repeats, plain = [5, 6, 7, 8] * 4, list(range(20, 36))  # a prompt-lookup hit; none

    def step(
        batch: int,
        spec_cost: float,
        hits: int,
        alpha_good: bool,
        probe: bool = False,
        keep_hold: bool = False,
    ):
        """Draft tokens per sequence of one step at `batch` whose drafting step measured
        `spec_cost` × a plain one; `hits` sequences find an n-gram to draft."""
        dec.policy.seen.timings[bucket(batch)] = timed(spec_cost, dec.policy.PLAIN_WARMUP)
        dec.policy.choices.clear()
        dec.policy.seen.batch = batch
        dec.policy.seen.hold = dec.policy.seen.hold if keep_hold else None
        dec.policy.seen.idle = None
        dec.quiet = False
        seqs = []
        for i in range(batch):
            seq = Sequence(f"s{i}", repeats if i < hits else plain, greedy(8), "speculative")
            seq.decoder_options = dec.validate(seq.params, {"draft": "ngram"})
            state = dec.state(seq)
            state.runs.reached = [10.0] * K
            state.runs.passed = [10.0 if alpha_good else 0.0] * K
            policy = dec.policy  # the probe phase:
            state.born = policy.seen.steps + 1 - policy.PROBE_EVERY if probe else policy.seen.steps
            dec.extra_tokens(seq, cap=K)
            seqs.append(seq)
        reserved = [dec.state(s).reserved for s in seqs]
        return reserved, [len(p.tokens) for p in dec.propose(seqs, ctx)]

    # Batch 1: a drafting step 1.3x a plain one pays for good drafts, and for a probe.
    reserved, drafted = step(1, 1.3, hits=1, alpha_good=True)
    assert drafted[0] > 0
    assert step(1, 1.3, hits=1, alpha_good=False, probe=True)[1] == [K]  # all K: cheap here
    # ... but not at 5x, even for drafts accepted 93 % of the time: K = 0.
    assert step(1, 5.0, hits=1, alpha_good=True)[1] == [0]
    # Batch 64, all sequences drafting good drafts, scoring steps as dear as plain ones: K > 0.
    assert min(step(64, 1.0, hits=64, alpha_good=True)[1]) > 0
    # Batch 64, only 4 sequences find drafts: each would pay alone, but their few extra tokens
    # do not pay for a draft-scoring step of 64 rows measured at 1.3x a plain one.
    reserved, drafted = step(64, 1.3, hits=4, alpha_good=True)
    assert sum(reserved) > 0 and sum(drafted) == 0
    # ... and the next steps at this batch size do not even reserve (or look up) drafts.
    seq = Sequence("again", repeats, greedy(8), "speculative")
    seq.decoder_options = dec.validate(seq.params, {"draft": "ngram"})
    dec.state(seq).runs.reached = dec.state(seq).runs.passed = [10.0] * K
    assert dec.extra_tokens(seq, cap=K) == 0
    # When the hold ends, the check runs again; failing again, it holds twice as long.
    held, until = dec.policy.seen.hold
    assert until == dec.policy.seen.steps + dec.policy.PROBE_EVERY
    dec.policy.seen.steps = until
    reserved, drafted = step(64, 1.3, hits=4, alpha_good=True, keep_hold=True)
    assert sum(reserved) > 0 and sum(drafted) == 0
    assert dec.policy.seen.hold == (held, until + 2 * dec.policy.PROBE_EVERY)
    dec.policy.seen.steps = 0
    # Batch 64, probes of 4 sequences (the module's failure on the GPU): none even at 1.0x.
    reserved, drafted = step(64, 1.0, hits=4, alpha_good=False, probe=True)
    assert reserved[:4] == [1] * 4 and sum(drafted) == 0
    # The same probes in a batch of 1 still run: there they are the whole step.
    assert StepCosts(256, spec=1.3).step_gain(1, [(0.9, 1)]) > 1.05
    assert StepCosts(256, spec=1.0).step_gain(64, [(0.9, 1)] * 4) < 1.05


def test_a_quiet_step_proposes_nothing_and_commits_like_ar(tiny_dir):
    """A step at K = 0 for every adaptive sequence (here: a hold at this batch size) asks no
    drafter, proposes nothing and commits exactly what `ar` commits; fixed K still drafts."""
    engine = Engine(EngineConfig(model=str(tiny_dir), device="cpu", kv_cache_memory=8 << 20))
    dec = Speculative(engine, saturation_tokens=256)
    ctx = StepContext(eos_ids=set(), device=torch.device("cpu"))
    repeats = [5, 6, 7, 8] * 4  # prompt lookup finds drafts here

    def batch() -> list[Sequence]:
        seqs = []
        for i in range(8):
            params = SamplingParams(max_tokens=8, temperature=0.0 if i % 2 else 0.9, seed=i)
            params.logprobs = 2 if i == 3 else None
            seq = Sequence(f"s{i}", repeats, params, "speculative")
            seq.decoder_options = dec.validate(params, {"draft": "ngram"})
            seqs.append(seq)
        return seqs

    seqs, twins = batch(), batch()
    for seq in seqs:
        dec.state(seq).runs.reached = dec.state(seq).runs.passed = [10.0] * K  # would draft
    warm = dec.policy.PLAIN_WARMUP
    dec.policy.seen.timings[bucket(8)] = timed(1.0, warm)
    # An earlier step found drafts would not pay:
    dec.policy.seen.hold = (bucket(8), dec.policy.seen.steps + 100)
    dec.policy.seen.batch = 8
    dec.quiet = dec.policy.quiet_at(8)
    assert dec.quiet

    def no_lookup(*args):
        raise AssertionError("a quiet step looked up drafts")

    drafter = dec.state(seqs[0]).drafter
    drafter.available = drafter.draft = no_lookup
    assert [dec.extra_tokens(s, cap=K) for s in seqs] == [0] * 8
    proposals = dec.propose(seqs, ctx)
    assert all(not p.tokens and p.positions is None and p.mask is None for p in proposals)
    logits = [torch.randn(1, engine.hf_config.vocab_size) for _ in seqs]
    ours = dec.commit(seqs, proposals, Scored(logits=logits), ctx)
    theirs = Autoregressive().commit(twins, [Proposal()] * 8, Scored(logits=logits), ctx)
    assert [(c.tokens, c.logprobs, c.kv_keep) for c in ours] == [
        (c.tokens, c.logprobs, c.kv_keep) for c in theirs
    ]
    # A request with a fixed K is not the policy's to silence: it drafts in a quiet step too.
    fixed = Sequence("fixed", repeats, greedy(8), "speculative")
    fixed.decoder_options = dec.validate(fixed.params, spec("ngram", ngram_max=2))
    assert dec.quiet and dec.extra_tokens(fixed, cap=K) == K


def test_plain_proposals_promise_quiet_steps_up_to_the_next_plan(tiny_dir):
    """A quiet step's proposal promises plain steps up to the end of the quiet period (so the
    executor may run them as bursts), never past a drafting step, steps that time plain
    decoding, or a fixed-K request's next step; committing plain steps counts them."""
    engine = Engine(EngineConfig(model=str(tiny_dir), device="cpu", kv_cache_memory=8 << 20))
    dec = Speculative(engine, saturation_tokens=256)
    ctx = StepContext(eos_ids=set(), device=torch.device("cpu"))

    def request(prompt=(5, 6, 7, 8) * 4, **options) -> Sequence:
        seq = Sequence("s", list(prompt), greedy(64), "speculative")
        seq.decoder_options = dec.validate(seq.params, {"draft": "ngram", **options})
        return seq

    def proposals(*seqs: Sequence) -> list[Proposal]:
        for s in seqs:
            dec.extra_tokens(s, cap=K)
        return dec.propose(list(seqs), ctx)

    def plain_steps(*seqs: Sequence) -> int:
        props = proposals(*seqs)
        assert all(p.plain for p in props)
        return props[0].plain_steps

    def run_plain(seq: Sequence, steps: int) -> None:
        dec.commit([seq], [Proposal()], Scored(tokens=[[9] * steps]), ctx)

    seq = request()
    assert plain_steps(seq) == 1  # plain decoding is being timed: one step at a time
    warm = dec.policy.PLAIN_WARMUP
    dec.policy.seen.timings[bucket(1)] = timed(1.0, warm)
    dec.policy.seen.hold = (bucket(1), dec.policy.seen.steps + 10)
    assert plain_steps(seq) == 10 and plain_steps(seq, request()) == 1
    run_plain(seq, 4)
    assert dec.policy.seen.steps == 4 and dec.quiet and plain_steps(seq) == 6
    run_plain(seq, 6)
    assert not dec.quiet  # the re-check is due: the next step plans
    assert any(p.tokens for p in proposals(seq))
    assert plain_steps(request(num_speculative_tokens=0)) > 8  # never drafts
    nothing_to_look_up = (5, 6, 7, 8, 9, 10)
    assert plain_steps(request(nothing_to_look_up, adaptive=False)) == 1  # its next may draft


def test_a_plain_steps_measured_cost_counts_its_own_forward(tiny_dir, monkeypatch):
    """What the adaptive policy prices drafts against, a plain step's time, runs from when its
    step began (here, on a CPU, the forward runs inside the launch), not from the launch's end."""
    core = make(tiny_dir)
    runner = core.engine.runner
    forward = runner.forward

    def slow(*args, **kwargs):
        time.sleep(0.05)
        return forward(*args, **kwargs)

    monkeypatch.setattr(runner, "forward", slow)
    options = spec("ngram", adaptive=True)
    run(core, [GenerateRequest("s", PROMPTS[1], greedy(6), "speculative", options)])
    timings = core.decoders["speculative"].policy.seen.timings[bucket(1)]
    assert timings.plain_steps >= 3
    assert timings.plain_s * (1 + 1 / core.decoders["speculative"].policy.saturation) >= 0.05


def test_drafting_that_loses_on_the_clock_gives_way_to_plain_epochs(tiny_dir):
    """Whatever the policy's cost model says, adaptive requests drafted on the host draft only
    while drafting makes more tokens per second of wall time than plain steps (`payoff`): here
    the payoff's clock is the test's, on which a commit costs 1 ms and each step of a drafting
    epoch 50 ms more (work the policy does not price; every step of the epoch, since whether
    prompt lookup finds a draft depends on the text), so after the first epochs drafting is only
    tried now and then; the tokens are `ar`'s, and a request of a fixed K still drafts."""
    core = make(tiny_dir, fused_decode_steps=4)
    dec = core.decoders["speculative"]
    # K from sizes, not from this machine's clock: under load a step of a drafting epoch could
    # choose K = 0, which restarts the epoch and stretches it past the bound below
    dec.policy.measure_costs = False
    payoff = dec.payoffs[False]  # (the epochs of requests drafted on the host)
    propose, commit, drafting, now = dec.propose, dec.commit, [], [0.0]
    payoff.clock = lambda: now[0]

    def proposed(seqs, ctx):
        out = propose(seqs, ctx)
        drafting.append(any(p.tokens for p in out))
        return out

    def committed(seqs, proposals, scored, ctx):
        now[0] += 0.051 if payoff.refining else 0.001
        return commit(seqs, proposals, scored, ctx)

    dec.propose, dec.commit = proposed, committed
    prompt = [5, 6, 7, 8, 9, 10] * 6  # prompt lookup drafts
    ref, _ = run(make(tiny_dir), [GenerateRequest("a", prompt, greedy(400))])
    options = spec("ngram", adaptive=True)
    out, _ = run(core, [GenerateRequest("a", prompt, greedy(400), "speculative", options)])
    assert out == ref
    assert payoff.epochs >= 3 and payoff.rates[bucket(1)][False] > payoff.rates[bucket(1)][True]
    assert 0 < sum(drafting) <= len(drafting) // 8  # the first epoch, then tries only
    fixed = GenerateRequest("f", prompt, greedy(24), "speculative", spec("ngram"))
    out, stats = run(core, [fixed])
    assert out["f"] == ref["a"][:24] and stats["f"]["draft_tokens"] > 0


def test_adaptive_backs_off_when_drafts_fail(tiny_dir, reference):
    """Early exit after one of two layers is cheap but poor here: K falls to 0, with probes."""
    engine = Engine(EngineConfig(model=str(tiny_dir), device="cpu", kv_cache_memory=8 << 20))
    decoders = build_decoders(engine)
    # a flat target cost and costs from sizes, not clocks: the test must not depend on timing
    decoders["speculative"] = Speculative(engine, saturation_tokens=1e9, measure_costs=False)
    core = EngineCore(engine, SchedulerConfig(), decoders)
    options = spec("early_exit", exit_layer=1, adaptive=True)
    tokens, stats = run(
        core, [GenerateRequest("s", PROMPTS[1], greedy(24), "speculative", options)]
    )
    assert tokens["s"] == reference[1]
    drafted = stats["s"]["draft_tokens"]
    assert 0 < drafted < stats["s"]["forward_passes"] // 2


class BurstyDrafter(Drafter):
    """All or nothing: every `every`-th pass of a sequence drafts the target's own next tokens,
    the others token 0, which the target never picks (0 every time: `every` = 0)."""

    name = "bursty"

    def __init__(self, truth: list[int], every: int) -> None:
        self.truth, self.every, self.passes = truth, every, {}

    def draft(self, seqs, ks, eos_ids):
        drafts = []
        for seq, k in zip(seqs, ks, strict=True):
            n = self.passes[seq.request_id] = self.passes.get(seq.request_id, 0) + 1
            good = self.every and n % self.every == 0
            at = seq.num_tokens
            drafts.append(Draft(self.truth[at : at + k] if good else [0] * k))
        return drafts


def _bursty_run(tiny_dir, truth, every: int, batch: int, spec_cost: float, n: int):
    """`batch` adaptive requests drafted by a BurstyDrafter, at step costs fixed by hand (a
    draft-scoring step `spec_cost` × a plain one, GPU saturation); tokens and summed stats."""
    engine = Engine(EngineConfig(model=str(tiny_dir), device="cpu", kv_cache_memory=32 << 20))
    decoders = build_decoders(engine)
    dec = Speculative(engine, saturation_tokens=256, measure_costs=False)
    dec.policy.costs = lambda drafter, b: StepCosts(256, spec=spec_cost)
    dec.drafters[("ngram", 3)] = BurstyDrafter(truth, every)
    decoders["speculative"] = dec
    core = EngineCore(engine, SchedulerConfig(), decoders)
    options = spec("ngram", adaptive=True)
    requests = [
        GenerateRequest(f"r{i}", PROMPTS[1], greedy(n), "speculative", options)
        for i in range(batch)
    ]
    tokens, stats = run(core, requests)
    totals = {
        key: sum(s.get(key, 0) for s in stats.values()) for key in ("drafts", "forward_passes")
    }
    assert core.engine.cache.num_free_blocks == core.engine.cache.num_usable_blocks
    return tokens, totals


def test_adaptive_prices_bursty_drafts_by_their_measured_run_lengths(tiny_dir):
    """A drafter right on one pass in three, then for all K = 4 drafts: 1/3 of its drafts pass,
    yet a pass commits 1 + 4/3 ≈ 2.3 tokens, which pays for a scoring step 1.75x a plain one.
    A geometric model fitted to what K = 1 probes see (a ≈ 1/3: E(4) ≈ 1.5) would stop
    drafting; priced per position (the first draft passes 1/3 of the time, the ones after it
    always), the policy keeps drafting. A drafter that is always wrong settles at K = 0, and so
    does one that commits ~1.07 tokens per pass in a batch of 64 whose scoring steps cost 1.7x
    (the GPU's numbers): there drafting does not pay."""
    n = 48
    plain, _ = run(make(tiny_dir), [GenerateRequest("r", PROMPTS[1], greedy(n))])
    truth = PROMPTS[1] + plain["r"]
    assert 0 not in plain["r"]

    tokens, bursty = _bursty_run(tiny_dir, truth, every=3, batch=1, spec_cost=1.75, n=n)
    assert tokens["r0"] == plain["r"]
    assert bursty["drafts"] >= 10 and bursty["forward_passes"] <= 0.7 * n  # it drafted

    tokens, wrong = _bursty_run(tiny_dir, truth, every=0, batch=1, spec_cost=1.75, n=n)
    assert tokens["r0"] == plain["r"]
    assert 0 < wrong["drafts"] <= n // 8  # a first try and rare probes: K = 0

    tokens, large = _bursty_run(tiny_dir, truth, every=57, batch=64, spec_cost=1.7, n=24)
    assert all(t == plain["r"][:24] for t in tokens.values())
    assert large["drafts"] == 0  # (its probes, one draft each, do not pay for a scoring step)
