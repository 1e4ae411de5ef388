"""Admission to the waiting queue, on a clock of the test's own: a refused request of several
sequences holds room until it comes back, smaller ones leave that room free meanwhile, and
Retry-After follows the rate sequences have left the queue at."""

from __future__ import annotations

import pytest

from stride.scheduler.admission import RESERVATION_GRACE_S, Admission
from stride.scheduler.outputs import QueueFull


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_what_fits_is_admitted_and_what_does_not_is_told_when_to_come_back(clock):
    admission = Admission(max_waiting=4, clock=clock)
    admission.check(1, waiting=3)
    with pytest.raises(QueueFull) as full:
        admission.check(1, waiting=4)
    assert full.value.retry_after == 1  # nothing measured yet: the shortest honest answer
    for _ in range(10):  # 2 sequences a second leave the queue
        clock.now += 0.5
        admission.departed(1)
    assert admission.rate() == pytest.approx(10 / 4.5)
    with pytest.raises(QueueFull) as full:
        admission.check(4, waiting=4)  # 4 must leave: about 2 s
    assert full.value.retry_after == 2


def test_a_refused_large_request_holds_room_until_it_comes_back(clock):
    admission = Admission(max_waiting=4, clock=clock)
    with pytest.raises(QueueFull):
        admission.check(4, waiting=3)  # n=4 behind three single ones: refused, room held
    with pytest.raises(QueueFull) as held:
        admission.check(1, waiting=0)  # a single one would take the room it waits for
    assert "held for an earlier request" in str(held.value)
    admission.check(4, waiting=0)  # it comes back and fits
    assert admission.reserved is None
    admission.check(1, waiting=4 - 1)  # the room is everyone's again


def test_a_reservation_nobody_comes_back_for_lapses(clock):
    admission = Admission(max_waiting=4, clock=clock)
    with pytest.raises(QueueFull) as refused:
        admission.check(3, waiting=2)
    clock.now += refused.value.retry_after + RESERVATION_GRACE_S + 0.1
    admission.check(1, waiting=2)  # the client gave up: its room is given back
    assert admission.reserved is None


def test_the_oldest_refused_request_keeps_its_room(clock):
    admission = Admission(max_waiting=8, clock=clock)
    with pytest.raises(QueueFull):
        admission.check(6, waiting=4)
    with pytest.raises(QueueFull):
        admission.check(2, waiting=8)  # smaller, later: no reservation of its own
    assert admission.reserved is not None and admission.reserved.size == 6
    admission.check(2, waiting=0)  # 2 + 6 fit
    with pytest.raises(QueueFull):
        admission.check(2, waiting=2)  # 2 + 2 + 6 do not
