"""A real Prometheus scrapes a real Stride server under mixed traffic; every panel and alert works.

Prometheus (Debian's package, installed by the test command) runs on a free loopback port with
deploy/prometheus/prometheus.yml, retargeted at a live uvicorn server on a tiny model and scraping
every second. Traffic mixes every registered decoder, listed, unlisted and absent users, streaming
and not, prompts that share a preamble (prefix-cache hits), and errors (bad key, bad body,
unknown decoder, deadline). Then each PromQL expression of the Grafana dashboard and of the alert
rules is evaluated through Prometheus' HTTP API.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from stride.engine.config import EngineConfig
from stride.scheduler.policy import SchedulerConfig
from stride.server.app import ServerConfig
from tests.helpers.servers import LiveServer, free_port

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "stride.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROMETHEUS = shutil.which("prometheus")
KEY = "test-key"
USERS = ["alice", "bob", "mallory", None]  # the allowlist is alice,bob: mallory counts as other
TRAFFIC_SECONDS = 10.0
MAX_REQUESTS = 400

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="the prometheus binary is missing: the test command installs it with "
    "`apt-get install -y prometheus`, which failed or was skipped here",
)


# ---- the two servers --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stride(tiny_dir):
    config = ServerConfig(
        engine=EngineConfig(model=str(tiny_dir), device="cpu", kv_cache_memory=16 << 20),
        scheduler=SchedulerConfig(max_num_seqs=16),
        api_key=KEY,
        metrics_users="alice,bob",
    )
    server = LiveServer(config)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def prometheus(stride, tmp_path_factory):
    """Prometheus with the deploy config, retargeted at `stride`, scraping every second."""
    root = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(ALERTS)]
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{stride.port}"]}]
    (root / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (root / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={root / 'prometheus.yml'}",
            f"--storage.tsdb.path={root / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                pytest.fail(f"prometheus did not start:\n{(root / 'prometheus.log').read_text()}")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def query(prometheus: str, expr: str, attempts: int = 10) -> list[dict]:
    """An instant query; an empty answer is asked again a few times, since a scrape that timed
    out on a loaded machine marks every series stale until the next one succeeds."""
    for attempt in range(attempts):
        r = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (expr, body)
        if body["data"]["result"] or attempt == attempts - 1:
            return body["data"]["result"]
        time.sleep(0.5)
    raise AssertionError("unreachable")


def scrapes(prometheus: str) -> str:
    """How scraping went, for failure messages."""
    ups = query(prometheus, 'count_over_time(up{job="stride"}[1m])')
    good = query(prometheus, 'sum_over_time(up{job="stride"}[1m])')
    target = httpx.get(f"{prometheus}/api/v1/targets", timeout=10).json()["data"]
    errors = [t.get("lastError") for t in target["activeTargets"] if t.get("lastError")]
    return f"scrapes in the last minute: {values(good)} of {values(ups)} ok; errors: {errors}"


def values(result: list[dict]) -> list[float]:
    return [float(item["value"][1]) for item in result]


# ---- traffic ----------------------------------------------------------------------------------


def decoder_body(name: str, i: int) -> str | dict:
    if name == "speculative":  # it adapts K and may stop drafting on a random model
        return {"type": "speculative", "adaptive": False, "draft": ("ngram", "early_exit")[i % 2]}
    if name == "refine":  # the causal methods; diffusion needs a diffusion model of its own
        return {"type": "refine", "method": ("jacobi", "lookahead")[i // 7 % 2]}
    return name


GREEDY_ONLY = {"refine"}
PREAMBLE = "You are a storyteller who writes one line at a time. " * 3  # prefix-cache hits


ERRORS = [  # requests that must fail: (rejection reason, body, headers)
    ("auth", {"prompt": "hi", "max_tokens": 2}, {"Authorization": "Bearer wrong"}),
    ("validation", {"prompt": "hi", "temperature": 9}, None),
    ("validation", {"prompt": "hi", "decoder": "no-such-decoder"}, None),
    ("deadline", {"prompt": "hi", "max_tokens": 4, "timeout": 1e-6}, None),
]


class Traffic:
    """What clients sent and got back, to compare with what Prometheus counted."""

    def __init__(self, url: str, decoders: list[str]) -> None:
        self.url = url
        self.decoders = decoders
        self.tokens = 0
        self.stats: list[dict] = []  # usage.decoder of every finished response
        self.timings: list[dict] = []  # usage.timings of every finished response
        self.cached = 0  # usage.prompt_tokens_details.cached_tokens, summed
        self.failures: dict[str, int] = {}
        self.served: set[str] = set()

    def fail(self, client: httpx.Client, kind: str, body: dict, headers: dict | None) -> None:
        r = client.post(f"{self.url}/v1/completions", json=body, headers=headers)
        assert r.status_code >= 400, (kind, r.text)
        self.failures[kind] = self.failures.get(kind, 0) + 1

    def one(self, i: int, client: httpx.Client, bad: itertools.cycle) -> None:
        if i % 7 == 6:
            return self.fail(client, *next(bad))
        name = self.decoders[i % len(self.decoders)]
        body = {
            "prompt": f"{PREAMBLE if i % 2 else ''}Once upon a time {i}",
            "max_tokens": 6 + i % 7,
            "temperature": 0.0 if i % 2 or name in GREEDY_ONLY else 0.8,
            "seed": i,
            "ignore_eos": True,
            "decoder": decoder_body(name, i),
        }
        user = USERS[i % len(USERS)]
        if user is not None:
            body["user"] = user
        usage = self._stream(client, body) if i % 3 == 0 else self._complete(client, body)
        if usage is None:  # the decoder refused these options (e.g. greedy-only with sampling)
            self.failures["validation"] = self.failures.get("validation", 0) + 1
            return
        self.tokens += usage["completion_tokens"]
        self.stats.append(usage["decoder"])
        self.timings.append(usage["timings"])
        self.cached += usage["prompt_tokens_details"]["cached_tokens"]
        self.served.add(name)

    def _complete(self, client: httpx.Client, body: dict) -> dict | None:
        r = client.post(f"{self.url}/v1/completions", json=body)
        if r.status_code == 400 and "decoder" in r.text:
            return None
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    def _stream(self, client: httpx.Client, body: dict) -> dict | None:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        usage = None
        with client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
            if r.status_code == 400 and "decoder" in r.read().decode():
                return None
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
        assert usage is not None
        return usage

    def run(self) -> None:
        counter = itertools.count()
        stop = time.monotonic() + TRAFFIC_SECONDS
        bad = itertools.cycle(ERRORS)
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(headers=headers, timeout=60) as client:
            for error in ERRORS:  # every kind at least once, however slow the machine
                self.fail(client, *error)

        def worker() -> None:
            with httpx.Client(headers=headers, timeout=60) as client:
                while time.monotonic() < stop:
                    i = next(counter)
                    if i >= MAX_REQUESTS:
                        return
                    self.one(i, client, bad)
                    time.sleep(0.01)

        with ThreadPoolExecutor(4) as pool:
            for f in [pool.submit(worker) for _ in range(4)]:
                f.result()


@pytest.fixture(scope="module")
def traffic(stride, prometheus) -> Traffic:
    # Every real decoder (test modules may register toy ones of their own).
    decoders = [
        n for n, d in stride.core.decoders.items() if type(d).__module__.startswith("stride.")
    ]
    t = Traffic(stride.url, decoders)
    t.run()
    stride.wait_idle(timeout=30)
    # Two complete scrapes after the traffic: a series born in its last moments then has the
    # two samples that rate() needs.
    for _ in range(2):
        wait_for_final_scrape(prometheus, after=time.time())
    return t


def wait_for_final_scrape(prometheus: str, after: float, timeout: float = 60.0) -> None:
    """Until Prometheus holds a successful scrape begun after `after` and has evaluated every rule.

    A scrape times out after its 1 s interval; on a loaded machine several in a row can, so no
    fixed sleep guarantees that Prometheus has seen the final counters.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # a sample's timestamp is the start of the (successful) scrape that produced it
        scraped = values(query(prometheus, "timestamp(stride_requests_received_total)"))
        groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
        evaluated = all(not r["lastEvaluation"].startswith("0001") for g in groups
                        for r in g["rules"])  # fmt: skip
        if scraped and min(scraped) > after and evaluated:
            return
        time.sleep(0.2)
    pytest.fail(f"no complete scrape of stride after the traffic stopped; {scrapes(prometheus)}")


