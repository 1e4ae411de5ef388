"""Request timelines as OpenTelemetry traces, sent over OTLP (`--otlp-traces-endpoint`, vLLM's
flag name).

One trace per HTTP generation request: a root span from the request's arrival to its last byte
(continuing the client's W3C `traceparent`, if it sent one), and under it, per engine request
(prompt x sample), a `queue` span (admitted until first scheduled), one `prefill` span per
prefill chunk, and a `decode` span (first token to the end) whose events are the draft/verify
cycles (drafted, accepted, committed) and refinement passes; preemptions are events of the root.
The spans are built once a request ends, from the timeline the step loop kept for it
(`stride.scheduler.timeline`): the loop never calls the SDK, and works the same in its own
process.

The SDK and the OTLP exporter are the optional extra `stride[tracing]`. Without the flag
nothing here imports them (this module is free to import), requests carry `trace=False`, and
the step loop keeps no timelines. The standard OTEL_* variables apply: OTEL_SERVICE_NAME and
OTEL_RESOURCE_ATTRIBUTES (the resource), OTEL_TRACES_SAMPLER(_ARG) (by default a client's
sampling decision is followed), OTEL_PROPAGATORS, OTEL_EXPORTER_OTLP_TRACES_{HEADERS,TIMEOUT,
COMPRESSION,PROTOCOL} (http/protobuf, or grpc with its exporter installed), OTEL_BSP_* (batching),
and OTEL_SDK_DISABLED=true turns tracing off.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from stride.scheduler.outputs import RequestOutput
from stride.scheduler.timeline import PREEMPTED

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger(__name__)

EXTRA = "pip install 'stride[tracing]'"
HTTP_PATH = "/v1/traces"  # OTLP/HTTP's path, added to an endpoint given without one
_EXPORTERS = {
    "http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
}


def protocol() -> str:
    return (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()


def unavailable() -> str | None:
    """Why tracing cannot start here (a protocol without its exporter installed), or None.

    Looks for the modules without importing them: the CLI asks before anything loads."""
    exporter = _EXPORTERS.get(protocol())
    if exporter is None:
        return f"OTLP protocol {protocol()!r} is not supported: use http/protobuf or grpc"
    for module in ("opentelemetry.sdk.trace", exporter):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return f"tracing needs the OpenTelemetry SDK and exporter ({module}): {EXTRA}"
    return None


def disabled() -> bool:
    """OTEL_SDK_DISABLED=true: the standard switch that turns every OpenTelemetry SDK off."""
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


class Tracing:
    """The server's tracer: its provider batches spans to the OTLP exporter of `endpoint`."""

    def __init__(self, endpoint: str) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        kind = protocol()
        module = importlib.import_module(_EXPORTERS[kind])
        if kind == "http/protobuf" and urlsplit(endpoint).path in ("", "/"):
            endpoint = endpoint.rstrip("/") + HTTP_PATH
        resource = Resource.create()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": "stride"}))
        self.endpoint = endpoint
        self.provider: TracerProvider = TracerProvider(resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(module.OTLPSpanExporter(endpoint)))
        self.tracer: Tracer = self.provider.get_tracer("stride")

    def start(
        self,
        operation: str,
        model: str,
        headers: Mapping[str, str],
        arrival: float,
        attributes: dict[str, Any],
    ) -> RequestTrace | None:
        """The root span of one request, begun at `arrival` (time.monotonic()) as the child of
        the client's `traceparent`; None if the sampler drops it."""
        from opentelemetry import propagate
        from opentelemetry.trace import SpanKind

        parent = propagate.extract(headers)
        attrs = {"gen_ai.operation.name": operation, "gen_ai.request.model": model}
        span = self.tracer.start_span(
            f"{operation} {model}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={**attrs, **attributes},
            start_time=_wall_ns(arrival),
        )
        if not span.is_recording():
            return None
        return RequestTrace(self.tracer, span)

    def shutdown(self) -> None:
        """Send what is batched, then stop (the server is stopping)."""
        self.provider.shutdown()


