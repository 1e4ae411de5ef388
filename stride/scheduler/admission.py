"""Admission to the bounded waiting queue: all of a request's sequences or none, no starvation,
and a Retry-After that says when room should open.

A request asks for several sequences at once (n samples, several prompts), admitted together or
not at all; beyond `--max-waiting` waiting sequences the answer is 429. Under steady load a
queue that never empties would refuse a request of four sequences forever, while requests of
one slip into each place that opens. So the oldest refused request holds a reservation: until
it comes back (a request at least as large takes it) or its Retry-After has passed by
`RESERVATION_GRACE_S`, smaller requests are admitted only where they leave room for it, and the
queue drains until it fits.

Retry-After is the seconds until that much room should open, at the rate sequences have left
the waiting queue lately (their first output), rounded up: at least 1, at most `MAX_RETRY_S`.
Thread-safety is the caller's: the engine client calls in under its lock.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stride.scheduler.outputs import GenerateRequest, QueueFull, RequestRejected

if TYPE_CHECKING:
    from stride.scheduler.core import EngineCore

RESERVATION_GRACE_S = 5.0  # how late a refused request may come back and still find its room
MAX_RETRY_S = 60
RATE_WINDOW = 64  # departures the leaving rate is measured over


@dataclass
class Reservation:
    size: int  # sequences
    until: float  # clock time; past it the room is given back


class Admission:
    def __init__(self, max_waiting: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_waiting = max_waiting
        self.clock = clock
        self.reserved: Reservation | None = None
        self._departures: deque[float] = deque(maxlen=RATE_WINDOW)

    def check(self, size: int, waiting: int) -> None:
        """Raise QueueFull (with its Retry-After) unless `size` sequences may join the `waiting`
        ones now; a request that takes the reservation frees it."""
        now = self.clock()
        held = self.reserved
        if held is not None and now > held.until:
            held = self.reserved = None
        if held is not None and size < held.size:
            if waiting + size + held.size > self.max_waiting:
                raise self._full(waiting + size + held.size, "room is held for an earlier request")
            return
        if waiting + size > self.max_waiting:
            raise self.refuse(size, waiting)
        self.reserved = None

    def refuse(self, size: int, waiting: int) -> QueueFull:
        """`size` sequences do not fit: reserve room for them (if no earlier request holds it;
        this one again: a while longer), and say when to come back."""
        error = self._full(waiting + size, "the waiting queue is full")
        held = self.reserved
        until = self.clock() + error.retry_after + RESERVATION_GRACE_S
        if held is None or size >= held.size:
            self.reserved = Reservation(max(size, held.size if held else 0), until)
        return error

    def departed(self, count: int) -> None:
        """`count` sequences left the waiting queue (their first output came)."""
        now = self.clock()
        self._departures.extend([now] * count)

    def rate(self) -> float | None:
        """Sequences leaving the waiting queue per second lately (None: not measured yet)."""
        if len(self._departures) < 2:
            return None
        span = self.clock() - self._departures[0]
        return len(self._departures) / span if span > 0 else None

    def _full(self, wanted: int, why: str) -> QueueFull:
        """QueueFull for `wanted` places in a queue of `max_waiting`, with its Retry-After."""
        excess = max(wanted - self.max_waiting, 1)
        rate = self.rate()
        wait = 1 if rate is None else math.ceil(excess / rate)
        retry_after = min(max(wait, 1), MAX_RETRY_S)
        return QueueFull(f"{why} (--max-waiting {self.max_waiting})", retry_after)


def check_group(requests: list[GenerateRequest], max_waiting: int) -> None:
    """Requests admitted together that can never be: more than the waiting queue holds."""
    if len(requests) > max_waiting:
        raise RequestRejected(
            f"{len(requests)} sequences (prompts x n) can never be admitted together: the "
            f"waiting queue holds {max_waiting} (--max-waiting)",
            param="n",
        )


def admit(core: EngineCore, requests: list[GenerateRequest]) -> Exception | None:
    """In the step loop: add every request to the core, or none of them; the admission error,
    if any."""
    added: list[str] = []
    try:
        check_group(requests, core.config.max_waiting)
        for req in requests:
            core.add(req)
            added.append(req.request_id)
    except (QueueFull, RequestRejected) as e:
        for rid in added:
            core.abort(rid)
        return e
    return None
