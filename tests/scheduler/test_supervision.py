"""Engine supervision over real HTTP: restarts after a crash or `kill -9`, the restart budget,
the watchdog, and deadlines that hold while the engine is stuck (see scheduler/supervision.py).

The thread-mode tests run the server in this process (`crash` breaks its engine); the others
run `stride serve --engine-process` and act on the engine process with signals.
"""

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
from transformers import AutoTokenizer

from stride.scheduler import supervision
from stride.server.cli import build_parser, server_config
from tests.helpers.decoders import extra_decoders
from tests.helpers.metrics import value
from tests.helpers.servers import (
    LAUNCH,
    PROMPT_IDS,
    ROOT,
    LiveServer,
    descendants,
    engine_pid,
    free_port,
    hf_greedy,
    reaped,
    scrape,
    serve_engine_process,
    tiny_config,
    wait_gone,
    wait_healthy,
)

SLOW = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True, "decoder": "slow"}
CRASH = {"prompt": "x", "max_tokens": 4, "decoder": "crash"}


def until(condition, timeout: float = 120.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def health(url: str) -> tuple[int, str]:
    r = httpx.get(f"{url}/health", timeout=10)
    return r.status_code, r.json()["status"]


class Stream(threading.Thread):
    """A streamed completion read to its end in the background: its data lines."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.events: list[str] = []
        self.status: int | None = None
        self.started = threading.Event()
        self.start()

    def run(self) -> None:
        with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body, timeout=120) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[6:])
                    self.started.set()
        self.started.set()

    def last(self) -> dict:
        """The stream's terminal event (the one before [DONE])."""
        assert self.events[-1] == "[DONE]", self.events[-3:]
        return json.loads(self.events[-2])


def expected_text(tiny_dir, tiny_hf, steps: int = 8) -> str:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    return tokenizer.decode(hf_greedy(tiny_hf, PROMPT_IDS, steps), skip_special_tokens=True)


def greedy_text(url: str, steps: int = 8) -> str:
    body = {"prompt": PROMPT_IDS, "max_tokens": steps, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_flags_and_environment(monkeypatch):
    monkeypatch.setenv("STRIDE_WATCHDOG_TIMEOUT", "7")
    monkeypatch.setenv("STRIDE_MAX_REQUEST_BODY", "1MiB")
    args = ["serve", "--max-engine-restarts", "2", "--engine-restart-window", "60"]
    config = server_config(build_parser().parse_args(args))
    assert config.supervision == supervision.SupervisionConfig(2, 60.0, 7.0)
    assert config.max_request_body == 1 << 20
    assert server_config(build_parser().parse_args(["serve"])).supervision.max_restarts == 5


def test_restart_backoff_and_budget():
    now = [0.0]
    budget = supervision.RestartBudget(supervision.SupervisionConfig(3, 60.0), lambda: now[0])
    assert [budget.next_delay() for _ in range(3)] == [0.5, 1.0, 2.0]
    assert budget.next_delay() is None  # a fourth within the window: give up
    now[0] = 61.0  # the window has passed: the backoff starts over
    assert budget.next_delay() == 0.5


# ---- thread mode ------------------------------------------------------------------------------


def test_thread_mode_restarts_a_dead_engine(tiny_dir, tiny_hf, monkeypatch):
    monkeypatch.setattr(supervision, "FIRST_BACKOFF_S", 2.0)  # long enough to see it down
    with extra_decoders():
        live = LiveServer(tiny_config(tiny_dir))
        try:
            dead = live.core
            stream = Stream(live.url, SLOW)
            assert stream.started.wait(60)
            crash = live.post("/v1/completions", CRASH)
            assert crash.status_code == 503 and crash.json()["error"]["code"] == "engine_dead"
            stream.join(60)
            assert stream.last()["error"]["code"] == "engine_dead"  # at once, not at the end
            assert health(live.url) == (503, "dead")
            until(lambda: health(live.url) == (200, "ok"), what="the restarted engine")
            assert greedy_text(live.url) == expected_text(tiny_dir, tiny_hf)
            assert value(live.app.state.metrics, "stride_engine_restarts_total") == 1
            old, new = dead.engine.model, live.core.engine.model  # its weights, new modules
            assert new is not old and new.lm_head.weight.data_ptr() == old.lm_head.weight.data_ptr()
            live.wait_idle()
            assert scrape(live.url, "stride_requests_running") == 0
            assert scrape(live.url, "stride_kv_cache_usage_ratio") == 0
        finally:
            live.stop()


def test_a_spent_restart_budget_exits_non_zero(tiny_dir):
    """Thread mode with no restarts allowed: the first death ends the server, with status 1."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-c", LAUNCH, "serve", "--model", str(tiny_dir), "--device", "cpu"]
    cmd += ["--kv-cache-memory", "8MiB", "--port", str(port), "--log-level", "warning"]
    cmd += ["--max-engine-restarts", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_healthy(url, proc)
        crash = httpx.post(f"{url}/v1/completions", json=CRASH, timeout=60)
        assert crash.status_code == 503 and crash.json()["error"]["code"] == "engine_dead"
        assert proc.wait(timeout=60) == 1
        assert "not restarted again" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- engine process ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def watched(tiny_dir):
    """An engine-process server whose watchdog fires after 2 s without a step."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve_engine_process(tiny_dir, port, flags=("--watchdog-timeout", "2"))
    try:
        wait_healthy(url, proc)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_stopped_engine_is_stuck_and_deadlines_still_hold(watched):
    url, proc = watched
    engine = engine_pid(proc.pid)
    admitted = Stream(url, {**SLOW, "timeout": 4})  # streaming when the engine stops
    assert admitted.started.wait(60)
    os.kill(engine, signal.SIGSTOP)
    try:
        late: list[httpx.Response] = []

        def post(body: dict) -> None:
            late.append(httpx.post(f"{url}/v1/completions", json=body, timeout=120))

        timed = threading.Thread(target=post, args=({"prompt": "x", "timeout": 1.5},))
        patient = threading.Thread(target=post, args=({"prompt": "x", "max_tokens": 2},))
        timed.start()
        patient.start()
        until(lambda: health(url) == (503, "stuck"), 60, "the watchdog")
        # Both deadlines pass while the engine is still stopped: the server side enforces them.
        timed.join(60)
        admitted.join(60)
        assert [r.status_code for r in late] == [504]
        assert late[0].json()["error"]["code"] == "deadline_exceeded"
        assert admitted.last()["choices"][0]["finish_reason"] == "deadline"
        assert patient.is_alive()  # no deadline: it waits for the engine
        detail = httpx.get(f"{url}/health", timeout=10).json()["detail"]
        # the two answered already (the 504, the stream's deadline) are not in flight
        assert "with 1 requests in flight (and 2 answered or left already" in detail, detail
    finally:
        os.kill(engine, signal.SIGCONT)
    patient.join(60)
    assert late[-1].status_code == 200
    until(lambda: health(url) == (200, "ok"), 60, "the engine to step again")


def test_api_servers_restart_a_killed_engine_then_give_up(tiny_dir, tiny_hf):
    """Two API processes: `kill -9` of the engine fails what is in flight at once, a new engine
    serves both of them, the dead one is reaped; the second death spends the budget of 1."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve_engine_process(tiny_dir, port, 2, ("--max-engine-restarts", "1"))
    try:
        wait_healthy(url, proc)
        first = engine_pid(proc.pid)
        stream = Stream(url, SLOW)
        assert stream.started.wait(60)
        os.kill(first, signal.SIGKILL)
        stream.join(60)
        assert stream.last()["error"]["code"] == "engine_dead"
        until(lambda: all(health(url) == (200, "ok") for _ in range(10)), what="a new engine")
        expected = expected_text(tiny_dir, tiny_hf)
        assert [greedy_text(url) for _ in range(6)] == [expected] * 6  # both API processes
        assert reaped(first)
        assert scrape(url, "stride_engine_restarts_total") == 1

        children = descendants(proc.pid)
        os.kill(engine_pid(proc.pid), signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
        wait_gone(children)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
