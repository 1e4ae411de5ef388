"""Requests as clients see them: received, refused, finished, their tokens and latencies.

Labelled by `model`, `decoder` (the request's strategy) and `user` (see `labels`), except the
counts of requests received and refused, which come before a request's decoder is known. Fed by
the HTTP edge: `middleware` counts what arrives and what is refused, and each admitted request's
`tracker.RequestTracker` the rest, as its outputs stream.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from stride.metrics.buckets import ITL_BUCKETS, REQUEST_BUCKETS
from stride.metrics.labels import REJECT_REASONS


class RequestMetrics:
    """The per-request metrics of one model; `received` and `rejected` count at the edge."""

    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        r, m, mdu = registry, ["model"], ["model", "decoder", "user"]
        self.requests_received = Counter(
            "stride_requests_received", "Generation requests that reached the server.", m,
            registry=r,
        )  # fmt: skip
        self.requests_rejected = Counter(
            "stride_requests_rejected",
            "Requests refused or failed before completion, by reason (queue_full, deadline, "
            "auth, validation; unavailable: loading, draining or engine dead; internal: a bug).",
            ["model", "reason"],
            registry=r,
        )
        self.requests_finished = Counter(
            "stride_requests_finished", "Admitted requests that ended, by finish reason.",
            mdu + ["finish_reason"], registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "stride_prompt_tokens", "Prompt tokens of admitted requests.", mdu, registry=r
        )
        self.generation_tokens = Counter(
            "stride_generation_tokens", "Tokens generated and sent to clients.", mdu, registry=r
        )

        def request_hist(name: str, doc: str, buckets=REQUEST_BUCKETS) -> Histogram:
            return Histogram(name, doc, mdu, buckets=buckets, registry=r)

        self.ttft = request_hist(
            "stride_time_to_first_token_seconds", "From arrival to the first token, at the edge."
        )
        self.itl = request_hist(
            "stride_inter_token_latency_seconds",
            "Gap between tokens at the edge; a burst of k tokens counts k gaps of 1/k each.",
            ITL_BUCKETS,
        )
        self.tpot = request_hist(
            "stride_time_per_output_token_seconds",
            "Per request: (e2e - ttft) / (output tokens - 1).",
            ITL_BUCKETS,
        )
        self.e2e = request_hist(
            "stride_e2e_request_latency_seconds", "From arrival to the last output, at the edge."
        )
        self.queue_time = request_hist(
            "stride_request_queue_time_seconds", "Engine: from admission to first scheduled."
        )
        self.prefill_time = request_hist(
            "stride_request_prefill_time_seconds", "Engine: from first scheduled to first token."
        )
        self.decode_time = request_hist(
            "stride_request_decode_time_seconds", "Engine: from first token to the end."
        )

        # Looked up once; each reason's series exists from the start, at 0.
        self._received = self.requests_received.labels(model)
        self._rejected = {r: self.requests_rejected.labels(model, r) for r in REJECT_REASONS}

    def received(self) -> None:
        self._received.inc()

    def rejected(self, reason: str) -> None:
        """A request refused before admission, or one whose deadline passed."""
        if reason not in REJECT_REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}")
        self._rejected[reason].inc()
