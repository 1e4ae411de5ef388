"""`stride serve` as a real process: flags and STRIDE_* variables, and the SIGTERM drain."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from stride.server.cli import build_parser, parse_bytes, server_config
from tests.server_harness import free_port

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = (
    "from tests.server_harness import register_test_decoders; register_test_decoders(); "
    "from stride.server.cli import main; raise SystemExit(main())"
)


def test_flags_and_environment(monkeypatch):
    monkeypatch.setenv("STRIDE_PORT", "9123")
    monkeypatch.setenv("STRIDE_API_KEY", "k")
    monkeypatch.setenv("STRIDE_TRUST_REMOTE_CODE", "true")
    args = build_parser().parse_args(
        [
            "serve",
            "--kv-cache-memory",
            "512MiB",
            "--decoder",
            '{"type": "ar"}',
            "--max-waiting",
            "3",
            "--fused-decode-steps",
            "1",
        ]
    )
    assert args.port == 9123 and args.api_key == "k"
    config = server_config(args)
    assert config.engine.kv_cache_memory == 512 << 20
    assert config.decoders.default == {"type": "ar"} and config.decoders.trust_remote_code
    assert config.scheduler.max_waiting == 3 and config.scheduler.fused_decode_steps == 1
    assert parse_bytes("2GiB") == 2 << 30 and parse_bytes("1000") == 1000
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--decoder", "nope"])


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError("stride serve did not become healthy")


def test_sigterm_drains_requests_in_flight(tiny_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # One torch thread: OpenMP spin-waits make steps crawl when the test and server share 2 cores.
    env = {**os.environ, "STRIDE_PORT": str(port), "STRIDE_DECODER": "slow", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-c",
        LAUNCH,
        "serve",
        "--model",
        str(tiny_dir),
        "--device",
        "cpu",
        "--kv-cache-memory",
        "8MiB",
        "--shutdown-timeout",
        "60",
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        _wait_healthy(url, proc)
        started = [threading.Event() for _ in range(3)]
        results: list[list[dict]] = [[] for _ in range(3)]

        def stream(i: int) -> None:
            body = {"prompt": "x", "max_tokens": 40, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        results[i].append(json.loads(line[6:]))
                        started[i].set()
                    elif line == "data: [DONE]":
                        results[i].append({"done": True})

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for event in started:
            assert event.wait(60)
        proc.send_signal(signal.SIGTERM)
        health = httpx.get(f"{url}/health", timeout=5)
        while health.status_code == 200:  # until the signal is handled
            health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        late = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=5)
        assert late.status_code == 503 and late.json()["error"]["code"] == "server_draining"
        for t in threads:
            t.join(timeout=60)
        for events in results:  # every request in flight ran to its end
            assert events[-1] == {"done": True}
            assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
