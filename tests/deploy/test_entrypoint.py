"""The Docker image's entrypoint, run as-is on this machine (no Docker engine here).

The command line is the Dockerfile's ENTRYPOINT + CMD and the environment is the runtime stage's
ENV, read from the Dockerfile itself. Only what names a place inside the image is mapped to its
host equivalent: HOME, the model cache (where the host keeps the default model that the image
bakes in) and HF_HOME; and the port is a free one, since 8000 may be taken on a shared machine.
One variable is added: OMP_NUM_THREADS=1, as the Deployment sets it to the pod's CPU request. On
this small machine shared with other test processes, two spinning OpenMP threads made decode
steps about ten times slower than one (5 s against 0.4 s per step, measured under load).
The server then serves the default model, passes the image's HEALTHCHECK, emits every metric the
manifests and docs name, and drains requests in flight on SIGTERM, exiting 0.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from stride.engine.loader import DEFAULT_MODEL_NAME, cache_dir
from tests.helpers.deploy import DOCS, K8S, runtime_stage
from tests.helpers.servers import ROOT

STARTUP_TIMEOUT = 180.0


@dataclass
class Container:
    """The entrypoint's process and how to reach it."""

    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen
    url: str
    log: Path

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def image_env(port: int) -> dict[str, str]:
    host = dict(os.environ)
    env = runtime_stage().env(base=host)
    env["HOME"] = host["HOME"]
    env["STRIDE_CACHE"] = str(cache_dir())  # the host's copy of what the image bakes in
    env.pop("HF_HOME", None)
    if "HF_HOME" in host:
        env["HF_HOME"] = host["HF_HOME"]
    env["STRIDE_PORT"] = str(port)
    env["OMP_NUM_THREADS"] = "1"
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def container(tmp_path_factory) -> Container:
    runtime = runtime_stage()
    argv = runtime.exec_form("ENTRYPOINT") + runtime.exec_form("CMD")
    port = free_port()
    env = image_env(port)
    log = tmp_path_factory.mktemp("entrypoint") / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd="/")
    c = Container(argv, env, proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while True:
        assert proc.poll() is None, f"`{shlex.join(argv)}` exited:\n{c.log_tail()}"
        assert time.monotonic() < deadline, f"not healthy in {STARTUP_TIMEOUT} s:\n{c.log_tail()}"
        try:
            if httpx.get(c.url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    yield c
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGINT)  # a second signal: exit without draining
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _listening_addresses(port: int) -> set[str]:
    """Local addresses with a listening TCP socket on `port` (from /proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if int(p, 16) == port and state == "0A":
            found.add(socket.inet_ntoa(bytes.fromhex(addr)[::-1]))
    return found


def test_entrypoint_serves_the_default_model(container):
    assert container.argv == ["stride", "serve"]
    models = httpx.get(container.url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [DEFAULT_MODEL_NAME]
    r = httpx.post(
        container.url + "/v1/completions",
        json={"model": DEFAULT_MODEL_NAME, "prompt": "The capital of France is",
              "max_tokens": 8, "temperature": 0},
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"].strip()
    assert body["usage"]["completion_tokens"] >= 1
    # STRIDE_HOST=0.0.0.0 from the image reached the server: it listens on every interface.
    assert "0.0.0.0" in _listening_addresses(int(container.env["STRIDE_PORT"]))


def test_the_images_healthcheck_passes(container):
    healthcheck = runtime_stage().last("HEALTHCHECK")
    argv = json.loads(healthcheck[healthcheck.index("CMD") + len("CMD") :])
    out = subprocess.run(argv, env=container.env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


def _referenced_metric_names() -> dict[str, set[str]]:
    """stride_* names written in the manifests, the Helm values and docs/kubernetes.md."""
    files = sorted(K8S.rglob("*.yaml")) + [DOCS]
    refs: dict[str, set[str]] = {}
    for path in files:
        for name in re.findall(r"\bstride_[a-z0-9_]*[a-z0-9]", path.read_text()):
            refs.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return refs


def _emitted_names(exposition: str) -> set[str]:
    """Every name a PromQL query may use: families, samples, and the suffixes of their types."""
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count",
                "_created"), "summary": ("_sum", "_count", "_created")}  # fmt: skip
    names = set()
    for family in text_string_to_metric_families(exposition):
        names.add(family.name)
        names.update(family.name + s for s in suffixes.get(family.type, ()))
        names.update(sample.name for sample in family.samples)
    return names


def test_every_metric_the_deployment_names_is_emitted(container):
    r = httpx.get(container.url + "/metrics", timeout=10)
    assert r.status_code == 200
    emitted = _emitted_names(r.text)
    refs = _referenced_metric_names()
    assert {"stride_requests_waiting", "stride_requests_running", "stride_kv_cache_usage_ratio"} \
        <= refs.keys()  # fmt: skip
    missing = {name: sorted(where) for name, where in refs.items() if name not in emitted}
    assert not missing, f"named but not emitted: {missing}"


def _epp_reads(exposition: str, spec: str) -> list[tuple[str, float]]:
    """The series an endpoint picker flag (`name` or `name{label=value,...}`) matches."""
    name, _, block = spec.partition("{")
    want = dict(pair.split("=") for pair in block.rstrip("}").split(",")) if block else {}
    return [
        (family.type, sample.value)
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name == name and want.items() <= sample.labels.items()
    ]


def test_the_inference_gateway_reads_one_gauge_per_replica(container):
    """The EPP takes one series per pod for each flag: each must match exactly one gauge."""
    values = yaml.safe_load((K8S / "gateway" / "epp-values.yaml").read_text())
    flags = {k: v for k, v in values["inferenceExtension"]["flags"].items() if v}
    assert set(flags) == {"total-queued-requests-metric", "total-running-requests-metric",
                          "kv-cache-usage-percentage-metric"}  # fmt: skip
    exposition = httpx.get(container.url + "/metrics", timeout=10).text
    for flag, spec in flags.items():
        reads = _epp_reads(exposition, spec)
        assert len(reads) == 1, f"--{flag}={spec} matches {reads}"
        kind, value = reads[0]
        assert kind == "gauge" and value >= 0
        if flag.startswith("kv-cache"):
            assert value <= 1, "the EPP expects a fraction"


@dataclass
class Stream:
    """One streaming completion read on its own thread."""

    started: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    finish_reason: str | None = None
    completion_tokens: int | None = None
    saw_done: bool = False
    error: BaseException | None = None


def _stream_completion(url: str, max_tokens: int, stream: Stream) -> None:
    body = {
        "model": DEFAULT_MODEL_NAME,
        "prompt": "Write a long story about a fox.",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    stream.saw_done = True
                    continue
                chunk = json.loads(data)
                assert "error" not in chunk, chunk
                stream.started.set()
                for choice in chunk.get("choices", []):
                    stream.finish_reason = choice.get("finish_reason") or stream.finish_reason
                if chunk.get("usage"):
                    stream.completion_tokens = chunk["usage"]["completion_tokens"]
    except BaseException as e:  # reported by the test
        stream.error = e
    finally:
        stream.started.set()
        stream.done.set()


def test_sigterm_drains_requests_in_flight_then_exits_0(container):
    """Runs last: SIGTERM, as `docker stop` or the kubelet sends it, ends the module's server."""
    max_tokens, n = 32, 3
    streams = [Stream() for _ in range(n)]
    threads = [
        threading.Thread(target=_stream_completion, args=(container.url, max_tokens, s))
        for s in streams
    ]
    for t in threads:
        t.start()
    for s in streams:
        assert s.started.wait(60)
    assert not any(s.done.is_set() for s in streams), "requests must still be in flight"

    container.proc.send_signal(signal.SIGTERM)  # what STOPSIGNAL / the kubelet sends
    # New work is turned away while the old finishes (or the server has already gone).
    try:
        r = httpx.post(container.url + "/v1/completions",
                       json={"model": DEFAULT_MODEL_NAME, "prompt": "hi"}, timeout=10)  # fmt: skip
        assert r.status_code == 503, r.text
        assert httpx.get(container.url + "/health", timeout=10).status_code == 503
    except httpx.TransportError:
        pass

    drain = float(container.env["STRIDE_SHUTDOWN_TIMEOUT"])
    assert container.proc.wait(timeout=drain + 30) == 0, container.log_tail()
    for t in threads:
        t.join(timeout=10)
    for s in streams:
        assert s.error is None, f"{s.error!r}\n{container.log_tail()}"
        assert (s.finish_reason, s.completion_tokens, s.saw_done) == ("length", max_tokens, True)
    assert "SIGTERM" in container.log_tail()