# ---- what Prometheus saw ----------------------------------------------------------------------


def test_counters_add_up_in_prometheus(prometheus, traffic):
    assert traffic.tokens > 0 and set(traffic.failures) == {"auth", "validation", "deadline"}
    assert traffic.served == set(traffic.decoders)
    (total,) = values(query(prometheus, "sum(stride_generation_tokens_total)"))
    assert total == traffic.tokens
    spec = [s for s in traffic.stats if s.get("draft_tokens")]
    if "speculative" in traffic.decoders:
        assert spec, "speculative requests should report drafts"
    for key in ("drafts", "draft_tokens", "accepted_tokens"):
        got = values(query(prometheus, f"sum(stride_spec_{key}_total)")) or [0.0]
        assert got == [sum(s[key] for s in spec)], key
    (passes,) = values(query(prometheus, "sum(stride_decoder_forward_passes_total)"))
    assert passes == sum(s["forward_passes"] for s in traffic.stats)
    (hits,) = values(query(prometheus, "sum(stride_prefix_cache_hits_total)"))
    assert hits == traffic.cached > 0

    users = {r["metric"]["user"] for r in query(prometheus, "stride_generation_tokens_total")}
    assert users == {"alice", "bob", "other", "none"}
    for reason, n in traffic.failures.items():
        (got,) = values(query(prometheus, f'stride_requests_rejected_total{{reason="{reason}"}}'))
        assert got == n, reason
    (received,) = values(query(prometheus, "sum(stride_requests_received_total)"))
    assert received == len(traffic.stats) + sum(traffic.failures.values())


