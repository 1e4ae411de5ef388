"""Per-request records and their per-step summary (exact percentiles, not Locust's histogram).

Locust rounds response times to whole milliseconds (and coarser above 100 ms), too coarse for
inter-token latency on a GPU, so every process keeps raw records and the summary is computed here.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field


@dataclass
class RequestRecord:
    """One finished (or failed) request. Latencies are in seconds."""

    decoder: str
    step: int  # the concurrency step the request started in: its latencies belong there
    ok: bool
    sent_at: float  # wall clock (time.time()) when the request was sent
    e2e: float
    ttft: float | None = None
    chunk_gaps: list[float] = field(default_factory=list)
    tpot: float | None = None
    output_tokens: int = 0
    error: str | None = None
    server_timings: dict[str, float] | None = None  # the server's queue, ttft and e2e, if told

    def to_dict(self) -> dict:
        return asdict(self)

    def chunk_times(self) -> list[float]:
        """Wall-clock arrival of each text chunk."""
        if self.ttft is None:
            return []
        times = [self.sent_at + self.ttft]
        for gap in self.chunk_gaps:
            times.append(times[-1] + gap)
        return times

    def tokens_between(self, start: float, end: float) -> float:
        """Output tokens that arrived in [start, end), spreading tokens evenly over chunks."""
        times = self.chunk_times()
        if not times:
            return 0.0
        inside = sum(start <= t < end for t in times)
        return self.output_tokens * inside / len(times)


@dataclass
class StepWindow:
    """When one concurrency step ran (wall-clock seconds)."""

    index: int
    users: int
    start: float
    end: float | None = None

    @property
    def duration(self) -> float:
        return max((self.end or self.start) - self.start, 1e-9)


def parse_steps(text: str) -> list[int]:
    """`"1,2,4,8"` → [1, 2, 4, 8]; `"1:64"` → powers of two from 1 up to 64."""
    text = text.strip()
    if ":" in text:
        low, high = (int(x) for x in text.split(":", 1))
        steps, users = [], max(low, 1)
        while users <= high:
            steps.append(users)
            users *= 2
    else:
        steps = [int(x) for x in text.split(",") if x.strip()]
    if not steps or min(steps) <= 0:
        raise ValueError(f"bad concurrency steps {text!r}")
    return steps


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100) of unsorted values; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_ms(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99/mean of latencies given in seconds, in milliseconds."""
    ms = [v * 1000 for v in values]
    return {
        "p50": percentile(ms, 50),
        "p90": percentile(ms, 90),
        "p99": percentile(ms, 99),
        "mean": sum(ms) / len(ms) if ms else None,
        "count": len(ms),
    }


def summarize(records: list[RequestRecord], windows: list[StepWindow]) -> dict[str, list[dict]]:
    """Per decoder, one entry per step: latencies, output tokens/s total and per user.

    Latencies belong to the step a request started in; throughput counts the tokens that arrived
    while the step ran, so requests straddling a step boundary are split between the two.
    """
    by_decoder: dict[str, list[RequestRecord]] = defaultdict(list)
    for record in records:
        by_decoder[record.decoder].append(record)
    summary: dict[str, list[dict]] = {}
    for decoder, recs in sorted(by_decoder.items()):
        steps = []
        for window in windows:
            started = [r for r in recs if r.step == window.index]
            ok = [r for r in started if r.ok]
            end = window.end if window.end is not None else window.start
            tokens = sum(r.tokens_between(window.start, end) for r in recs if r.ok)
            busy = sum(r.e2e for r in ok)  # a user's time spent waiting on its requests
            steps.append(
                {
                    "step": window.index,
                    "concurrency": window.users,
                    "duration_s": window.duration,
                    "requests": len(ok),
                    "failures": len(started) - len(ok),
                    "errors": sorted({r.error for r in started if r.error})[:5],
                    "output_tokens": round(tokens),
                    "output_tokens_per_s": tokens / window.duration,
                    "tokens_per_s_per_user": (
                        sum(r.output_tokens for r in ok) / busy if busy > 0 else None
                    ),
                    "ttft_ms": latency_ms([r.ttft for r in ok if r.ttft is not None]),
                    "itl_ms": latency_ms([gap for r in ok for gap in r.chunk_gaps]),
                    "tpot_ms": latency_ms([r.tpot for r in ok if r.tpot is not None]),
                    "e2e_ms": latency_ms([r.e2e for r in ok]),
                }
            )
        summary[decoder] = steps
    return summary
