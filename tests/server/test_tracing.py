"""Request traces over real OTLP/HTTP: a receiver on loopback decodes what Stride exports.

The receiver is a plain HTTP server that parses each POST /v1/traces body as OTLP's protobuf
`ExportTraceServiceRequest` (the messages ship with the exporter). A live server on a tiny model
traces every request to it; the spans must tell the request's story as the client saw it
(tokens, drafts, the client's own trace context), and the latency histograms must carry the
trace id as an exemplar. With tracing off, no OpenTelemetry SDK or exporter is imported at all.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from stride.engine.config import EngineConfig
from stride.server.app import ServerConfig
from tests.helpers.servers import LiveServer, free_port

ROOT = Path(__file__).resolve().parents[2]
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SPECULATIVE = {
    "type": "speculative",
    "draft": "early_exit",
    "adaptive": False,
    "num_speculative_tokens": 3,
}


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver: every span it was sent, as plain dicts."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.spans: list[dict] = []
        self.posts: list[str] = []  # content types of the requests
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def trace(self, trace_id: str, names: set[str], timeout: float = 20.0) -> list[dict]:
        """The spans of `trace_id`, once spans of all of `names` arrived."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                spans = [s for s in self.spans if s["trace_id"] == trace_id]
            if names <= {s["name"] for s in spans}:
                return spans
            time.sleep(0.05)
        raise AssertionError(f"no complete trace {trace_id}; got {[s['name'] for s in spans]}")


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest.FromString(body)
        spans = [
            _plain(span, resource)
            for resource in request.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]
        with self.server.lock:
            self.server.posts.append(self.headers["Content-Type"])
            self.server.spans += spans
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args) -> None:
        pass


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


