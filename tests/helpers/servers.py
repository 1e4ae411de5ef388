"""Real servers for the HTTP tests: uvicorn on a free loopback port, in this process or as
`stride serve` (the test decoders of `tests.helpers.decoders` registered in each).

`LiveServer` runs the app in a thread of the test process, so tests can look at the engine
(`server.core`) while talking HTTP to it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import torch
import uvicorn

from stride.engine.config import EngineConfig
from stride.server.app import ServerConfig, create_app
from stride.server.http_server import uvicorn_config


def descendants(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in map(int, (task / "children").read_text().split()):
            found |= {child} | descendants(child)
    return found


def engine_pid(server_pid: int) -> int:
    """The engine process of `stride serve --engine-process` (with any --api-servers): the one
    spawned process that holds no listening socket (API processes hold the port's)."""
    engines = []
    for pid in descendants(server_pid):
        if b"spawn_main" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            continue  # e.g. multiprocessing's resource tracker
        links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        sockets = {link[8:-1] for link in links if link.startswith("socket:[")}
        listening = any(
            line.split()[3] == "0A" and line.split()[9] in sockets
            for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
        )
        if not listening:
            engines.append(pid)
    assert len(engines) == 1, engines
    return engines[0]


def reaped(pid: int) -> bool:
    """Gone for good: neither running nor a zombie waiting for its parent."""
    return not Path(f"/proc/{pid}").exists()


def scrape(url: str, family: str, **labels: str) -> float:
    """The sum of a metric's samples with these labels, from a scrape of `url`/metrics."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        m = re.fullmatch(rf"{family}\{{([^}}]*)\}} (\S+)", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LiveServer:
    def __init__(self, config: ServerConfig, wait: bool = True) -> None:
        self.config = config
        self.app = create_app(config)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        uv = uvicorn_config(self.app, log_level="warning", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(uv)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.thread.start()
        if wait:
            self.wait_ready()

    def wait_listening(self, timeout: float = 30.0) -> None:
        """Until uvicorn accepts connections (the model may still be loading)."""
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("server did not start listening")
            time.sleep(0.01)

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.05)
        raise TimeoutError("server did not become ready")

    @property
    def core(self):
        return self.app.state.client.core

    def openai(self, **kw) -> openai.OpenAI:
        kw.setdefault("api_key", self.config.api_key or "none")
        return openai.OpenAI(base_url=f"{self.url}/v1", max_retries=0, timeout=60, **kw)

    def post(self, path: str, body: dict, **kw) -> httpx.Response:
        kw.setdefault("timeout", 60)
        return httpx.post(f"{self.url}{path}", json=body, **kw)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until the engine runs nothing and every KV block is free again."""
        core = self.core
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            cache = core.engine.cache
            if not core.seqs and cache.num_free_blocks == cache.num_usable_blocks:
                return
            time.sleep(0.02)
        raise AssertionError(
            f"engine not idle: {len(core.seqs)} sequences, running {core.num_running}, "
            f"{core.engine.cache.num_free_blocks}/{core.engine.cache.num_usable_blocks} free; "
            f"{[(q.request_id, q.num_output_tokens, q.params) for q in core.seqs.values()]}"
        )

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def assert_sigterm_drains(url: str, proc, body: dict, streams: int) -> None:
    """Start `streams` streamed requests, SIGTERM the server `proc` once each has an event, and
    check that every one runs to its end ("length", then [DONE]) and the server exits 0."""
    results: list[list[str]] = [[] for _ in range(streams)]
    started = [threading.Event() for _ in range(streams)]

    def stream(i: int) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    results[i].append(line[6:])
                    started[i].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for event in started:
        assert event.wait(60)
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=60)
    for events in results:  # every request in flight ran to its end
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert proc.wait(timeout=60) == 0


PROMPT_IDS = [5, 17, 42, 99, 7]


def tiny_config(model_dir, **kw) -> ServerConfig:
    engine = EngineConfig(model=str(model_dir), device="cpu", kv_cache_memory=8 << 20)
    return ServerConfig(engine=engine, **kw)


def hf_greedy(hf, ids: list[int], steps: int) -> list[int]:
    ids = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-steps:]


def error_of(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    return error


ROOT = Path(__file__).resolve().parents[2]


LAUNCH = (
    "from tests.helpers.decoders import register_test_decoders; register_test_decoders(); "
    "from stride.server.cli import main; raise SystemExit(main())"
)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180, fresh: int = 1) -> None:
    """Wait until `fresh` new connections in a row see `/health` 200: with several API
    processes on one socket each connection lands on any of them, and a late one still answers
    503 (loading)."""
    deadline = time.monotonic() + timeout
    seen, last = 0, None
    while seen < fresh:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, f"stride serve did not become healthy: {last}"
        try:
            r = httpx.get(f"{url}/health", timeout=5)
            last = None if r.status_code == 200 else r.text
        except httpx.HTTPError as e:
            last = repr(e)
        seen = 0 if last else seen + 1
        if last:
            time.sleep(0.1)


def serve_engine_process(
    model_dir: Path, port: int, api_servers: int = 1, flags: tuple[str, ...] = ()
) -> subprocess.Popen:
    """`stride serve` on CPU with the engine in its own process (the test decoders in it)."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "STRIDE_ENGINE_SETUP": "tests.helpers.decoders:register_test_decoders",
        "STRIDE_API_SERVERS": str(api_servers),
    }
    cmd = [sys.executable, "-c", LAUNCH, "serve", "--model", str(model_dir), "--device", "cpu"]
    cmd += ["--engine-process", "--kv-cache-memory", "8MiB", "--port", str(port)]
    cmd += ["--shutdown-timeout", "60", "--log-level", "warning", *flags]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def wait_gone(pids: set[int], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pids), f"left behind: {alive(pids)}"
