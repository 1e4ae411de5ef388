"""A launch's drawn logprobs, read per sequence: the same records the host path makes, as a list
would give them, and one copy of the launch's arrays however many sequences cross the pipe."""

from __future__ import annotations

import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from stride.decoders import sampling
from stride.decoders.drawn_logprobs import DrawnLogprobs, RowLogprobs
from stride.engine.sequence import SamplingParams, Sequence
from stride.scheduler.outputs import RequestOutput

WANTED = [3, None, 1, 3]  # each row's logprobs (None: asks for none)


def _drawn(steps: int = 3) -> tuple[list[list], list[list[float]], list[torch.Tensor]]:
    """Each row's drawn logprobs over `steps` steps, each row's tokens, and each step's logits."""
    torch.manual_seed(0)
    seqs = [Sequence(f"r{i}", [1, 2], SamplingParams(logprobs=k)) for i, k in enumerate(WANTED)]
    drawn = DrawnLogprobs(seqs)
    logits = [torch.randn(len(seqs), 50) for _ in range(steps)]
    tokens = [torch.randint(0, 50, (len(seqs),)) for _ in range(steps)]
    for step_logits, step_tokens in zip(logits, tokens, strict=True):
        drawn.take(step_logits, step_tokens)
    made = torch.stack(tokens).T.tolist()
    return drawn.copied().per_sequence(made), made, logits


def test_a_rows_drawn_logprobs_are_what_the_host_path_makes():
    per_row, made, logits = _drawn()
    for b, k in enumerate(WANTED):
        if k is None:
            assert per_row[b] == [None] * 3
            continue
        rows = [sampling.Row(Sequence("r", [1, 2], SamplingParams(logprobs=k)))]
        steps = zip(logits, made[b], strict=True)
        want = [sampling.logprobs(x[b : b + 1], [t], rows)[0] for x, t in steps]
        got = per_row[b]
        assert isinstance(got, RowLogprobs) and len(got) == 3
        assert list(got) == want and got == want
        assert got[-1] == want[-1] and got[1:] == want[1:] and got[:2] == want[:2]
        assert got[1:][1] == want[2]  # a slice's steps follow the row's
        with pytest.raises(IndexError):
            got[3]
        assert [*want[:1], *got[:0]] == want[:1] and want[:1] + got[1:] == want  # a list's +
        assert got[:1] + want[1:] == want


def test_rows_of_one_launch_cross_the_pipe_with_one_copy_of_its_arrays():
    per_row, made, _ = _drawn()
    outs = [RequestOutput(f"r{b}", made[b], logprobs=lps) for b, lps in enumerate(per_row)]
    back = pickle.loads(ForkingPickler.dumps(outs))
    assert [o.logprobs for o in back] == per_row
    blocks = {id(o.logprobs.block) for o in back if isinstance(o.logprobs, RowLogprobs)}
    assert len(blocks) == 1
    alone = len(ForkingPickler.dumps(outs[:1]))
    assert len(ForkingPickler.dumps(outs)) < 2 * alone  # (each row more would be a block more)
