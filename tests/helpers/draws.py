"""The checks of `draw_kernels` against the plain tensor ops, on a device: the GPU, or the CPU
under Triton's interpreter (a subprocess started with TRITON_INTERPRET=1, which Triton reads
when a kernel is defined; it runs a top-k some 10^5 times slower, hence `quick`)."""

from __future__ import annotations

import math

import torch

from stride.decoders import draw_kernels, sampling
from stride.decoders.sampling import DrawSettings
from stride.engine.sequence import SamplingParams, Sequence


def settings(rows: list[tuple[float, float, float, int]], device: str, seed: int) -> DrawSettings:
    """The sampler's settings for rows of (temperature, top_p, min_p, top_k) (temperature 0:
    greedy; top_k 0: none), each row a sequence of its own seed."""
    seqs = [
        Sequence(f"{seed}-{i}", [1], SamplingParams(temperature=t, top_p=p, min_p=m, top_k=k,
                                                    seed=100 * seed + i))
        for i, (t, p, m, k) in enumerate(rows)
    ]  # fmt: skip
    return sampling.settings(seqs, [7] * len(seqs), torch.device(device))


MIXES = {
    "whole rows": [(1.0, 1.0, 0, 0), (0.7, 1.0, 0, 0), (0, 1.0, 0, 0), (1.6, 1.0, 0, 0)],
    "top-k": [(1.0, 1.0, 0, 50), (0.8, 1.0, 0, 1), (1.3, 1.0, 0, 64), (0, 1.0, 0, 0)],
    "top-k top-p": [(1.0, 0.95, 0, 50), (0.5, 0.3, 0, 7), (1.0, 1.0, 0, 20), (2.0, 0.9, 0, 64)],
    "top-k min-p": [(1.0, 1.0, 0.05, 40), (1.0, 0.9, 0.2, 64), (0, 1.0, 0, 0)],
    "top-p, min-p, no top-k": [(1.0, 0.95, 0, 0), (0.6, 0.5, 0.1, 0), (1.0, 1.0, 0.05, 0),
                               (1.0, 1.0, 0, 0), (1.0, 0.9, 0, 30), (0, 1.0, 0, 0)],
}


def check(device: str, quick: bool = False) -> None:
    """Draws equal `ops_sample`'s token for token, with their logprobs taken or not; the
    logprobs equal log-softmax's. Seed 1 makes ties in whole rows (the first of equal values
    wins on both paths; which of the tokens tied at a top-k boundary torch keeps is its own),
    seed 2 masks a whole chunk and more (as a grammar does). `quick`: smaller chunks, and one
    of those two seeds per mix."""
    if quick:
        draw_kernels.CHUNK = 256
    vocab = 5 * draw_kernels.CHUNK // 2  # three chunks, the last one half full
    gen = torch.Generator().manual_seed(0)
    for i, ((name, rows), n) in enumerate(zip(MIXES.items(), (0, 5, 20, 1, 3), strict=True)):
        for seed in [1 + i % 2] if quick else range(4):
            logits = (torch.randn(len(rows), vocab, generator=gen) * 3).to(device)
            tied = seed == 1 and name == "whole rows"
            if tied:
                logits = logits.round()
            if seed == 2:
                logits[:, : draw_kernels.CHUNK + 5] = -math.inf
            s = settings(rows, device, seed)
            route = sampling.kernel_flags(s)
            expected = sampling.ops_sample(logits, s).tolist()
            plain = draw_kernels.draw(logits, s.floats, s.keys[0], *route).tolist()
            assert plain == expected, (name, seed, plain, expected)
            keys = s.keys[0]
            got, (chosen, vals, ids) = draw_kernels.draw_scored(logits, s.floats, keys, *route, n)
            assert got.tolist() == expected, (name, seed)
            lp = torch.log_softmax(logits, dim=-1)
            top_v, top_i = lp.topk(n, dim=-1)
            torch.testing.assert_close(chosen, lp.gather(1, got[:, None])[:, 0])
            torch.testing.assert_close(vals, top_v)
            if not tied:  # (tied logprobs may come in either order)
                assert ids.tolist() == top_i.tolist()
    top_p_boundary(device, vocab, gen)
    past_the_candidates(device, vocab, gen, rounds=3 if quick else 8)


def top_p_boundary(device: str, vocab: int, gen: torch.Generator) -> None:
    """Two tokens hold about 0.5 and 0.31 of the mass: top-p 0.7 keeps the second (the mass
    before it, 0.5, is below 0.7), so rows draw it about 38 % of the time, and both paths agree
    on which rows do."""
    rows = [(1.0, 0.7, 0, 64)] * 8
    logits = torch.randn(len(rows), vocab, generator=gen)
    logits[:, 7], logits[:, 11] = 10.0, 9.5
    s = settings(rows, device, seed=5)
    logits = logits.to(device)
    got = draw_kernels.draw(logits, s.floats, s.keys[0], True, False, True).tolist()
    assert got == sampling.ops_sample(logits, s).tolist()
    assert {7, 11} <= set(got), got


def past_the_candidates(device: str, vocab: int, gen: torch.Generator, rounds: int) -> None:
    """Flat rows, whose top-p and min-p keep far more than the TOP_MAX candidates: rows without
    a top-k draw past them (each drawn token not kept sends the draw among the tokens above it),
    beside a row with a top-k and a greedy one, with the plain ops' tokens."""
    truncated = [(1.0, 0.95, 0, 0), (0.8, 0.4, 0, 0), (1.0, 1.0, 0.3, 0), (1.2, 0.6, 0.2, 0)]
    rows = [*truncated * 3, (1.0, 0.9, 0, 10), (0, 1.0, 0, 0)]
    past = 0
    for seed in range(rounds):
        logits = (torch.randn(len(rows), vocab, generator=gen) * 0.5).to(device)
        s = settings(rows, device, seed=10 + seed)
        assert sampling.kernel_flags(s) == (True, True, True)
        expected = sampling.ops_sample(logits, s)
        got = draw_kernels.draw(logits, s.floats, s.keys[0], True, True, True)
        assert got.tolist() == expected.tolist(), seed
        rank = (logits > logits.gather(1, got[:, None])).sum(-1)
        past += int((rank[: len(truncated) * 3] >= draw_kernels.TOP_MAX).sum())
    assert past > 0  # (the draws that went past the candidates)
