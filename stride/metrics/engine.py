"""The engine's state and steps: gauges, step time and size, preemptions, restarts, prefix cache.

Fed by the step loop after every engine step and every abort (an abort that leaves the engine
idle runs no step, so it reports the freed sequence itself). The gauges carry `model` only and
exist (at 0) as soon as the server's `Metrics` does: autoscalers and the Gateway API Inference
Extension's endpoint picker read one series per pod, idle pods included. With several API
processes only one records them; the others' gauges stay at 0, so `max` across processes
(their multiprocess mode) reads the engine's value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from stride.metrics.buckets import STEP_BUCKETS, TOKENS_PER_STEP_BUCKETS

if TYPE_CHECKING:
    from stride.scheduler.outputs import StepStats


class EngineMetrics:
    """The engine-state metrics of one model, and the step loop's hooks that set them."""

    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        r, m = registry, ["model"]

        def engine_gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, m, registry=r, multiprocess_mode="max")

        self.requests_running = engine_gauge(
            "stride_requests_running", "Sequences in the running batch."
        )
        self.requests_waiting = engine_gauge(
            "stride_requests_waiting", "Sequences waiting to be scheduled."
        )
        self.kv_cache_usage = engine_gauge(
            "stride_kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0-1)."
        )
        self.batch_size = engine_gauge(
            "stride_batch_size", "Sequences scheduled in the last engine step."
        )
        self.step_duration = Histogram(
            "stride_engine_step_duration_seconds", "Wall time of one engine step.", m,
            buckets=STEP_BUCKETS, registry=r,
        )  # fmt: skip
        self.step_tokens = Histogram(
            "stride_engine_step_tokens", "Tokens scored in one engine step (tails + proposals).",
            m, buckets=TOKENS_PER_STEP_BUCKETS, registry=r,
        )  # fmt: skip
        self.preemptions = Counter(
            "stride_preemptions", "Sequences preempted for lack of KV cache.", m, registry=r
        )
        self.engine_restarts = Counter(
            "stride_engine_restarts", "Times the engine died and a restarted one served again.",
            m, registry=r,
        )  # fmt: skip
        self.prefix_cache_queries = Counter(
            "stride_prefix_cache_queries",
            "Prefix cache queries, in prompt tokens looked up (each request's first admission).",
            m, registry=r,
        )  # fmt: skip
        self.prefix_cache_hits = Counter(
            "stride_prefix_cache_hits",
            "Prefix cache hits, in prompt tokens whose KV was reused instead of computed.",
            m, registry=r,
        )  # fmt: skip

        # Children looked up once (labels() costs microseconds the step loop should not pay);
        # they also make these series exist from the start, so rates read 0, not "no data".
        self._running = self.requests_running.labels(model)
        self._waiting = self.requests_waiting.labels(model)
        self._kv = self.kv_cache_usage.labels(model)
        self._batch = self.batch_size.labels(model)
        self._step = self.step_duration.labels(model)
        self._step_tokens = self.step_tokens.labels(model)
        self._preempted = self.preemptions.labels(model)
        self._restarts = self.engine_restarts.labels(model)
        self._prefix_queries = self.prefix_cache_queries.labels(model)
        self._prefix_hits = self.prefix_cache_hits.labels(model)
        self._preemptions_seen = 0
        self._totals: dict[Counter, int] = {}  # engine totals counted so far (`_advance`)
        self._gauges: dict[Gauge, float] = {}  # last value set

    def on_step(self, stats: StepStats, step_seconds: float) -> None:
        """The state the engine reported after a step, and the step's time and size."""
        self._put(self._running, stats.num_running)
        self._put(self._waiting, stats.num_waiting)
        self._put(self._kv, stats.kv_usage)
        self._put(self._batch, stats.batch_size)
        if stats.batch_size:
            self._step.observe(step_seconds)
            self._step_tokens.observe(stats.num_tokens)
        preempted = stats.num_preemptions - self._preemptions_seen
        if preempted > 0:
            self._preempted.inc(preempted)
            self._preemptions_seen += preempted
        self._advance(self._prefix_queries, stats.prefix_cache_queries)
        self._advance(self._prefix_hits, stats.prefix_cache_hits)

    def restarted(self) -> None:
        """A restarted engine serves: its running totals and gauges start again from 0."""
        self._restarts.inc()
        self._totals.clear()
        self._preemptions_seen = 0
        for gauge in (self._running, self._waiting, self._kv, self._batch):
            self._put(gauge, 0)

    def load(self) -> tuple[float, float, float]:
        """Running and waiting sequences and KV-cache usage, as last set (the stats line's)."""
        return (
            self._gauges.get(self._running, 0),
            self._gauges.get(self._waiting, 0),
            self._gauges.get(self._kv, 0.0),
        )

    def _advance(self, counter: Counter, total: int) -> None:
        """Count what one of the engine's running totals grew by since it was last seen."""
        seen = self._totals.get(counter, 0)
        if total > seen:
            counter.inc(total - seen)
            self._totals[counter] = total

    def _put(self, gauge: Gauge, value: float) -> None:
        """Set a gauge only when its value changed: most steps change none (a lock each)."""
        if self._gauges.get(gauge) != value:
            self._gauges[gauge] = value
            gauge.set(value)
