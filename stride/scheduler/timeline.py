"""A request's time: what every request's last output reports (`timings`), and a traced
request's path through the step loop (`Timeline`), for its OpenTelemetry trace.

The core keeps a `Timeline` only for requests that asked to be traced (`GenerateRequest.trace`):
untraced requests cost one empty-dict check where events happen. The finished timeline rides
on the request's last `RequestOutput` as plain data (times from `time.monotonic()`, one clock
for every process of the machine), and the HTTP edge turns it into spans (`stride.tracing`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from stride.engine.sequence import DecodeStats, Sequence

PREEMPTED = "preempted"
DRAFT_VERIFY = "draft_verify"  # a verification of drafted tokens: drafted, accepted, committed
REFINEMENT_PASS = "refinement_pass"  # a pass of an iterative-refinement decoder: what it kept


@dataclass
class Timeline:
    arrival: float  # admitted by the core
    scheduled: float | None = None  # first scheduled
    first_token: float | None = None
    finished: float | None = None
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    # Prefill chunks: (launched, committed, tokens, tokens cached before the chunk).
    prefill: list[tuple[float, float, int, int]] = field(default_factory=list)
    # (name, time, attributes): PREEMPTED, DRAFT_VERIFY and REFINEMENT_PASS.
    events: list[tuple[str, float, dict[str, int]]] = field(default_factory=list)
    _speculated: tuple[int, int, int] = (0, 0, 0)  # drafts, draft and accepted tokens seen

    def finish(self, seq: Sequence) -> Timeline:
        """The timeline complete, as `seq` ends now."""
        self.scheduled = seq.first_scheduled_time
        self.first_token = seq.first_token_time
        self.finished = time.monotonic()
        self.cached_tokens = seq.cached_prompt_tokens
        return self

    def preempted(self, now: float) -> None:
        self.events.append((PREEMPTED, now, {}))

    def committed(
        self, now: float, stats: DecodeStats, proposed: int, kept: int, refining: bool
    ) -> None:
        """A commit kept `kept` tokens: a draft/verify event if the decoder verified drafts
        (its speculative counters moved), a refinement pass if `refining` (it proposed
        `proposed` guesses, or a model group stepped it), else nothing (plain decoding)."""
        seen = (stats.drafts, stats.draft_tokens, stats.accepted_tokens)
        if seen != self._speculated:
            cycles, drafted, accepted = (a - b for a, b in zip(seen, self._speculated, strict=True))
            self._speculated = seen
            attrs = {"cycles": cycles, "drafted": drafted, "accepted": accepted, "committed": kept}
            self.events.append((DRAFT_VERIFY, now, attrs))
        elif refining:
            self.events.append((REFINEMENT_PASS, now, {"proposed": proposed, "committed": kept}))


def timings(seq: Sequence) -> dict[str, Any]:
    """What every request's last output reports of its time (`usage.timings`), traced or not:
    end to end, in the queue, to the first token, and the decode rate after it."""
    now = time.monotonic()
    t: dict[str, Any] = {"e2e": now - seq.arrival_time}
    if seq.first_scheduled_time is not None:
        t["queue"] = seq.first_scheduled_time - seq.arrival_time
    if seq.first_token_time is not None:
        t["ttft"] = seq.first_token_time - seq.arrival_time
        decode_time = now - seq.first_token_time
        if seq.num_output_tokens > 1 and decode_time > 0:
            t["decode_tokens_per_s"] = (seq.num_output_tokens - 1) / decode_time
    return t
