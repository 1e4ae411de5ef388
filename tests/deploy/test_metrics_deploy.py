"""The compose stack, Prometheus config and Grafana provisioning hold together (no Docker here).

`promtool` (Debian's prometheus package) really validates the scrape config and alert rules; the
compose file is checked for what `docker compose config` would catch and for the wiring between
services; the dashboard must match its source and name only metrics Stride defines.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from stride.metrics.registry import Metrics
from stride.server.cli import build_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
PROM_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
GRAFANA = DEPLOY / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "stride.json"
PROMTOOL = shutil.which("promtool")


def defined_series() -> set[str]:
    """Every series name Stride's metrics can expose (with _total, _bucket, _sum, _count)."""
    names = set()
    for family in Metrics("m").registry.collect():
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
        names.update(family.name + s for s in suffixes.get(family.type, [""]))
    return names


def referenced(text: str) -> set[str]:
    return set(re.findall(r"\bstride_[a-z0-9_]+\b", text))


@pytest.mark.skipif(PROMTOOL is None, reason="promtool missing: apt-get install -y prometheus")
@pytest.mark.parametrize("what,path", [("config", PROM_CONFIG), ("rules", ALERTS)])
def test_promtool_accepts(what, path):
    r = subprocess.run([PROMTOOL, "check", what, str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dashboard_json_is_generated_from_its_source():
    spec = importlib.util.spec_from_file_location("dashboard", GRAFANA / "dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert DASHBOARD.read_text() == module.render(), "run: python deploy/grafana/dashboard.py"


def test_dashboard_and_alerts_name_only_defined_metrics():
    defined = defined_series()
    for path in (DASHBOARD, ALERTS):
        unknown = referenced(path.read_text()) - defined
        assert not unknown, f"{path.name} names metrics Stride does not define: {unknown}"


def test_dashboard_structure():
    d = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert set(variables) == {"datasource", "model", "decoder", "user"}
    for panel in d["panels"]:
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, panel["title"]
        for target in panel.get("targets", []):
            assert target["expr"] and target["refId"] and target["datasource"]["uid"]
    titles = " ".join(p["title"] for p in d["panels"]).lower()
    for needed in ("time to first token", "inter-token", "throughput", "by user", "by decoder",
                   "acceptance rate", "accepted length", "per forward pass", "running and waiting",
                   "kv cache", "batch size", "error rate", "prefix cache hit rate"):  # fmt: skip
        assert needed in titles, needed


def test_compose_stack_is_wired_together():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert set(services) == {"stride", "prometheus", "grafana", "jaeger"}
    for name, service in services.items():
        assert "image" in service, name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source} does not exist"
            else:
                assert source in compose["volumes"], f"{name}: undeclared volume {source}"
        for port in service.get("ports", []):
            assert re.fullmatch(r"\d+:\d+", port), port
    for name, service in services.items():
        for dep in service.get("depends_on", []):
            assert dep in services, f"{name} depends on unknown {dep}"

    # Stride's settings are real flags, and Prometheus scrapes the port the image listens on.
    stride = services["stride"]
    build = stride["build"]
    dockerfile = (DEPLOY / build["context"] / build["dockerfile"]).read_text()
    assert 'ENTRYPOINT ["stride", "serve"]' in dockerfile
    port = re.search(r"STRIDE_PORT=(\d+)", dockerfile).group(1)
    flags = set(vars(build_parser().parse_args(["serve"])))
    for env in stride["environment"]:
        assert env.startswith("STRIDE_") and env[7:].lower() in flags, env
    assert f"{port}:{port}" in stride["ports"]
    scrape = yaml.safe_load(PROM_CONFIG.read_text())
    (job,) = scrape["scrape_configs"]
    assert job["static_configs"][0]["targets"] == [f"stride:{port}"]
    assert job["metrics_path"] == "/metrics"
    assert "./prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]

    # Grafana: the provisioned data source reaches Prometheus; the dashboards folder is mounted
    # where the provider looks; the dashboard's default data source is that one.
    (source,) = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )["datasources"]
    assert source["url"] == "http://prometheus:9090" and source["type"] == "prometheus"
    (provider,) = yaml.safe_load(
        (GRAFANA / "provisioning" / "dashboards" / "stride.yml").read_text()
    )["providers"]
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    dashboard = json.loads(DASHBOARD.read_text())
    (ds_var,) = [v for v in dashboard["templating"]["list"] if v["name"] == "datasource"]
    assert ds_var["current"]["value"] == source["uid"]


SELECTOR = re.compile(r"\b(stride_[a-z0-9_]+)(?:\{([^}]*)\})?")
MATCHER = re.compile(r'(\w+)\s*(=~|!=|=)\s*"([^"]*)"')


def queried_selectors() -> list[tuple[str, list[tuple[str, str, str]]]]:
    """Every (metric, label matchers) the dashboard's panels and variables and the alert rules
    query, with Grafana's variables left in ($model, $decoder, $user)."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if "query" in v
              and isinstance(v["query"], dict)]  # fmt: skip
    exprs += [r["expr"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    return [
        (name, MATCHER.findall(labels or ""))
        for expr in exprs
        for name, labels in SELECTOR.findall(expr)
    ]


def test_every_queried_series_exists_before_the_first_request(tiny_dir):
    """Right after start-up, before any request, /metrics holds a series for every metric and
    label combination the dashboard and alerts query, for each value of the dashboard's
    variables: every model, decoder on offer (speculative ones for the stride_spec_ metrics)
    and user label. So panels and rate() alerts have data from the first scrape."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from stride.engine.config import EngineConfig
    from stride.metrics.labels import NO_USER, OTHER_USER
    from stride.server.app import ServerConfig
    from tests.helpers.servers import LiveServer

    engine = EngineConfig(model=str(tiny_dir), served_name="tiny", device="cpu",
                          kv_cache_memory=4 << 20)  # fmt: skip
    live = LiveServer(ServerConfig(engine=engine, metrics_users="alice,bob"), wait=False)
    try:
        live.wait_listening()
        body = httpx.get(f"{live.url}/metrics", timeout=5).text
        decoders = live.app.state.metrics.strategies
    finally:
        live.stop()
    series = [
        (s.name, s.labels) for f in text_string_to_metric_families(body) for s in f.samples
    ]
    assert {"ar", "speculative/ngram", "refine/jacobi"} <= set(decoders)
    variables = {
        "model": ["tiny"],
        "decoder": list(decoders),
        "user": ["alice", "bob", OTHER_USER, NO_USER],
    }
    missing = []
    selectors = queried_selectors()
    assert len(selectors) >= 40
    for name, matchers in selectors:
        combos = [{}]
        for var, values in variables.items():
            if any(f"${var}" in value for _, _, value in matchers):
                if var == "decoder" and name.startswith("stride_spec_"):
                    values = [d for d in values if d.startswith("speculative/")]
                combos = [{**c, var: v} for c in combos for v in values]
        for combo in combos:
            wanted = [(label, op, _fill(value, combo)) for label, op, value in matchers]
            if not any(
                got == name and all(_matches(labels.get(k, ""), op, v) for k, op, v in wanted)
                for got, labels in series
            ):
                missing.append((name, wanted))
    assert not missing, f"{len(missing)} queried series are absent at start-up: {missing[:10]}"


def _fill(value: str, variables: dict[str, str]) -> str:
    """A matcher's value with Grafana's $variables set (as regex-escaped literals)."""
    return re.sub(r"\$(\w+)", lambda m: re.escape(variables[m[1]]), value)


def _matches(value: str, op: str, wanted: str) -> bool:
    if op == "=":
        return value == wanted
    if op == "!=":
        return value != wanted
    return re.fullmatch(wanted, value) is not None
