"""Masked diffusion decoding: exact pass counts with an oracle; a tiny random BERT end to end."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from stride.decoders.autoregressive import Autoregressive
from stride.decoders.base import DecodersConfig
from stride.decoders.diffusion import DiffusionGroup
from stride.decoders.refine import Refine
from stride.engine.config import EngineConfig
from stride.engine.diffusion import DiffusionModel
from stride.engine.engine import Engine
from stride.engine.sequence import SamplingParams
from stride.scheduler.core import EngineCore
from stride.scheduler.outputs import GenerateRequest, RequestRejected
from tests.helpers.cores import run
from tests.helpers.models import VOCAB_SIZE, make_diffusion_dir

MASK = VOCAB_SIZE  # the tiny tokenizer plus one added mask token
PATTERN = [0.9, 0.5, 0.95, 0.6]  # the oracle's confidence at each offset of a 4-token block


class Oracle(nn.Module):
    """Predicts token `oracle_token(p)` at position p with confidence PATTERN[p % 4], whatever
    the context; `favour_mask` puts most of the mass on the mask token instead."""

    def __init__(self, favour_mask: bool = False) -> None:
        super().__init__()
        self.favour_mask = favour_mask

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> SimpleNamespace:
        b, n = input_ids.shape
        pos = torch.arange(n)
        conf = torch.tensor(PATTERN)[pos % 4]
        probs = ((1 - conf) / VOCAB_SIZE)[:, None].repeat(1, VOCAB_SIZE + 1)
        probs[pos, oracle_token(pos)] = conf
        if self.favour_mask:
            probs[:, MASK] = 0.99
        return SimpleNamespace(logits=probs.log()[None].repeat(b, 1, 1))


def oracle_token(pos):
    return (pos * 7) % 300 + 10


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def engine(tiny_dir) -> Engine:
    return Engine(EngineConfig(model=str(tiny_dir), device="cpu", kv_cache_memory=16 << 20))


def oracle_core(engine: Engine, favour_mask: bool = False) -> EngineCore:
    model = DiffusionModel(Oracle(favour_mask), MASK, torch.device("cpu"))
    group = DiffusionGroup(model, vocab_limit=VOCAB_SIZE)
    return EngineCore(engine, decoders={"ar": Autoregressive(), "refine": Refine(group)})


def diffusion(rid: str, prompt: list[int], params: SamplingParams, **opts) -> GenerateRequest:
    return GenerateRequest(rid, prompt, params, "refine", {"method": "diffusion", **opts})


@pytest.mark.parametrize(
    "threshold, max_iterations, passes_per_block",
    [
        (0.8, 4, 3),  # offsets 0 and 2 pass the threshold; then 3, then 1
        (0.8, 2, 2),  # the second pass unmasks whatever is left
        (0.4, 4, 1),  # everything passes at once
        (1.0, 4, 4),  # one token a pass
    ],
)
def test_oracle_iteration_count(engine, threshold, max_iterations, passes_per_block):
    core = oracle_core(engine)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]  # a multiple of 4: blocks line up with PATTERN
    opts = dict(block_size=4, threshold=threshold, max_iterations=max_iterations)
    got, stats = run(core, [diffusion("d", prompt, greedy(12), **opts)])
    assert got["d"] == [oracle_token(p) for p in range(8, 20)]
    assert stats["d"]["forward_passes"] == 3 * passes_per_block
    assert stats["d"]["tokens_per_pass"] == pytest.approx(12 / (3 * passes_per_block), abs=1e-3)


def test_oracle_streams_in_order(engine):
    """Offset 0 is ready after the first pass, offsets 1-3 only after the third."""
    core = oracle_core(engine)
    core.add(diffusion("d", [1, 2, 3, 4], greedy(4), block_size=4, threshold=0.8))
    chunks = [out.token_ids for _ in range(3) for out in core.step() if out.token_ids]
    assert chunks == [[oracle_token(4)], [oracle_token(p) for p in (5, 6, 7)]]
    assert not core.has_work


def test_no_mask_token_reaches_the_output(engine):
    core = oracle_core(engine, favour_mask=True)
    params = [greedy(10), SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)]
    got, _ = run(core, [diffusion(str(i), [1, 2, 3], p) for i, p in enumerate(params)])
    for tokens in got.values():
        assert len(tokens) == 10 and MASK not in tokens


def test_a_failing_group_step_fails_only_its_culprit(engine):
    """A model group's batched step is bisected like a decoder's calls (see core)."""
    core = oracle_core(engine)
    group = core.decoders["refine"].diffusion
    step = group.step

    def tripped(seqs, ctx):
        if any(s.prompt_ids[0] == 3 for s in seqs):
            raise RuntimeError("injected group failure")
        return step(seqs, ctx)

    group.step = tripped
    prompts = {str(i): [5, 6, 7, 8][: 1 + i % 4] for i in range(5)}
    reqs = [diffusion(rid, p, greedy(6), block_size=4) for rid, p in prompts.items()]
    for r in [*reqs, diffusion("poisoned", [3, 4], greedy(6), block_size=4)]:
        core.add(r)
    tokens, ends = {}, {}
    while core.has_work:
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                ends[out.request_id] = out
    assert ends.pop("poisoned").error.code == "internal_error"
    for rid, p in prompts.items():
        assert ends[rid].finish_reason == "length"
        assert tokens[rid] == [oracle_token(q) for q in range(len(p), len(p) + 6)]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    return make_diffusion_dir(tmp_path_factory.mktemp("bert"))


@pytest.fixture(scope="module")
def bert_core(engine, bert_dir) -> EngineCore:
    refine = Refine.from_config(engine, DecodersConfig(diffusion_model=str(bert_dir)))
    return EngineCore(engine, decoders={"ar": Autoregressive(), "refine": refine})


def test_random_bert_one_token_per_pass_at_threshold_one(bert_core):
    tok = bert_core.engine.tokenizer
    prompts = [tok.encode("Hello, world!"), tok.encode("def add(a, b):")]
    reqs = [
        diffusion(str(i), p, greedy(10), block_size=4, threshold=1.0) for i, p in enumerate(prompts)
    ]
    got, stats = run(bert_core, reqs)
    for i in range(2):
        assert len(got[str(i)]) == 10 and MASK not in got[str(i)]
        assert stats[str(i)]["forward_passes"] == 10


def test_random_bert_seeded_runs_reproduce(bert_core):
    """Same seed, same output: alone, and again batched with other diffusion and AR requests."""
    tok = bert_core.engine.tokenizer
    prompt = tok.encode("Once upon a time")
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7)
    alone, _ = run(bert_core, [diffusion("s", prompt, params, block_size=5, threshold=0.3)])
    ar_alone, _ = run(bert_core, [GenerateRequest("ar", prompt, greedy(8))])
    others = [
        diffusion("o", tok.encode("Hello"), SamplingParams(max_tokens=9, temperature=1.0)),
        GenerateRequest("ar", prompt, greedy(8)),
        GenerateRequest("j", prompt, greedy(8), "refine", {"method": "jacobi", "window": 4}),
    ]
    mixed, _ = run(
        bert_core, [diffusion("s", prompt, params, block_size=5, threshold=0.3)] + others
    )
    assert mixed["s"] == alone["s"] and MASK not in alone["s"]
    assert mixed["ar"] == mixed["j"] == ar_alone["ar"]


def test_validation(engine, bert_core):
    with pytest.raises(RequestRejected, match="--diffusion-model"):
        EngineCore(engine, decoders={"refine": Refine()}).add(diffusion("x", [1, 2], greedy(4)))
    for bad in ({"threshold": 0}, {"threshold": 1.5}, {"block_size": 0}, {"steps": 3}):
        with pytest.raises(RequestRejected):
            bert_core.add(diffusion("x", [1, 2], greedy(4), **bad))
    assert not bert_core.has_work


def test_tokenizer_mismatch_is_refused(engine, bert_dir):
    class Other:
        def get_vocab(self) -> dict[str, int]:
            return {"hello": 3, "world": 999}

        def __len__(self) -> int:
            return 1000

    with pytest.raises(ValueError, match="tokenizer"):
        DiffusionGroup.load(str(bert_dir), Other(), torch.device("cpu"), None, False)
    with pytest.raises(ValueError, match="local directory"):
        DiffusionModel.load("some-org/llada-8b", torch.device("cpu"))


def test_a_causal_lm_is_no_diffusion_model(tiny_dir):
    with pytest.raises(ValueError, match="--trust-remote-code"):
        DiffusionModel.load(tiny_dir, torch.device("cpu"))