def test_clients_get_their_timings_and_decoder_summary(traffic):
    for timings, stats in zip(traffic.timings, traffic.stats, strict=True):
        assert {"queue", "ttft", "e2e", "decode_tokens_per_s"} <= set(timings)
        assert 0 <= timings["queue"] <= timings["ttft"] <= timings["e2e"]
        assert stats["decoder"] in traffic.decoders and stats["forward_passes"] > 0


def dashboard_exprs() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (f"{panel['title']} [{target['refId']}]", target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def grafana_to_promql(expr: str) -> str:
    """Fill in what Grafana would: all models, decoders and users; a rate window (5 minutes, so
    that every sample of the traffic stays in it however long the tests before took)."""
    expr = expr.replace("$__rate_interval", "5m")
    return re.sub(r"\$(model|decoder|user)\b", ".*", expr)


def test_every_dashboard_query_returns_data(prometheus, traffic):
    exprs = dashboard_exprs()
    assert len(exprs) >= 30
    empty = []
    for title, expr in exprs:
        result = query(prometheus, grafana_to_promql(expr))
        if not any(math.isfinite(v) for v in values(result)):
            empty.append(f"{title}: {expr}")
    assert not empty, "queries without data:\n" + "\n".join(empty) + "\n" + scrapes(prometheus)


def test_every_alert_rule_evaluates(prometheus, traffic):
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    assert len(rules) >= 6
    # Prometheus loaded and evaluated every rule without error.
    groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
    loaded = {r["name"]: r for g in groups for r in g["rules"]}
    assert set(loaded) == {r["alert"] for r in rules}
    for name, rule in loaded.items():
        assert rule["health"] == "ok", (name, rule.get("lastError"))
        assert not rule["lastEvaluation"].startswith("0001"), f"{name} was never evaluated"
    # The signal under each threshold has data (the alert itself need not fire).
    for rule in rules:
        signal = re.split(r"\s(?:>|<|==)\s*[\d.]+\s*$", rule["expr"].strip())[0]
        assert signal != rule["expr"].strip(), f"{rule['alert']}: no threshold to strip"
        result = query(prometheus, signal)
        assert any(math.isfinite(v) for v in values(result)), (rule["alert"], signal)