def _attrs(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


def _plain(span, resource) -> dict:
    return {
        "name": span.name,
        "trace_id": span.trace_id.hex(),
        "span_id": span.span_id.hex(),
        "parent": span.parent_span_id.hex(),
        "start": span.start_time_unix_nano,
        "end": span.end_time_unix_nano,
        "attrs": _attrs(span.attributes),
        "events": [(e.name, e.time_unix_nano, _attrs(e.attributes)) for e in span.events],
        "status": span.status.code,
        "service": _attrs(resource.resource.attributes).get("service.name"),
    }


@pytest.fixture(scope="module")
def receiver():
    server = Receiver()
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def traced(tiny_dir, receiver):
    """A live server tracing every request to `receiver` (batches sent every 50 ms)."""
    saved = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "50"
    engine = EngineConfig(model=str(tiny_dir), served_name="tiny", device="cpu",
                          kv_cache_memory=8 << 20)  # fmt: skip
    server = LiveServer(ServerConfig(engine=engine, otlp_traces_endpoint=receiver.url))
    yield server
    server.stop()
    if saved is None:
        os.environ.pop("OTEL_BSP_SCHEDULE_DELAY")
    else:
        os.environ["OTEL_BSP_SCHEDULE_DELAY"] = saved


def stream(server: LiveServer, body: dict, headers: dict | None = None) -> dict:
    """Stream a completion to its end; the final usage."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    usage = None
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers,
                      timeout=60) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    assert usage is not None
    return usage


def test_streamed_speculative_request_is_one_trace_continuing_the_clients(traced, receiver):
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0.0, "ignore_eos": True,
            "decoder": SPECULATIVE}  # fmt: skip
    usage = stream(traced, body, headers)
    spans = receiver.trace(CLIENT_TRACE, {"text_completion tiny", "queue", "prefill", "decode"})

    (root,) = [s for s in spans if s["name"] == "text_completion tiny"]
    assert root["parent"] == CLIENT_SPAN  # the client's span is the parent: its trace goes on
    assert root["service"] == "stride"
    assert root["attrs"]["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 24
    assert root["attrs"]["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert root["attrs"]["gen_ai.response.finish_reasons"] == ["length"]
    assert root["attrs"]["stride.decoder"] == "speculative"
    children = [s for s in spans if s is not root]
    assert {s["parent"] for s in children} == {root["span_id"]}
    for s in spans:
        assert s["trace_id"] == CLIENT_TRACE and s["start"] <= s["end"]
        assert root["start"] <= s["start"] and s["end"] <= root["end"]

    (queue,) = [s for s in children if s["name"] == "queue"]
    prefills = sorted((s for s in children if s["name"] == "prefill"), key=lambda s: s["start"])
    (decode,) = [s for s in children if s["name"] == "decode"]
    assert queue["end"] <= prefills[0]["start"]
    assert prefills[-1]["end"] <= decode["start"]
    prefilled = sum(s["attrs"]["stride.tokens"] for s in prefills)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert prefilled == usage["prompt_tokens"] - cached

    # One event per verification of drafts, adding up to what usage reports.
    stats = usage["decoder"]
    events = decode["events"]
    assert events and {name for name, _, _ in events} == {"draft_verify"}
    assert sum(a["stride.cycles"] for _, _, a in events) == stats["drafts"]
    assert sum(a["stride.drafted"] for _, _, a in events) == stats["draft_tokens"]
    assert sum(a["stride.accepted"] for _, _, a in events) == stats["accepted_tokens"]
    for _, at, a in events:
        assert a["stride.accepted"] <= a["stride.drafted"]
        assert decode["start"] <= at <= decode["end"]
    assert decode["attrs"]["stride.decoder.draft_tokens"] == stats["draft_tokens"]


def test_refinement_passes_are_events_and_a_new_trace_without_traceparent(traced, receiver):
    jacobi = {"type": "refine", "method": "jacobi", "window": 4}  # refines every step
    body = {"prompt": "def add(a, b): return a + b", "max_tokens": 16, "temperature": 0.0,
            "ignore_eos": True, "decoder": jacobi}  # fmt: skip
    before = {s["trace_id"] for s in receiver.spans}
    usage = traced.post("/v1/completions", body).json()["usage"]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        new = {s["trace_id"] for s in receiver.spans} - before - {CLIENT_TRACE}
        if new:
            break
        time.sleep(0.05)
    (trace_id,) = new
    spans = receiver.trace(trace_id, {"text_completion tiny", "queue", "decode"})
    (root,) = [s for s in spans if not s["parent"]]  # no traceparent: a trace of its own
    (decode,) = [s for s in spans if s["name"] == "decode"]
    passes = [a for name, _, a in decode["events"] if name == "refinement_pass"]
    assert passes and all(a["stride.proposed"] >= 1 for a in passes)
    # Each pass commits what it kept; the first token came with the prefill.
    assert sum(a["stride.committed"] for a in passes) == usage["completion_tokens"] - 1


def test_latency_histograms_carry_the_trace_id_as_exemplar(traced, receiver):
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    headers = {"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"}
    stream(traced, {"prompt": "hello there", "max_tokens": 4}, headers)
    openmetrics = {"Accept": "application/openmetrics-text;version=1.0.0"}
    r = httpx.get(f"{traced.url}/metrics", headers=openmetrics, timeout=10)
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    for family in ("stride_time_to_first_token_seconds", "stride_e2e_request_latency_seconds"):
        tagged = [
            line
            for line in r.text.splitlines()
            if line.startswith(family + "_bucket") and f'trace_id="{trace_id}"' in line
        ]
        assert tagged, family  # fmt: skip
    plain = httpx.get(f"{traced.url}/metrics", timeout=10)  # the classic format: no exemplars
    assert plain.headers["content-type"].startswith("text/plain") and "trace_id" not in plain.text


def test_a_client_that_does_not_sample_gets_no_trace(traced, receiver):
    trace_id = "1af7651916cd43dd8448eb211c80319c"
    headers = {"traceparent": f"00-{trace_id}-b7ad6b7169203331-00"}  # sampled flag off
    stream(traced, {"prompt": "hello", "max_tokens": 3}, headers)
    stream(traced, {"prompt": "hello", "max_tokens": 3}, {"traceparent": headers["traceparent"]
                                                           .replace("-00", "-01")})  # fmt: skip
    spans = receiver.trace(trace_id, {"text_completion tiny", "queue", "decode"})
    assert len([s for s in spans if s["name"] == "queue"]) == 1  # the sampled one only


OFF = """
import sys, httpx
from stride.engine.config import EngineConfig
from stride.server.app import ServerConfig
from tests.helpers.servers import LiveServer, free_port
server = LiveServer(ServerConfig(engine=EngineConfig(model=sys.argv[1], device="cpu",
                                                     kv_cache_memory=4 << 20)))
r = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": True})
assert r.status_code == 200, r.text
assert server.app.state.tracing is None
server.stop()
print(sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk",
                                                     "opentelemetry.exporter"))))
