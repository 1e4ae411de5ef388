"""One request's metrics, recorded as its outputs reach the HTTP edge.

The server wraps each admitted-to-be request in `Metrics.track(...)` and feeds the tracker every
`RequestOutput`: tokens, TTFT and inter-token gaps as they stream, then at the last one the
finish reason, the engine-side timings and the decoder's summary. Exemplars: a traced request's
latency observations carry its trace id (`trace_id`), which the OpenMetrics exposition shows; a
point of a latency panel then links to the request's trace.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from stride.metrics.decoders import DecoderMetrics
from stride.metrics.edge import Exchange, current_exchange
from stride.metrics.labels import FINISH_REASONS
from stride.metrics.requests import RequestMetrics

if TYPE_CHECKING:
    from stride.scheduler.outputs import RequestOutput


class RequestSeries:
    """The children of every per-request metric for one (model, decoder, user)."""

    def __init__(
        self,
        requests: RequestMetrics,
        decoders: DecoderMetrics,
        labels: tuple[str, str, str],
        spec_tokens: int,
    ) -> None:
        """`spec_tokens`: the server's default K (the draft positions whose series exist from
        the start)."""
        self.requests, self.decoders, self.labels = requests, decoders, labels
        self.prompt_tokens = requests.prompt_tokens.labels(*labels)
        self.generation_tokens = requests.generation_tokens.labels(*labels)
        self.ttft = requests.ttft.labels(*labels)
        self.itl = requests.itl.labels(*labels)
        self.tpot = requests.tpot.labels(*labels)
        self.e2e = requests.e2e.labels(*labels)
        self.queue_time = requests.queue_time.labels(*labels)
        self.prefill_time = requests.prefill_time.labels(*labels)
        self.decode_time = requests.decode_time.labels(*labels)
        self.finished = {r: requests.requests_finished.labels(*labels, r) for r in FINISH_REASONS}
        self.forward_passes = decoders.forward_passes.labels(*labels)
        self.tokens_per_pass = decoders.tokens_per_pass.labels(*labels[:2])
        if labels[1].startswith("speculative/"):  # only speculative decoding drafts
            for counter in (
                decoders.spec_drafts, decoders.spec_draft_tokens, decoders.spec_accepted_tokens
            ):  # fmt: skip
                counter.labels(*labels)  # at 0 from the first scrape; fed in `_finish`
            for position in range(spec_tokens):
                decoders.spec_accepted_by_position.labels(*labels[:2], str(position))


@dataclass
class _Stream:
    """Timing of one sample (n > 1 runs several) as seen at the edge."""

    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    counted_prompt: bool = False


@dataclass
class RequestTracker:
    """One request's metrics, fed by the server with each `RequestOutput` it receives.

    Use as a context manager (or call `close`): a sample that never saw its terminal output
    (the client went away, the iterator was closed) is counted as finished with reason `abort`.
    """

    series: RequestSeries
    arrival: float = field(default_factory=time.perf_counter)
    streams: dict[str, _Stream] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    exchange: Exchange | None = field(default_factory=lambda: current_exchange.get())
    exemplar: dict[str, str] | None = None  # {"trace_id": ...} of a traced request

    def __enter__(self) -> RequestTracker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, admitted: Iterable[str] = ()) -> None:
        """The request is over for the server: samples still open were aborted, and so were
        the `admitted` ones (the engine took them) that never produced an output: those left
        while they waited."""
        for rid in (set(self.streams) | set(admitted)) - self.finished:
            self._count_finish("abort")
            self.finished.add(rid)

    def observe(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        series = self.series
        s = self.streams.get(out.request_id)
        exchange = self.exchange
        if s is None:
            s = self.streams[out.request_id] = _Stream()
            if exchange is not None:  # admitted: its end is counted here, not as a rejection
                exchange.admitted = True
                exchange.decoder = series.labels[1]
        if not s.counted_prompt and out.num_prompt_tokens:
            series.prompt_tokens.inc(out.num_prompt_tokens)
            s.counted_prompt = True
            if exchange is not None:
                exchange.prompt_tokens += out.num_prompt_tokens
        k = len(out.token_ids)
        if k:
            series.generation_tokens.inc(k)
            if exchange is not None:
                exchange.completion_tokens += k
            if s.first_token is None:  # tokens arriving with the first one have no gap
                series.ttft.observe(now - self.arrival, self.exemplar)
                s.first_token = now
            else:
                gap = (now - s.last_token) / k
                for _ in range(k):
                    series.itl.observe(gap, self.exemplar)
            s.last_token = now
            s.num_tokens += k
        if out.finished and out.request_id not in self.finished:
            self.finished.add(out.request_id)
            self._finish(out, s, now)

    def _finish(self, out: RequestOutput, s: _Stream, now: float) -> None:
        series, labels, decoders = self.series, self.series.labels, self.series.decoders
        reason = out.finish_reason or "error"
        if out.error is not None and out.error.code == "deadline_exceeded":
            reason = "deadline"
        self._count_finish(reason)
        if reason == "deadline":
            series.requests.rejected("deadline")
        exemplar = self.exemplar
        series.e2e.observe(now - self.arrival, exemplar)
        if s.first_token is not None and s.num_tokens > 1:
            series.tpot.observe((s.last_token - s.first_token) / (s.num_tokens - 1), exemplar)

        t = out.timings
        if "queue" in t:
            series.queue_time.observe(t["queue"], exemplar)
            if "ttft" in t:
                series.prefill_time.observe(t["ttft"] - t["queue"], exemplar)
        if "ttft" in t and "e2e" in t:
            series.decode_time.observe(t["e2e"] - t["ttft"], exemplar)

        stats = out.decoder_stats
        passes = int(stats.get("forward_passes", 0))
        if passes:
            series.forward_passes.inc(passes)
            series.tokens_per_pass.observe(float(stats["tokens_per_pass"]))
        drafted = int(stats.get("draft_tokens", 0))
        if drafted:
            decoders.spec_drafts.labels(*labels).inc(int(stats.get("drafts", 0)))
            decoders.spec_draft_tokens.labels(*labels).inc(drafted)
            decoders.spec_accepted_tokens.labels(*labels).inc(int(stats.get("accepted_tokens", 0)))
            for pos, n in enumerate(stats.get("accepted_per_position", ())):
                decoders.spec_accepted_by_position.labels(*labels[:2], str(pos)).inc(n)

    def _count_finish(self, reason: str) -> None:
        child = self.series.finished.get(reason)
        if child is None:
            child = self.series.requests.requests_finished.labels(*self.series.labels, reason)
        child.inc()
