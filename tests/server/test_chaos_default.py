"""Chaos in the default mode: `stride serve` in-process on the CPU with the default model,
valid and hostile traffic at once; the contract of every answer is in `tests/helpers/chaos.py`
(the engine-process run: `test_chaos.py`).

About 10 s of traffic with EAGLE (the shipped head) and `introspective` (a random MASK-slot
adapter) in the mix, a waiting queue small enough to fill (429 `queue_full` with Retry-After),
an engine that breaks twice in a row (`crash`), and SIGTERM with traffic in flight and long
requests that outlast `--shutdown-timeout`: they get 503 `server_draining` or an error event,
and the process exits 0. Every greedy answer equals the server's own plain greedy decoding
(`ar`, asked first): the lossless decoders are lossless.
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

from tests.helpers.adapters import random_adapter
from tests.helpers.chaos import (
    LENGTHS,
    Chaos,
    Traffic,
    check_answers,
    health,
    run_traffic,
    until,
)
from tests.helpers.servers import LAUNCH, ROOT, free_port, scrape, wait_healthy

DEFAULT_PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time"]
DEFAULT_DECODERS = [
    "ar",
    {"type": "speculative", "draft": "eagle"},
    {"type": "speculative", "draft": "ngram", "num_speculative_tokens": 3},
    {"type": "refine", "method": "introspective"},
    {"type": "refine", "method": "jacobi", "window": 4},
]
DEFAULT_SAMPLED = ["ar", {"type": "speculative", "draft": "eagle"}]
LONG = {"prompt": "x", "max_tokens": 2000, "ignore_eos": True, "decoder": "slow", "stream": True}
SHUTDOWN_S = 3


@pytest.fixture(scope="module")
def mask_adapter(default_engine, tmp_path_factory):
    path = tmp_path_factory.mktemp("default-adapter")
    random_adapter(default_engine.model).save(path)
    return path


def test_chaos_in_process_on_the_default_model(mask_adapter):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-c", LAUNCH, "serve", "--device", "cpu", "--port", str(port),
           "--kv-cache-memory", "128MiB", "--max-num-seqs", "4", "--max-waiting", "6",
           "--mask-adapter", str(mask_adapter), "--shutdown-timeout", str(SHUTDOWN_S),
           "--log-level", "warning"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    long_events: list[list[str]] = [[], []]

    def crash_twice() -> None:
        """A burst past the queue's size; then the engine breaks (`crash`), and again as soon
        as the restarted one serves."""
        chaos.burst(8, {"prompt": DEFAULT_PROMPTS[0], "max_tokens": 6, "n": 2, "ignore_eos": True})
        crash = {"prompt": "x", "max_tokens": 4, "decoder": "crash"}
        for restarts in range(2):
            until(lambda: health(url) == "ok", 120, "a serving engine")
            while (
                r := httpx.post(f"{url}/v1/completions", json=crash, timeout=60)
            ).status_code == 429:  # the queue is full: come back as told
                time.sleep(int(r.headers["Retry-After"]))
            assert r.json()["error"]["code"] == "engine_dead"  # it took the engine down
            until(lambda n=restarts: scrape(url, "stride_engine_restarts_total") > n, 120,
                  "the restart")  # fmt: skip

    def stream_long(i: int, started: threading.Event) -> None:
        while True:
            with httpx.stream("POST", f"{url}/v1/completions", json=LONG, timeout=120) as r:
                if r.status_code == 429:  # the queue is full: come back as told
                    time.sleep(int(r.headers["Retry-After"]))
                    continue
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        long_events[i].append(line[6:])
                        started.set()
                return

    def sigterm_with_long_requests() -> None:
        """Streams that outlast the drain; SIGTERM while they and the workers' traffic run."""
        until(lambda: health(url) == "ok", 120, "serving again")
        started = [threading.Event() for _ in long_events]
        long = [threading.Thread(target=stream_long, args=(i, started[i])) for i in range(2)]
        for t in long:
            t.start()
        assert all(event.wait(60) for event in started)
        chaos.stopping.set()
        proc.send_signal(signal.SIGTERM)
        for t in long:
            t.join(60)
        assert proc.wait(timeout=60) == 0

    try:
        wait_healthy(url, proc)
        expected = {}
        for p, prompt in enumerate(DEFAULT_PROMPTS):  # plain greedy decoding, alone
            for length in LENGTHS:
                body = {"prompt": prompt, "max_tokens": length, "temperature": 0,
                        "ignore_eos": True}  # fmt: skip
                answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
                expected[(p, length)] = answer["choices"][0]["text"]
        traffic = Traffic(DEFAULT_PROMPTS, DEFAULT_DECODERS, DEFAULT_SAMPLED, LENGTHS, expected)
        chaos = Chaos(url, traffic)
        run_traffic(chaos, crash_twice, sigterm_with_long_requests)

        records = chaos.records
        check_answers(records, {"engine_dead", "queue_full", "server_draining"})
        valid = [r for r in records if not r.label.startswith("hostile")]
        assert sum(r.status == 200 and not r.stream_error for r in valid) > 10
        for decoder in ('"eagle"', '"introspective"'):
            assert any(decoder in r.label and r.status == 200 for r in valid), decoder
        assert any(r.error_code == "queue_full" for r in valid)  # the queue filled
        assert any((r.error_code or r.stream_error) == "engine_dead" for r in valid)
        for events in long_events:  # they outlasted the drain: its deadline answered them
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["code"] == "server_draining"
        log = proc.stdout.read()
        assert log.count("engine loop died") == 2, log[-3000:]
        for sign in ("CancelledError", "Exception in ASGI", "500 Internal"):
            assert sign not in log, log[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
