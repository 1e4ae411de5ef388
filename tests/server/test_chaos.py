"""Chaos: valid and hostile traffic at once against `stride serve`, while the engine is killed
(twice in a row) and the server ends with SIGTERM; the contract of every answer is in
`tests/helpers/chaos.py`.

Two servers, about 10 s of traffic each, plus what starting, restarting and stopping take:

- `--engine-process` on a tiny model: every decoder (ar, speculative with n-gram and early-exit
  drafts, refine with Jacobi and lookahead), completions and chat, streamed or not, greedy or
  sampled, n of 1 or 2, about one stream in ten dropped after its first event, and the corpus
  of hostile bodies (the requests that killed the engine in issue 16, wrong types and ranges for
  every field, hostile decoder objects on both routes, huge and deeply nested bodies, invalid
  UTF-8); `kill -9` of the engine process, and of its successor as soon as it serves. Then the
  server serves again (two restarts, the dead engines reaped), the gauges are back to 0, and
  SIGTERM exits 0.
- the default: in-process on the CPU, the default model, with EAGLE (the shipped head) and
  `introspective` (a random MASK-slot adapter) in the mix, a waiting queue small enough to
  fill (429 `queue_full` with Retry-After), an engine that breaks twice in a row (`crash`),
  and SIGTERM with traffic in flight and long requests that outlast `--shutdown-timeout`: they
  get 503 `server_draining` or an error event, and the process exits 0.

Every greedy answer equals plain greedy decoding's (transformers' for the tiny model; the
server's own `ar`, asked first, for the default model): the lossless decoders are lossless.
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

from stride.scheduler.detokenizer import Detokenizer
from tests.helpers.adapters import random_adapter
from tests.helpers.chaos import (
    HOSTILE_DECODERS,
    Chaos,
    Traffic,
    check_answers,
    hostile_bodies,
    summary,
)
from tests.helpers.servers import (
    LAUNCH,
    ROOT,
    descendants,
    engine_pid,
    free_port,
    hf_greedy,
    reaped,
    scrape,
    serve_engine_process,
    wait_gone,
    wait_healthy,
)

RUN_S = 9.0  # of traffic, before the end
KILL_AT_S = 4.0
AFTER_S = 3.0  # of traffic at least after the middle (which may outlast RUN_S: restarts)
WORKERS = 5  # valid traffic; one more sends the hostile corpus
TINY_PROMPTS = [[5, 17, 42, 99, 7], [3, 1, 4, 1, 5, 9, 2, 6], [200, 100, 50, 25]]
LENGTHS = (6, 12)
TINY_DECODERS = [
    "ar",
    {"type": "speculative", "draft": "ngram", "num_speculative_tokens": 3, "adaptive": False},
    {"type": "speculative", "draft": "early_exit", "num_speculative_tokens": 2},
    {"type": "refine", "method": "jacobi", "window": 4},
    {"type": "refine", "method": "lookahead"},
]
SAMPLED = ["ar", {"type": "speculative", "draft": "ngram", "adaptive": False}]


def run_traffic(chaos: Chaos, middle, end=None) -> None:
    """Workers for RUN_S seconds (at least AFTER_S after it), `middle()` at KILL_AT_S; `end()`
    (if any) while they still run, after which they stop."""
    workers = [threading.Thread(target=chaos.valid, args=(i,)) for i in range(WORKERS)]
    workers.append(threading.Thread(target=chaos.hostile, args=(hostile_bodies(HOSTILE_DECODERS),)))
    deadline = time.monotonic() + RUN_S
    for w in workers:
        w.start()
    time.sleep(KILL_AT_S)
    middle()
    time.sleep(max(AFTER_S, deadline - time.monotonic()))
    if end is not None:
        end()
    chaos.stop.set()
    for w in workers:
        w.join(180)
        assert not w.is_alive(), "a request never got an answer"
    print(summary(chaos.records))


def until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def health(url: str) -> str:
    try:
        return httpx.get(f"{url}/health", timeout=10).json()["status"]
    except httpx.TransportError:
        return "gone"


# ---- the engine process, killed twice ---------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_expected(tiny_dir, tiny_hf) -> dict[tuple[int, int], str]:
    """The text of transformers' greedy tokens, as the server streams text (a character cut
    at the end stays out)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    out = {}
    for p, ids in enumerate(TINY_PROMPTS):
        tokens = hf_greedy(tiny_hf, ids, max(LENGTHS))
        for length in LENGTHS:
            detok = Detokenizer(tokenizer, [], skip_special_tokens=True)
            for t in tokens[:length]:
                detok.add(t)
            out[(p, length)] = detok.take(final=True)
    return out


def test_chaos_with_the_engine_process_killed_twice(tiny_dir, tiny_expected):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve_engine_process(tiny_dir, port)
    killed: list[int] = []

    def kill_twice() -> None:
        """kill -9 the engine, and its successor as soon as it serves."""
        killed.append(engine_pid(proc.pid))
        os.kill(killed[0], signal.SIGKILL)
        until(lambda: health(url) == "dead", 30, "the engine's death to show")
        until(lambda: health(url) == "ok", 120, "the first restart")
        killed.append(engine_pid(proc.pid))
        os.kill(killed[1], signal.SIGKILL)

    try:
        wait_healthy(url, proc)
        traffic = Traffic(TINY_PROMPTS, TINY_DECODERS, SAMPLED, LENGTHS, tiny_expected)
        chaos = Chaos(url, traffic)
        run_traffic(chaos, kill_twice)

        records = chaos.records
        check_answers(records, {"engine_dead"})
        valid = [r for r in records if not r.label.startswith("hostile")]
        assert sum(r.status == 200 and not r.stream_error for r in valid) > 30
        assert any(r.dropped for r in valid)
        assert any(r.error_code == "engine_dead" or r.stream_error for r in valid)
        hostile = [r for r in records if r.label.startswith("hostile")]
        assert len(hostile) >= len(hostile_bodies(HOSTILE_DECODERS))

        # Serving again: a correct answer, two restarts, no zombie.
        until(lambda: health(url) == "ok", 120, "serving again")
        body = {"prompt": TINY_PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert answer["choices"][0]["text"] == tiny_expected[(0, 12)]
        assert scrape(url, "stride_engine_restarts_total") == 2
        assert all(reaped(pid) for pid in killed)
        for gauge in ("requests_running", "requests_waiting", "kv_cache_usage_ratio"):
            until(lambda g=gauge: scrape(url, f"stride_{g}") == 0, 30, f"stride_{gauge} at 0")
        assert scrape(url, "stride_requests_rejected_total", reason="internal") == 0

        children = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        wait_gone(children)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- the default: in-process, the default model ---------------------------------------------

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
            while (r := httpx.post(f"{url}/v1/completions", json=crash, timeout=60)).status_code \
                    == 429:  # the queue is full: come back as told
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