class RequestTrace:
    """The trace of one HTTP request: its root span, and its engine requests' spans."""

    def __init__(self, tracer: Tracer, root: Span) -> None:
        self.tracer = tracer
        self.root = root
        self.trace_id = format(root.get_span_context().trace_id, "032x")
        self._input = 0
        self._output = 0
        self._reasons: list[str] = []
        self._error: str | None = None
        self._ended = False

    def finished(self, out: RequestOutput) -> None:
        """One engine request's final output: its spans, from the timeline it carries."""
        self._input += out.num_prompt_tokens
        self._output += out.num_output_tokens
        self._reasons.append(out.finish_reason or "error")
        if out.error is not None and self._error is None:
            self._error = f"{out.error.code}: {out.error.message}"
        timeline = out.timeline
        if timeline is None:  # ended before the engine had it (refused, expired at the edge)
            return
        from opentelemetry import trace

        parent = trace.set_span_in_context(self.root)
        who = {"stride.request_id": out.request_id}
        now_mono, now_ns = time.monotonic(), time.time_ns()

        def at(t: float) -> int:
            return now_ns + int((t - now_mono) * 1e9)

        def span(name: str, start: float, end: float, attributes: dict[str, Any]) -> Span:
            s = self.tracer.start_span(
                name, context=parent, attributes={**who, **attributes}, start_time=at(start)
            )
            s.end(end_time=at(end))
            return s

        end = timeline.finished or now_mono
        span("queue", timeline.arrival, timeline.scheduled or end, {})
        for i, (start, stop, tokens, cached) in enumerate(timeline.prefill):
            attrs = {"stride.chunk": i, "stride.tokens": tokens, "stride.cached_before": cached}
            span("prefill", start, stop, attrs)
        events = [e for e in timeline.events if e[0] != PREEMPTED]
        for name, t, _ in timeline.events:
            if name == PREEMPTED:
                self.root.add_event(name, who, timestamp=at(t))
        if timeline.first_token is None:
            return
        decode = self.tracer.start_span(
            "decode",
            context=parent,
            attributes={**who, "stride.output_tokens": out.num_output_tokens,
                        **_numbers("stride.decoder.", out.decoder_stats)},
            start_time=at(timeline.first_token),
        )  # fmt: skip
        for name, t, attrs in events:
            decode.add_event(name, {f"stride.{k}": v for k, v in attrs.items()}, at(t))
        decode.end(end_time=at(end))

    def refused(self, error: BaseException) -> None:
        """It was not admitted (429, 400, a passed deadline, a dead engine) or the client left
        while it was: the trace ends in error, saying why."""
        self._error = f"{type(error).__name__}: {error}"[:500]

    def end(self) -> None:
        """The HTTP request is over (its last byte sent, or the client gone)."""
        if self._ended:
            return
        self._ended = True
        from opentelemetry.trace import Status, StatusCode

        root = self.root
        root.set_attribute("gen_ai.usage.input_tokens", self._input)
        root.set_attribute("gen_ai.usage.output_tokens", self._output)
        if self._reasons:
            root.set_attribute("gen_ai.response.finish_reasons", self._reasons)
        if self._error is not None:
            root.set_status(Status(StatusCode.ERROR, self._error))
        root.end()


def request_attributes(
    decoder: str, options: Mapping[str, Any], max_tokens: int, temperature: float, n: int
) -> dict[str, Any]:
    """The root span's attributes of a request as asked (GenAI semantic conventions + Stride's)."""
    attrs: dict[str, Any] = {
        "gen_ai.request.max_tokens": max_tokens,
        "gen_ai.request.temperature": temperature,
        "gen_ai.request.choice.count": n,
        "stride.decoder": decoder,
    }
    if options:
        attrs["stride.decoder.options"] = json.dumps(options, sort_keys=True)
    return attrs


def _numbers(prefix: str, stats: Mapping[str, Any]) -> dict[str, Any]:
    """A decoder's summary as span attributes (its numbers: the name is the root's)."""
    return {prefix + k: v for k, v in stats.items() if isinstance(v, int | float)}


def _wall_ns(t: float) -> int:
    """A time.monotonic() instant as nanoseconds since the epoch (what OTLP carries)."""
    return time.time_ns() + int((t - time.monotonic()) * 1e9)
