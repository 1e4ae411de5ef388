"""A burst's draws replayed as CUDA graphs give the plain ops' tokens, step after step and
launch after launch (new settings, new keys). Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from stride.decoders import sampling
from stride.decoders.draw_graphs import DrawGraphs
from stride.engine.sequence import SamplingParams, Sequence

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

MIXES = {
    "temperature": [SamplingParams(temperature=1.3)] * 3,
    "top-k top-p": [SamplingParams(temperature=1.0, top_k=50, top_p=0.95)] * 4,
    "top-p alone": [SamplingParams(temperature=0.8, top_p=0.9)] * 2,
    "top-p beside a top-k": [SamplingParams(top_p=0.9), SamplingParams(top_k=30, min_p=0.1)],
    "top-p beside a large top-k": [SamplingParams(top_p=0.9), SamplingParams(top_k=100)],
    "mixed": [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.2, top_k=7, top_p=0.9, min_p=0.02),
        SamplingParams(temperature=1.0, top_k=20),
    ],
}


@pytest.mark.parametrize("mix", list(MIXES))
def test_graphed_draws_equal_plain_ones(mix):
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    buffer = torch.empty(8, 4096, device=dev)  # what the decode graphs write their logits to
    graphs = DrawGraphs()
    params = MIXES[mix]
    for launch in range(3):  # new sequences (settings, seeds) and new positions each launch
        seqs = [Sequence(f"{launch}-{i}", [1], p) for i, p in enumerate(params)]
        draws = sampling.settings(seqs, [5 + launch] * len(seqs), dev, steps=4)
        logits = buffer[: len(seqs)]
        for step in range(4):
            logits.copy_(torch.randn(logits.shape, device=dev, generator=gen) * 3)
            expected = sampling.device_sample(logits, draws, step).tolist()
            assert graphs(logits, draws, step).tolist() == expected


def test_settings_that_take_other_ops_take_other_graphs():
    """Rows whose settings differ only in a top-k past the kernels' candidates (plain ops
    instead of the kernels) replay graphs of their own, launch after launch on one buffer."""
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(1)
    logits = torch.empty(2, 4096, device=dev)
    graphs = DrawGraphs()
    for launch in range(4):
        k = 100 if launch % 2 else 30
        params = [SamplingParams(top_p=0.9), SamplingParams(top_k=k)]
        seqs = [Sequence(f"{launch}-{i}", [1], p) for i, p in enumerate(params)]
        draws = sampling.settings(seqs, [3] * 2, dev)
        logits.copy_(torch.randn(logits.shape, device=dev, generator=gen))
        expected = sampling.ops_sample(logits, draws).tolist()
        assert graphs(logits, draws, 0).tolist() == expected
