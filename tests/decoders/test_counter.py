"""The counter-based generator and the sampler built on it: fixed values (what CUDA must give
too), uniforms strictly inside (0, 1), and draws that follow the truncated distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stride.decoders import counter, sampling
from stride.engine.sequence import SamplingParams, Sequence
from tests.helpers.cores import chi2_pvalue

VOCAB = 49152
SEEDS = [0, 1234, 2**64 - 1, 7]
POSITIONS = [0, 5, 100, 2**31]
KEYS = [1927978566, 4153945915, 3066289685, 2348941654]  # of SEEDS at POSITIONS, TARGET stream
TOKENS = [0, 1, 49151]
UNIFORMS = [  # of KEYS and TOKENS
    [0.929432213306427, 0.5736374258995056, 0.5953579545021057],
    [0.2907645106315613, 0.9945775866508484, 0.25075215101242065],
    [0.7663529515266418, 0.4859852194786072, 0.7326721549034119],
    [0.7174013257026672, 0.9256672263145447, 0.16055339574813843],
]


def expected_uniforms(device: str) -> None:
    """The fixed values on `device` (bit for bit: integer hashing, exact float conversion)."""
    keys = counter.keys(SEEDS, np.array(POSITIONS))
    assert keys.tolist() == KEYS
    keys_t = torch.from_numpy(keys)[:, None].to(device)
    tokens = torch.tensor([TOKENS] * len(SEEDS), device=device)
    got = counter.uniforms(keys_t, tokens, VOCAB)
    assert got.cpu().tolist() == UNIFORMS
    whole = counter.uniforms(keys_t, None, VOCAB)  # every token at once: the same numbers
    assert whole[:, TOKENS].cpu().tolist() == UNIFORMS


def test_fixed_values():
    expected_uniforms("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fixed_values_on_cuda_and_the_same_draws():
    """CUDA's uniforms are the CPU's bit for bit, and a batch of draws (every kind of
    truncation, greedy rows) picks the same tokens from the same logits."""
    expected_uniforms("cuda")
    torch.manual_seed(3)
    logits = torch.randn(64, 1000) * 2
    seqs = [Sequence(f"s{i}", [1], params) for i, params in enumerate(list(CASES.values()) * 12)]
    seqs += [Sequence("g", [1], SamplingParams(temperature=0.0))] * 4
    for mixed in (seqs, seqs[1:2] * 64, seqs[0:1] * 64):  # sort, top-k, whole-vocabulary paths
        on = [
            sampling.device_sample(logits.to(dev), sampling.settings(mixed, [7] * 64, dev, 2), 1)
            for dev in ("cpu", "cuda")
        ]
        assert on[0].tolist() == on[1].tolist()


def test_the_same_hash_on_numpy_and_torch():
    x = np.array([0, 1, 2, 12345, 2**31, 2**32 - 1], dtype=np.int64)
    assert counter.mix32(x).tolist() == counter.mix32(torch.from_numpy(x)).tolist()
    assert (counter.mix32(x) < 2**32).all() and (counter.mix32(x) >= 0).all()


def test_uniforms_lie_strictly_inside_the_unit_interval():
    extremes = counter.unit(torch.tensor([0, 2**32 - 1]))
    assert extremes.tolist() == [2.0**-24, 1 - 2.0**-24]
    assert torch.isfinite(extremes.log().neg().log()).all()  # finite Gumbel noise
    keys = torch.from_numpy(counter.keys(list(range(64)), np.arange(64) * 7919))[:, None]
    u = counter.uniforms(keys, None, 4096)
    assert 0 < u.min() and u.max() < 1
    # Uniform: 16 equal bins of 262144 draws.
    observed = torch.histc(u.flatten(), bins=16, min=0, max=1).double()
    assert chi2_pvalue(observed, torch.ones(16)) > 1e-3


def test_streams_and_positions_and_seeds_give_other_keys():
    one = counter.keys([5, 5, 6], np.array([10, 11, 10]))
    assert len(set(one.tolist())) == 3
    assert counter.keys([5], np.array([10]), counter.DRAFT)[0] != one[0]
    assert counter.keys([5], np.array([10]), counter.ACCEPT)[0] != one[0]


def _draws(logits: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """n draws of one logits row under `params`: n sequences seeded 0..n-1 in one batch."""
    seqs = [Sequence("r", [1, 2, 3], params) for _ in range(n)]
    for seed, seq in enumerate(seqs):
        seq.seed = seed
    s = sampling.settings(seqs, [3] * n, logits.device)
    return sampling.device_sample(logits.expand(n, -1), s)


CASES = {
    "temperature": SamplingParams(temperature=1.3),
    "top_k": SamplingParams(temperature=0.9, top_k=5),
    "top_p": SamplingParams(temperature=1.1, top_p=0.8),
    "min_p": SamplingParams(temperature=1.0, min_p=0.05),
    "all": SamplingParams(temperature=1.2, top_k=7, top_p=0.9, min_p=0.02),
}


@pytest.mark.parametrize("wrong", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_draws_follow_the_truncated_distribution(case, wrong, monkeypatch):
    """Counts of 40 000 draws against `probabilities` (chi-square). The same test rejects a
    sampler whose noise is uniform instead of Gumbel (argmax then favours the likeliest)."""
    if wrong:
        monkeypatch.setattr(counter, "gumbel", counter.uniforms)
    torch.manual_seed(0)
    logits = torch.randn(1, 12) * 1.5
    params = CASES[case]
    tokens = _draws(logits, params, 40_000)
    probs = sampling.probabilities(logits, [sampling.Row(Sequence("r", [1], params))])[0]
    observed = torch.bincount(tokens, minlength=12).double()
    assert observed[probs == 0].sum() == 0  # nothing outside the truncated support
    pvalue = chi2_pvalue(observed[probs > 0], probs[probs > 0])
    if wrong:
        assert pvalue < 1e-6, pvalue
    else:
        assert pvalue > 1e-3, pvalue


def test_a_row_draws_the_same_token_whatever_the_batch():
    """One seeded row alone (top-k candidates, no sort), beside rows without top-k (a full sort
    for top-p), beside temperature-only and greedy rows: the same token; greedy rows take the
    argmax; and step s of a burst draws what a single draw at position + s does."""
    torch.manual_seed(1)
    vocab = 300
    mine = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=42)
    logits = torch.randn(1, vocab) * 2
    seq = Sequence("x", [1, 2, 3], mine)
    alone = [sampling.device_sample(logits, sampling.settings([seq], [p], "cpu")) for p in (3, 4)]
    others = [
        Sequence("t", [1], SamplingParams(temperature=1.0)),
        Sequence("p", [1], SamplingParams(temperature=0.7, top_p=0.5)),
        Sequence("g", [1], SamplingParams(temperature=0.0)),
    ]
    crowd = torch.randn(3, vocab)
    batch = torch.cat([crowd[:2], logits, crowd[2:]])
    seqs = others[:2] + [seq] + others[2:]
    s = sampling.settings(seqs, [9, 9, 3, 9], "cpu", steps=2)
    first, second = (sampling.device_sample(batch, s, step) for step in range(2))
    assert first[2] == alone[0][0] and second[2] == alone[1][0]
    assert first[3] == crowd[2].argmax() == second[3]
    # The next launch of the same rows reuses the settings, with new keys: the same draws.
    again = sampling.settings(list(seqs), [10, 10, 4, 10], "cpu", last=s)
    assert again.temperature is s.temperature and again.keys.tolist() == s.keys[1:].tolist()
    assert sampling.device_sample(batch, again).tolist() == second.tolist()
    host = sampling.sample(logits, [sampling.Row(seq)], eos_ids=set())
    assert host == alone[0].tolist()
