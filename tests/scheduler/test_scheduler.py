"""Admission, priorities, deadlines and budgets of the step loop."""

from __future__ import annotations

import time

import pytest

from stride.engine.sequence import SamplingParams
from stride.scheduler.outputs import GenerateRequest, QueueFull, RequestRejected
from tests.helpers.cores import make_core


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_rejections_leave_the_engine_untouched(tiny_dir):
    core = make_core(tiny_dir, max_waiting=2)
    too_long = core.engine.max_model_len
    with pytest.raises(RequestRejected) as e:
        core.add(GenerateRequest("a", [5] * too_long, greedy(8)))
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(RequestRejected, match="valid decoders: ar"):
        core.add(GenerateRequest("b", [5, 6], greedy(8), decoder="nope"))
    with pytest.raises(RequestRejected, match="prompt"):
        core.add(GenerateRequest("c", [10_000], greedy(8)))
    core.add(GenerateRequest("d", [5], greedy(2)))
    core.add(GenerateRequest("e", [5], greedy(2)))
    with pytest.raises(QueueFull):
        core.add(GenerateRequest("f", [5], greedy(2)))
    assert sorted(core.seqs) == ["d", "e"]


def test_every_request_ends_exactly_once(tiny_dir):
    core = make_core(tiny_dir, max_num_seqs=3)
    for i in range(7):
        core.add(GenerateRequest(str(i), [5 + i] * (2 + i), greedy(3 + i)))
    core.abort("4")
    ends: dict[str, int] = {}
    while core.has_work:
        for out in core.step():
            if out.finished:
                ends[out.request_id] = ends.get(out.request_id, 0) + 1
    assert ends == {str(i): 1 for i in range(7) if i != 4}
    assert core.engine.cache.num_free_blocks == core.engine.cache.num_usable_blocks


def test_priority_runs_first_when_seats_are_scarce(tiny_dir):
    core = make_core(tiny_dir, max_num_seqs=1)
    core.add(GenerateRequest("late-low", [5, 6], greedy(2), priority=5))
    core.add(GenerateRequest("urgent", [7, 8], greedy(2), priority=0))
    order = []
    while core.has_work:
        order += [o.request_id for o in core.step() if o.finished]
    assert order == ["urgent", "late-low"]


def test_deadline_ends_request_with_error(tiny_dir):
    core = make_core(tiny_dir)
    core.add(GenerateRequest("d", [5, 6], greedy(1000), timeout=0.05))
    core.step()
    time.sleep(0.06)
    outs = core.step()
    assert [o.finish_reason for o in outs] == ["deadline"]
    assert outs[0].error.code == "deadline_exceeded"
    assert not core.has_work
    assert core.engine.cache.num_free_blocks == core.engine.cache.num_usable_blocks


def test_step_respects_token_and_sequence_budgets(tiny_dir):
    core = make_core(tiny_dir, max_num_seqs=2, max_num_batched_tokens=10)
    for i in range(4):
        core.add(GenerateRequest(str(i), [5] * 9, greedy(4)))
    core.step()
    assert core.last_batch_size <= 2 and core.last_num_tokens <= 10
    while core.has_work:
        core.step()
        assert core.last_batch_size <= 2 and core.last_num_tokens <= 10