"""


def test_with_tracing_off_no_sdk_or_exporter_is_imported(tiny_dir):
    """A fresh interpreter serves a request without tracing: nothing of the SDK loads (FastAPI
    itself may import the OpenTelemetry API, which is a no-op without an SDK)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", OFF, str(tiny_dir)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_cli_refuses_tracing_it_cannot_do():
    env = {**os.environ, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}
    cmd = [sys.executable, "-m", "stride.server.cli", "serve", "--otlp-traces-endpoint",
           "http://127.0.0.1:9/v1/traces"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--otlp-traces-endpoint: OTLP protocol 'http/json' is not supported" in done.stderr


def test_preemptions_are_events_of_the_request(tiny_dir):
    """7 usable blocks of 16 tokens: four traced requests of 50 tokens cannot all stay resident.
    The timelines the core returns note each preemption, and the spans show them."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from stride.engine.sequence import SamplingParams
    from stride.scheduler.outputs import GenerateRequest
    from stride.tracing import RequestTrace
    from tests.helpers.cores import make_core

    core = make_core(tiny_dir, kv_bytes=8 * 8192)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i in range(4):
        core.add(GenerateRequest(f"p{i}", [3 + i] * 10, params, trace=True))
    last = {}
    while core.has_work:
        last.update({o.request_id: o for o in core.step() if o.finished})
    assert core.scheduler.num_preemptions > 0
    timelines = {rid: out.timeline for rid, out in last.items()}
    preempted = {rid: sum(e[0] == "preempted" for e in t.events) for rid, t in timelines.items()}
    assert sum(preempted.values()) == core.scheduler.num_preemptions
    for t in timelines.values():  # (a preempted prompt's blocks may stay in the prefix cache)
        assert t.arrival <= t.scheduled <= t.prefill[0][0] <= t.first_token <= t.finished
        assert all(t.first_token < at < t.finished for name, at, _ in t.events)

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    victim = max(preempted, key=preempted.get)
    trace = RequestTrace(tracer, tracer.start_span("request"))
    trace.finished(last[victim])
    trace.end()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert [e.name for e in spans["request"].events] == ["preempted"] * preempted[victim]
    assert spans["request"].attributes["gen_ai.usage.output_tokens"] == 40
    assert core.seqs == {} and not core._timelines


def test_traces_cross_from_an_engine_process(tiny_dir, receiver, monkeypatch):
    """The step loop in its own process: the timeline comes back over the pipe as plain data."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    engine = EngineConfig(model=str(tiny_dir), served_name="tiny", device="cpu",
                          kv_cache_memory=4 << 20)  # fmt: skip
    config = ServerConfig(engine=engine, engine_process=True, otlp_traces_endpoint=receiver.url)
    server = LiveServer(config)
    try:
        trace_id = "2af7651916cd43dd8448eb211c80319c"
        headers = {"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"}
        usage = stream(server, {"prompt": "hello there", "max_tokens": 5}, headers)
    finally:
        server.stop()
    spans = receiver.trace(trace_id, {"text_completion tiny", "queue", "prefill", "decode"})
    (prefill,) = [s for s in spans if s["name"] == "prefill"]
    assert prefill["attrs"]["stride.tokens"] == usage["prompt_tokens"]


PROMETHEUS = shutil.which("prometheus")


@pytest.mark.skipif(PROMETHEUS is None, reason="the prometheus binary is missing")
def test_prometheus_stores_the_exemplars_that_link_latency_to_traces(traced, tmp_path):
    """A real Prometheus (exemplar storage on, as in the compose stack) scrapes the traced
    server: the TTFT histogram's exemplar holds the trace id of the request that made it."""
    trace_id = "3af7651916cd43dd8448eb211c80319c"
    stream(traced, {"prompt": "exemplars please", "max_tokens": 3},
           {"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"})  # fmt: skip
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "stride",
                "metrics_path": "/metrics",
                "static_configs": [{"targets": [f"127.0.0.1:{traced.port}"]}],
            }
        ],
    }
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
         "--enable-feature=exemplar-storage", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/api/v1/query_exemplars"
    found: set[str] = set()
    try:
        deadline = time.monotonic() + 30
        while trace_id not in found and time.monotonic() < deadline:
            time.sleep(0.5)
            params = {"query": "stride_time_to_first_token_seconds_bucket",
                      "start": time.time() - 600, "end": time.time() + 60}  # fmt: skip
            try:
                body = httpx.get(url, params=params, timeout=5).json()
            except httpx.HTTPError:
                continue
            found = {e["labels"].get("trace_id") for series in body.get("data") or []
                     for e in series["exemplars"]}  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert trace_id in found


def test_a_refused_request_is_a_trace_ending_in_error(traced, receiver):
    trace_id = "5af7651916cd43dd8448eb211c80319c"
    headers = {"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"}
    body = {"prompt": "hi", "max_tokens": 4, "timeout": 1e-6}  # its deadline passes at once
    r = traced.post("/v1/completions", body, headers=headers)
    assert r.status_code == 504
    (root,) = receiver.trace(trace_id, {"text_completion tiny"})
    assert root["status"] == 2  # ERROR
    assert root["attrs"]["gen_ai.usage.output_tokens"] == 0
