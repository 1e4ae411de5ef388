"""One server's metrics: a registry holding every group, the hooks that feed them, the exposition.

The step loop's hooks (`on_step`, `engine_restarted`, `set_peaks`) feed the `engine` and
`roofline` groups; the HTTP edge's (`received`, `rejected`, `track`) the `requests` and
`decoders` groups. Every series whose labels are known at start-up is made here, at 0: the
decoders on offer (`Metrics.strategies`) x the users' labels, each finish and rejection reason,
and the draft positions up to the server's default K.

Every few seconds while there is work, `log_stats` writes one line of throughput and engine
state (`stride.stats`), like vLLM's, from the numbers kept anyway.

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
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.multiprocess import MultiProcessCollector

from stride.metrics import labels
from stride.metrics.decoders import DecoderMetrics
from stride.metrics.engine import EngineMetrics
from stride.metrics.requests import RequestMetrics
from stride.metrics.roofline import RooflineMetrics
from stride.metrics.tracker import RequestSeries, RequestTracker

if TYPE_CHECKING:
    from stride.scheduler.outputs import RequestOutput, StepStats

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # read by prometheus_client when first imported
STATS_INTERVAL = 5.0  # seconds between two stats lines while busy (vLLM: 5 to 10)

stats_log = logging.getLogger("stride.stats")


class Metrics:
    """The metric groups of one server, in one registry, and the hooks that feed them."""

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
        self.strategies = labels.strategies(draft_model, diffusion, eagle, introspective)
        self.spec_tokens = spec_tokens
        self.users = labels.parse_users(users)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.multiprocess = bool(os.environ.get(MULTIPROC_ENV))
        if not self.multiprocess:
            ProcessCollector(registry=self.registry)
        self.engine = EngineMetrics(self.registry, model)
        self.requests = RequestMetrics(self.registry, model)
        self.decoders = DecoderMetrics(self.registry)
        step_decoders = [s.split("/")[0] for s in self.strategies]  # registry names
        self.roofline = RooflineMetrics(self.registry, model, step_decoders)
        self._series: dict[tuple[str, str, str], RequestSeries] = {}
        for decoder in self.strategies:
            for user in (*sorted(self.users), labels.OTHER_USER, labels.NO_USER):
                self._series_of((model, decoder, user))

    def user_label(self, user: str | None) -> str:
        return labels.user_label(user, self.users)

    # ---- step loop ------------------------------------------------------------------------

    def on_step(self, stats: StepStats, step_seconds: float, outputs: list[RequestOutput]) -> None:
        """The engine client's `on_step`: after every engine step, on the client's loop thread."""
        self.engine.on_step(stats, step_seconds)
        self.roofline.on_step(stats.load, step_seconds)

    def set_peaks(self, bandwidth: float, flops: float) -> None:
        """The device's roof, once the engine is loaded (it measures it when it starts)."""
        self.roofline.set_peaks(bandwidth, flops)

    def engine_restarted(self) -> None:
        """The engine client's `on_restart`: a restarted engine serves (its gauges start at 0)."""
        self.engine.restarted()

    # ---- HTTP edge ------------------------------------------------------------------------

    def received(self) -> None:
        self.requests.received()

    def rejected(self, reason: str) -> None:
        """A request refused before admission, or one whose deadline passed."""
        self.requests.rejected(reason)

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
        label = labels.strategy(decoder, options, self.draft_model, self.eagle)
        series = self._series_of((self.model, label, self.user_label(user)))
        exemplar = None if trace_id is None else {"trace_id": trace_id}
        return RequestTracker(series, exemplar=exemplar)

    def _series_of(self, key: tuple[str, str, str]) -> RequestSeries:
        series = self._series.get(key)
        if series is None:  # label sets are bounded: strategies x (allowlist + other + none)
            series = RequestSeries(self.requests, self.decoders, key, self.spec_tokens)
            self._series[key] = series
        return series

    # ---- reading ----------------------------------------------------------------------------

    async def log_stats(self, interval: float = STATS_INTERVAL) -> None:
        """Every `interval` seconds while there is work, one line: prompt and generation
        throughput (the whole server's, every API process's), running and waiting sequences
        and KV-cache usage. Silent while idle."""
        before, then = self._tokens(), time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now, at = self._tokens(), time.monotonic()
            running, waiting, kv_usage = self.engine.load()
            if now != before or running or waiting:
                seconds = at - then
                stats_log.info(
                    "prompt %.1f tokens/s, generation %.1f tokens/s, running %d, waiting %d, "
                    "KV cache %.1f%%",
                    (now[0] - before[0]) / seconds,
                    (now[1] - before[1]) / seconds,
                    running,
                    waiting,
                    100 * kv_usage,
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
