"""Every Prometheus metric Stride emits, defined here and recorded where the event happens.

Two feeders: the step loop calls `Metrics.on_step` after every engine step and every abort
(gauges, step time, tokens per step, preemptions, prefix-cache queries and hits, and the step's
roofline count: bytes read, FLOPs, passes and scored tokens by kind; an abort that leaves the
engine idle runs no step, so it reports the freed sequence itself), and the HTTP edge wraps each
request in `Metrics.track(...)`, which
sees the request's outputs as they stream (tokens, TTFT, inter-token latency) and its last one
(finish reason, engine-side timings, the decoder's summary). Labels stay bounded: `user` comes
only from a configured allowlist (anything else is `other`, no user is `none`), and `decoder`
is the request's strategy (`strategy`: `ar`, `speculative/ngram`, `refine/jacobi`, ...). The
engine-state gauges carry `model` only and exist (at 0) as soon as `Metrics` does: autoscalers and
the Gateway API Inference Extension's endpoint picker read one series per pod, idle pods included.
Every series whose labels are known at start-up exists from the start, at 0, as Prometheus'
naming guide recommends, so dashboards and `rate()` alerts have data from the first scrape: the
decoders on offer (`Metrics.strategies`) x the users' labels, each finish and rejection reason,
and the draft positions up to the server's default K.
One `CollectorRegistry` per server, so tests can build many apps in a process.

The roofline (`stride.engine.roofline`): the engine's bytes read, FLOPs and step wall time are
counters by `decoder`, the registry name of the decoder of every sequence a step scored (`ar`,
`speculative`, `refine`; `mixed` when several), so achieved bandwidth, FLOP/s and arithmetic
intensity are ratios of their rates, and the device's peaks are gauges: the roof they sit under.

Exemplars: a traced request's latency observations carry its trace id (`trace_id`), which the
OpenMetrics exposition shows (`GET /metrics` answers in it when the scraper asks for it, as
Prometheus does); a point of a latency panel then links to the request's trace.

The HTTP edge also logs here, from the numbers it keeps anyway: one access line per request
(`stride.access`: method, path, status, decoder, tokens, latency) and, every few seconds while
there is work, one line of throughput and engine state (`stride.stats`), like vLLM's.

Several API processes (`stride serve --api-servers N`) share their numbers through
prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR, set by their parent): a scrape
answered by any of them sums every process's counters and histograms. The engine-state gauges
and step metrics are recorded by one API process only; the others' gauges stay at 0, so `max`
across processes reads the engine's value. Process metrics (CPU, memory) are not exported then.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.multiprocess import MultiProcessCollector

from stride.decoders import catalog

if TYPE_CHECKING:
    from stride.scheduler.outputs import RequestOutput, StepStats

USERS_ENV = "STRIDE_METRICS_USERS"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # read by prometheus_client when first imported
OTHER_USER = "other"
NO_USER = "none"
REJECT_REASONS = ("queue_full", "deadline", "auth", "validation", "unavailable", "internal")
FINISH_REASONS = ("stop", "length", "abort", "deadline", "error")
STATS_INTERVAL = 5.0  # seconds between two stats lines while busy (vLLM: 5 to 10)

access_log = logging.getLogger("stride.access")
stats_log = logging.getLogger("stride.stats")

# Fine at the low end: CPU/GPU decode steps and inter-token gaps are often well under 10 ms.
STEP_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
    0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip
ITL_BUCKETS = STEP_BUCKETS
REQUEST_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5,
    2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
)  # fmt: skip
TOKENS_PER_STEP_BUCKETS = tuple(float(2**i) for i in range(15))  # 1 .. 16384
TOKENS_PER_PASS_BUCKETS = (1.0, 1.1, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0,
                           32.0, 64.0)  # fmt: skip

STEP_DECODER_MIXED = "mixed"  # a step's sequences used several decoders
SCORED_KINDS = ("decode", "prefill", "draft")  # rows of a forward pass, by what they are


def strategy(
    decoder: str,
    options: Mapping[str, Any] | None = None,
    draft_model: bool = False,
    eagle: bool = False,
) -> str:
    """The `decoder` label of a request (`catalog.strategy`). `eagle`, `draft_model`: whether
    the server has an EAGLE head or a draft model, which makes it the default draft of
    speculative requests (the head first)."""
    return catalog.strategy(decoder, options, catalog.Offered(eagle, draft_model))


def strategies(
    draft_model: bool = False,
    diffusion: bool = False,
    eagle: bool = False,
    introspective: bool = False,
) -> tuple[str, ...]:
    """Every `decoder` label a server offers out of the box (`catalog.strategies`)."""
    return catalog.strategies(catalog.Offered(eagle, draft_model, diffusion, introspective))


def parse_users(value: str | Iterable[str] | None) -> frozenset[str]:
    """`"a,b"` (the flag / STRIDE_METRICS_USERS) or names → the user label allowlist."""
    if value is None:
        value = os.environ.get(USERS_ENV, "")
    names = value.split(",") if isinstance(value, str) else value
    return frozenset(n.strip() for n in names if n and n.strip())


class Metrics:
    """The metric objects of one server, and the hooks that feed them."""

    def __init__(
        self,
        model: str,
        users: str | Iterable[str] | None = None,
        registry: CollectorRegistry | None = None,
        draft_model: bool = False,
        diffusion: bool = False,
        spec_tokens: int = 0,
        eagle: bool = False,
        introspective: bool = False,
    ) -> None:
        """`draft_model`, `diffusion`, `eagle`, `introspective`: whether the server has those
        models (an EAGLE head, a MASK-slot adapter); `spec_tokens`: its default K (the draft
        positions whose series exist from the start)."""
        self.model = model
        self.draft_model = draft_model
        self.eagle = eagle
        self.strategies = strategies(draft_model, diffusion, eagle, introspective)
        self.spec_tokens = spec_tokens
        self.users = parse_users(users)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.multiprocess = bool(os.environ.get(MULTIPROC_ENV))
        if not self.multiprocess:
            ProcessCollector(registry=self.registry)
        r = self.registry
        m, md, mdu = ["model"], ["model", "decoder"], ["model", "decoder", "user"]

        # ---- engine state (step loop) ----
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

        # ---- requests (HTTP edge) ----
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

        # ---- decoders ----
        self.forward_passes = Counter(
            "stride_decoder_forward_passes",
            "Target forward passes that produced tokens for a request.",
            mdu,
            registry=r,
        )
        self.tokens_per_pass = Histogram(
            "stride_decoder_tokens_per_pass",
            "Per request: mean tokens committed per forward pass (refinement, speculation).",
            md,
            buckets=TOKENS_PER_PASS_BUCKETS,
            registry=r,
        )
        self.spec_drafts = Counter(
            "stride_spec_drafts", "Speculative: verification passes that checked a draft.", mdu,
            registry=r,
        )  # fmt: skip
        self.spec_draft_tokens = Counter(
            "stride_spec_draft_tokens", "Speculative: tokens proposed by the drafter.", mdu,
            registry=r,
        )  # fmt: skip
        self.spec_accepted_tokens = Counter(
            "stride_spec_accepted_tokens", "Speculative: drafted tokens the target accepted.",
            mdu, registry=r,
        )  # fmt: skip
        self.spec_accepted_by_position = Counter(
            "stride_spec_accepted_tokens_by_position",
            "Speculative: accepted drafted tokens by their position in the draft (0-based).",
            ["model", "decoder", "position"],
            registry=r,
        )
        # ---- roofline (see stride.engine.roofline) ----
        mstep = ["model", "decoder"]
        self.read_bytes = Counter(
            "stride_engine_read_bytes",
            "Bytes the target's forward passes read (weights once per pass, the K/V of the "
            "context attended), counted from the model's shapes; by the decoder of the step's "
            "sequences (mixed: several).",
            mstep, registry=r,
        )  # fmt: skip
        self.flops = Counter(
            "stride_engine_flops",
            "Floating-point operations of the target's forward passes (linear maps, LM head, "
            "attention), counted from the model's shapes; by the decoder of the step's sequences.",
            mstep, registry=r,
        )  # fmt: skip
        self.step_seconds = Counter(
            "stride_engine_step_seconds",
            "Wall time of engine steps that ran the target, by the decoder of their sequences.",
            mstep, registry=r,
        )  # fmt: skip
        self.passes = Counter(
            "stride_engine_forward_passes",
            "Forward passes of the target, by the decoder of their sequences.",
            mstep, registry=r,
        )  # fmt: skip
        self.scored_tokens = Counter(
            "stride_engine_scored_tokens",
            "Tokens the target scored, by kind: decode (a one-token tail), prefill (longer tails: "
            "prompts, recomputation), draft (proposed by a decoder: drafts, Jacobi guesses).",
            ["model", "kind"], registry=r,
        )  # fmt: skip
        self.peak_bandwidth = engine_gauge(
            "stride_device_peak_bandwidth_bytes_per_second",
            "The device's memory bandwidth (read plus written), measured at start or given.",
        )
        self.peak_flops = engine_gauge(
            "stride_device_peak_flops_per_second",
            "The device's compute peak in the engine's dtype, measured at start or given.",
        )
        self._preemptions_seen = 0
        self._totals: dict[Counter, int] = {}  # engine totals counted so far (`_advance`)

        # Children looked up once (labels() costs microseconds the step loop should not pay);
        # they also make these series exist from the start, so rates read 0, not "no data".
        self._received = self.requests_received.labels(model)
        self._rejected = {r: self.requests_rejected.labels(model, r) for r in REJECT_REASONS}
        self._preempted = self.preemptions.labels(model)
        self._restarts = self.engine_restarts.labels(model)
        self._prefix_queries = self.prefix_cache_queries.labels(model)
        self._prefix_hits = self.prefix_cache_hits.labels(model)
        self._running = self.requests_running.labels(model)
        self._waiting = self.requests_waiting.labels(model)
        self._kv = self.kv_cache_usage.labels(model)
        self._batch = self.batch_size.labels(model)
        self._step = self.step_duration.labels(model)
        self._step_tokens = self.step_tokens.labels(model)
        step_decoders = dict.fromkeys(s.split("/")[0] for s in self.strategies)
        self._roofline = {
            d: (self.read_bytes.labels(model, d), self.flops.labels(model, d),
                self.step_seconds.labels(model, d), self.passes.labels(model, d))
            for d in (*step_decoders, STEP_DECODER_MIXED)
        }  # fmt: skip
        self._scored = {k: self.scored_tokens.labels(model, k) for k in SCORED_KINDS}
        self._peaks = (self.peak_bandwidth.labels(model), self.peak_flops.labels(model))
        self._series: dict[tuple[str, str, str], RequestSeries] = {}
        self._gauges: dict[Gauge, float] = {}  # last value set
        for decoder in self.strategies:
            for user in (*sorted(self.users), OTHER_USER, NO_USER):
                self._series_of((model, decoder, user))

    # ---- labels ---------------------------------------------------------------------------

    def user_label(self, user: str | None) -> str:
        if not user:
            return NO_USER
        return user if user in self.users else OTHER_USER

    # ---- step loop ------------------------------------------------------------------------

    def on_step(self, stats: StepStats, step_seconds: float, outputs: list[RequestOutput]) -> None:
        """The engine client's `on_step`: after every engine step, on the client's loop thread."""
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
        load = stats.load
        if load.passes:
            children = self._roofline.get(load.decoder)
            if children is None:  # a decoder registered outside Stride: bounded by the registry
                children = self._roofline[load.decoder] = tuple(
                    c.labels(self.model, load.decoder)
                    for c in (self.read_bytes, self.flops, self.step_seconds, self.passes)
                )
            read, flops, seconds, passes = children
            read.inc(load.read_bytes)
            flops.inc(load.flops)
            seconds.inc(step_seconds)
            passes.inc(load.passes)
            for kind, n in zip(SCORED_KINDS, (load.decode_rows, load.prefill_tokens,
                                              load.draft_rows), strict=True):  # fmt: skip
                if n:
                    self._scored[kind].inc(n)

    def set_peaks(self, bandwidth: float, flops: float) -> None:
        """The device's roof, once the engine is loaded (it measures it when it starts)."""
        self._put(self._peaks[0], bandwidth)
        self._put(self._peaks[1], flops)

    def _advance(self, counter: Counter, total: int) -> None:
        """Count what one of the engine's running totals grew by since it was last seen."""
        seen = self._totals.get(counter, 0)
        if total > seen:
            counter.inc(total - seen)
            self._totals[counter] = total

    def engine_restarted(self) -> None:
        """The engine client's `on_restart`: a restarted engine serves (its gauges start at 0)."""
        self._restarts.inc()
        self._totals.clear()  # a new engine's running totals start again from 0
        self._preemptions_seen = 0
        for gauge in (self._running, self._waiting, self._kv, self._batch):
            self._put(gauge, 0)

    def _put(self, gauge: Gauge, value: float) -> None:
        """Set a gauge only when its value changed: most steps change none (a lock each)."""
        if self._gauges.get(gauge) != value:
            self._gauges[gauge] = value
            gauge.set(value)

    # ---- HTTP edge ------------------------------------------------------------------------

    def received(self) -> None:
        self._received.inc()

    def rejected(self, reason: str) -> None:
        """A request refused before admission, or one whose deadline passed."""
        if reason not in REJECT_REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}")
        self._rejected[reason].inc()

    def track(
        self,
        decoder: str,
        user: str | None,
        options: Mapping[str, Any] | None = None,
        trace_id: str | None = None,
    ) -> RequestTracker:
        """Start timing one admitted-to-be request (arrival is now); feed it every output.

        `decoder` and `options` are the request's parsed decoder spec; the label is its strategy.
        `trace_id`: a traced request's (hex), the exemplar of its latency observations.
        """
        label = strategy(decoder, options, self.draft_model, self.eagle)
        labels = (self.model, label, self.user_label(user))
        exemplar = None if trace_id is None else {"trace_id": trace_id}
        return RequestTracker(self, self._series_of(labels), exemplar=exemplar)

    def _series_of(self, labels: tuple[str, str, str]) -> RequestSeries:
        series = self._series.get(labels)
        if series is None:  # label sets are bounded: strategies x (allowlist + other + none)
            series = self._series[labels] = RequestSeries(self, labels)
        return series

    async def log_stats(self, interval: float = STATS_INTERVAL) -> None:
        """Every `interval` seconds while there is work, one line: prompt and generation
        throughput (the whole server's, every API process's), running and waiting sequences
        and KV-cache usage. Silent while idle."""
        before, then = self._tokens(), time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now, at = self._tokens(), time.monotonic()
            running = self._gauges.get(self._running, 0)
            waiting = self._gauges.get(self._waiting, 0)
            if now != before or running or waiting:
                seconds = at - then
                stats_log.info(
                    "prompt %.1f tokens/s, generation %.1f tokens/s, running %d, waiting %d, "
                    "KV cache %.1f%%",
                    (now[0] - before[0]) / seconds,
                    (now[1] - before[1]) / seconds,
                    running,
                    waiting,
                    100 * self._gauges.get(self._kv, 0.0),
                )
            before, then = now, at

    def _tokens(self) -> tuple[float, float]:
        """Prompt and generated tokens so far (in multiprocess mode: of every API process)."""
        registry = self.registry
        if self.multiprocess:
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
        totals = {"stride_prompt_tokens_total": 0.0, "stride_generation_tokens_total": 0.0}
        for family in registry.collect():
            for sample in family.samples:
                if sample.name in totals:
                    totals[sample.name] += sample.value
        return totals["stride_prompt_tokens_total"], totals["stride_generation_tokens_total"]

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The exposition for `GET /metrics`: (body, content type); every API process's.

        In the format `accept` (the request's Accept header) asks for: OpenMetrics, which
        carries exemplars, for Prometheus; else the classic text format. (Exemplars are lost
        with several API processes: prometheus_client's multiprocess mode keeps none.)"""
        encode, content_type = choose_encoder(accept)
        if not self.multiprocess:
            return encode(self.registry), content_type
        merged = CollectorRegistry()
        MultiProcessCollector(merged)
        return encode(merged), content_type


class RequestSeries:
    """The children of every per-request metric for one (model, decoder, user)."""

    def __init__(self, m: Metrics, labels: tuple[str, str, str]) -> None:
        self.labels = labels
        self.prompt_tokens = m.prompt_tokens.labels(*labels)
        self.generation_tokens = m.generation_tokens.labels(*labels)
        self.ttft = m.ttft.labels(*labels)
        self.itl = m.itl.labels(*labels)
        self.tpot = m.tpot.labels(*labels)
        self.e2e = m.e2e.labels(*labels)
        self.queue_time = m.queue_time.labels(*labels)
        self.prefill_time = m.prefill_time.labels(*labels)
        self.decode_time = m.decode_time.labels(*labels)
        self.finished = {r: m.requests_finished.labels(*labels, r) for r in FINISH_REASONS}
        self.forward_passes = m.forward_passes.labels(*labels)
        self.tokens_per_pass = m.tokens_per_pass.labels(*labels[:2])
        if labels[1].startswith("speculative/"):  # only speculative decoding drafts
            for counter in (m.spec_drafts, m.spec_draft_tokens, m.spec_accepted_tokens):
                counter.labels(*labels)  # at 0 from the first scrape; fed in `_finish`
            for position in range(m.spec_tokens):
                m.spec_accepted_by_position.labels(*labels[:2], str(position))


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

    metrics: Metrics
    series: RequestSeries
    arrival: float = field(default_factory=time.perf_counter)
    streams: dict[str, _Stream] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    http: _HttpRequest | None = field(default_factory=lambda: _current_http.get())
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
        http = self.http
        if s is None:
            s = self.streams[out.request_id] = _Stream()
            if http is not None:  # admitted: its end is counted here, not as a rejection
                http.admitted = True
                http.decoder = series.labels[1]
        if not s.counted_prompt and out.num_prompt_tokens:
            series.prompt_tokens.inc(out.num_prompt_tokens)
            s.counted_prompt = True
            if http is not None:
                http.prompt_tokens += out.num_prompt_tokens
        k = len(out.token_ids)
        if k:
            series.generation_tokens.inc(k)
            if http is not None:
                http.completion_tokens += k
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
        m, series, labels = self.metrics, self.series, self.series.labels
        reason = out.finish_reason or "error"
        if out.error is not None and out.error.code == "deadline_exceeded":
            reason = "deadline"
        self._count_finish(reason)
        if reason == "deadline":
            m.rejected("deadline")
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
            m.spec_drafts.labels(*labels).inc(int(stats.get("drafts", 0)))
            m.spec_draft_tokens.labels(*labels).inc(drafted)
            m.spec_accepted_tokens.labels(*labels).inc(int(stats.get("accepted_tokens", 0)))
            for pos, n in enumerate(stats.get("accepted_per_position", ())):
                m.spec_accepted_by_position.labels(*labels[:2], str(pos)).inc(n)

    def _count_finish(self, reason: str) -> None:
        child = self.series.finished.get(reason)
        if child is None:
            child = self.metrics.requests_finished.labels(*self.series.labels, reason)
        child.inc()


# HTTP status of a refused generation request -> rejection reason. A deadline that passed once
# the request was admitted is counted by its tracker (which also sees deadlines that end a
# stream after its 200), one that passed before by its 504 here.
STATUS_REASONS = {400: "validation", 404: "validation", 413: "validation", 422: "validation",
                  401: "auth", 429: "queue_full", 500: "internal", 503: "unavailable",
                  504: "deadline"}  # fmt: skip
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# Open while loading or draining, never counted as in flight, logged at debug only: orchestrators
# and Prometheus call them every few seconds.
PROBES = frozenset({"/health", "/metrics"})


@dataclass
class _HttpRequest:
    """One HTTP request as the access line tells it (trackers fill in what they see)."""

    admitted: bool = False
    status: int | None = None
    decoder: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


# The HTTP request being served (set by the middleware, seen by trackers made while serving it).
_current_http: ContextVar[_HttpRequest | None] = ContextVar("stride_http_request", default=None)


class MetricsMiddleware:
    """ASGI middleware: counts generation requests received and refused (by status code), and
    writes the access line of every request.

    Sits outside authentication so that 401s are seen. A request that was admitted (its tracker
    saw an output) and failed later is counted by the tracker as finished with `error`, not here.
    `get_metrics` may return None (no metrics: nothing is counted). Probes (/health, /metrics,
    every few seconds from orchestrators and Prometheus) are logged at debug only.
    """

    def __init__(self, app: Any, get_metrics: Callable[[], Metrics | None]) -> None:
        self.app = app
        self.get_metrics = get_metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        metrics = self.get_metrics()
        counted = metrics is not None and scope["path"] in GENERATION_PATHS
        if counted:
            metrics.received()
        http = _HttpRequest()
        token = _current_http.set(http)

        async def send_counting(message: dict) -> None:
            if message["type"] == "http.response.start":
                http.status = message["status"]
                reason = STATUS_REASONS.get(message["status"])
                if counted and reason is not None and not http.admitted:
                    metrics.rejected(reason)
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        finally:
            _current_http.reset(token)
            _log_access(scope, http, time.perf_counter() - start)


def _log_access(scope: dict, http: _HttpRequest, seconds: float) -> None:
    level = logging.DEBUG if scope["path"] in PROBES else logging.INFO
    if not access_log.isEnabledFor(level):
        return
    client = scope.get("client")
    tokens = ""
    if http.decoder is not None:
        tokens = (
            f" decoder={http.decoder} prompt_tokens={http.prompt_tokens}"
            f" completion_tokens={http.completion_tokens}"
        )
    access_log.log(
        level,
        '%s "%s %s" %s%s %.3fs',
        client[0] if client else "-",
        scope["method"],
        scope["path"],
        http.status if http.status is not None else "-",
        tokens,
        seconds,
    )
