"""The compose stack's trace store is wired in, as code (no Docker here).

Stride sends its request traces to Jaeger over OTLP/HTTP; Grafana has Jaeger as a data source,
and Prometheus (storing exemplars) links a latency exemplar's trace id to it; the dashboard's
latency panels show exemplars. `tests/server/test_tracing.py` checks what Stride sends and exposes.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from stride.tracing import HTTP_PATH

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SOURCES = DEPLOY / "grafana" / "provisioning" / "datasources"


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def test_stride_sends_traces_to_the_stack_trace_store():
    services = compose()["services"]
    jaeger, stride = services["jaeger"], services["stride"]
    assert jaeger["image"].startswith("jaegertracing/all-in-one:")
    assert jaeger["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    endpoint = urlsplit(stride["environment"]["STRIDE_OTLP_TRACES_ENDPOINT"])
    assert (endpoint.hostname, endpoint.port, endpoint.path) == ("jaeger", 4318, HTTP_PATH)
    assert "jaeger" in stride["depends_on"]
    # The image has the tracing extra, or the server would refuse the endpoint at start.
    assert "pip install '.[tracing]'" in (ROOT / "Dockerfile").read_text()
    extra = [r for r in importlib.metadata.requires("stride") if 'extra == "tracing"' in r]
    names = {requirement.split(">")[0] for requirement in extra}
    assert names == {"opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http"}


def test_grafana_links_exemplars_to_jaeger():
    services = compose()["services"]
    assert "--enable-feature=exemplar-storage" in services["prometheus"]["command"]
    (jaeger,) = yaml.safe_load((SOURCES / "jaeger.yml").read_text())["datasources"]
    assert jaeger["type"] == "jaeger"
    url = urlsplit(jaeger["url"])
    assert url.hostname == "jaeger" and f"{url.port}:{url.port}" in services["jaeger"]["ports"]
    (prometheus,) = yaml.safe_load((SOURCES / "prometheus.yml").read_text())["datasources"]
    (link,) = prometheus["jsonData"]["exemplarTraceIdDestinations"]
    assert link == {"name": "trace_id", "datasourceUid": jaeger["uid"]}  # Stride's label

    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "stride.json").read_text())
    with_exemplars = {
        p["title"] for p in dashboard["panels"] if any(t.get("exemplar") for t in
                                                        p.get("targets", []))
    }  # fmt: skip
    assert "Time to first token" in with_exemplars
    assert "Time per output token and end-to-end" in with_exemplars
