"""Chaos: valid and hostile traffic at once against `stride serve --engine-process` on a tiny
model, while the engine process is killed twice in a row; the contract of every answer is in
`tests/helpers/chaos.py` (the default mode's run: `test_chaos_default.py`).

About 10 s of traffic, plus what starting, restarting and stopping take: every decoder (ar,
speculative with n-gram and early-exit drafts, refine with Jacobi and lookahead), completions
and chat, streamed or not, greedy or sampled, n of 1 or 2, about one stream in ten dropped after
its first event, and the corpus of hostile bodies (the requests that killed the engine in issue
16, wrong types and ranges for every field, hostile decoder objects on both routes, huge and
deeply nested bodies, invalid UTF-8); `kill -9` of the engine process, and of its successor as
soon as it serves. Then the server serves again (two restarts, the dead engines reaped), the
gauges are back to 0, and SIGTERM exits 0. Every greedy answer equals transformers' greedy
decoding: the lossless decoders are lossless.
"""

from __future__ import annotations

import os
import signal

import httpx
import pytest
from transformers import AutoTokenizer

from stride.scheduler.detokenizer import Detokenizer
from tests.helpers.chaos import (
    HOSTILE_DECODERS,
    LENGTHS,
    Chaos,
    Traffic,
    check_answers,
    health,
    hostile_bodies,
    run_traffic,
    until,
)
from tests.helpers.servers import (
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

TINY_PROMPTS = [[5, 17, 42, 99, 7], [3, 1, 4, 1, 5, 9, 2, 6], [200, 100, 50, 25]]
TINY_DECODERS = [
    "ar",
    {"type": "speculative", "draft": "ngram", "num_speculative_tokens": 3, "adaptive": False},
    {"type": "speculative", "draft": "early_exit", "num_speculative_tokens": 2},
    {"type": "refine", "method": "jacobi", "window": 4},
    {"type": "refine", "method": "lookahead"},
]
SAMPLED = ["ar", {"type": "speculative", "draft": "ngram", "adaptive": False}]


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
