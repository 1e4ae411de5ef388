"""A drain that times out, with real processes: `stride serve --shutdown-timeout 2`, four
streamed and four plain completions running when SIGTERM comes. At the drain deadline each of
them gets the last word the README promises (a plain request 503 `server_draining`, a stream an
error event then `[DONE]`) before the process exits 0, with no traceback in its log: as one
process (the engine on a thread), and as two API processes in front of an engine process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.helpers.servers import (
    LAUNCH,
    ROOT,
    free_port,
    scrape,
    serve_engine_process,
    wait_healthy,
)

LONG = {"prompt": "x", "max_tokens": 400, "ignore_eos": True, "decoder": "slow"}  # ~8 s or more
DEADLINE_S = 2
FLOOD = 4  # of each kind


def serve_one_process(model_dir, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-c", LAUNCH, "serve", "--model", str(model_dir), "--device", "cpu",
           "--kv-cache-memory", "8MiB", "--port", str(port),
           "--shutdown-timeout", str(DEADLINE_S)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.mark.parametrize("mode", ["one process", "two API processes"])
def test_at_the_drain_deadline_every_request_gets_its_last_word(tiny_dir, mode):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if mode == "one process":
        proc = serve_one_process(tiny_dir, port)
    else:
        flags = ("--shutdown-timeout", str(DEADLINE_S), "--log-level", "info")
        proc = serve_engine_process(tiny_dir, port, api_servers=2, flags=flags)
    try:
        wait_healthy(url, proc, fresh=3)
        streams: list[list[str]] = [[] for _ in range(FLOOD)]
        plain: list[httpx.Response] = []
        started = [threading.Event() for _ in range(FLOOD)]

        def stream(i: int) -> None:
            body = {**LONG, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        streams[i].append(line[6:])
                        started[i].set()

        def complete() -> None:
            plain.append(httpx.post(f"{url}/v1/completions", json=LONG, timeout=60))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(FLOOD)]
        threads += [threading.Thread(target=complete) for _ in range(FLOOD)]
        for t in threads:
            t.start()
        assert all(event.wait(60) for event in started)
        deadline = time.monotonic() + 60
        while scrape(url, "stride_requests_running") < 2 * FLOOD:  # the plain ones run too
            assert time.monotonic() < deadline, "not all eight run"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "a request got no answer"

        assert len(plain) == FLOOD
        for r in plain:
            assert r.status_code == 503, r.text
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == "server_draining" and error["type"] == "service_unavailable"
        for events in streams:
            assert events[-1] == "[DONE]", events[-3:]
            assert json.loads(events[-2])["error"]["code"] == "server_draining"
            assert all("choices" in json.loads(e) for e in events[:-2])  # tokens came before
        assert proc.wait(timeout=60) == 0
        log = proc.stdout.read()
        for sign in ("Traceback", "CancelledError", "Exception in ASGI", "500 Internal"):
            assert sign not in log, log
        assert "shutdown timeout" in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
