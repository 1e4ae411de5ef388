"""`stride serve --engine-process`: the step loop in its own process, over real HTTP."""

from __future__ import annotations

import json
import pickle
import re
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from stride.decoders.sampling import TokenLogprob
from stride.scheduler.outputs import EngineError, RequestOutput
from tests.helpers.servers import (
    PROMPT_IDS,
    assert_sigterm_drains,
    free_port,
    hf_greedy,
    serve_engine_process,
    wait_healthy,
)

ROOT = Path(__file__).resolve().parents[2]
SLOW = {"prompt": "x", "max_tokens": 40, "ignore_eos": True, "stream": True, "decoder": "slow"}


@pytest.fixture(scope="module")
def served(tiny_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve_engine_process(tiny_dir, port)
    try:
        wait_healthy(url, proc)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _gauge(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return float(re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M).group(1))


def test_completion_matches_transformers(served, tiny_hf, tiny_dir):
    url, _ = served
    body = {"prompt": PROMPT_IDS, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    out = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    expected = AutoTokenizer.from_pretrained(tiny_dir).decode(
        hf_greedy(tiny_hf, PROMPT_IDS, 8), skip_special_tokens=True
    )
    assert out["choices"][0]["text"] == expected
    assert out["usage"]["completion_tokens"] == 8
    assert out["usage"]["decoder"]["forward_passes"] == 8


def test_streaming_matches_the_full_response(served):
    url, _ = served
    body = {"prompt": PROMPT_IDS, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    full = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=stream, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == full["choices"][0]["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == 12


def test_prefix_cache_hits_cross_the_pipe(served):
    """The engine process reports cached prompt tokens with each request and in its totals."""
    url, _ = served
    shared = list(range(40, 90))  # 3 full blocks of 16
    cached = []
    for last in (7, 8):
        body = {"prompt": shared + [last], "max_tokens": 2}
        usage = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["usage"]
        cached.append(usage["prompt_tokens_details"]["cached_tokens"])
    assert cached == [0, 48]
    assert _gauge(url, "stride_prefix_cache_hits_total") == 48


def test_disconnect_frees_the_kv_cache(served):
    url, _ = served
    steps = _gauge(url, "stride_engine_step_duration_seconds_count")
    with httpx.stream("POST", f"{url}/v1/completions", json=SLOW, timeout=60) as r:
        assert next(r.iter_lines()).startswith("data: ")
    deadline = time.monotonic() + 30
    while _gauge(url, "stride_kv_cache_usage_ratio") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gauge(url, "stride_kv_cache_usage_ratio") == 0  # shipped with the abort's output
    assert _gauge(url, "stride_requests_running") == 0
    time.sleep(0.3)  # an abort that did not land would keep stepping (20 ms each)
    assert _gauge(url, "stride_engine_step_duration_seconds_count") - steps < SLOW["max_tokens"]


def test_sigterm_drains_then_stops_the_engine_process(served):
    url, proc = served
    assert_sigterm_drains(url, proc, SLOW, 2)


def test_outputs_cross_the_pipe_whole():
    """The engine process pickles outputs and their logprobs as their field values in order:
    none is lost."""
    logprobs = [TokenLogprob(1, -0.25, [1, 7], [-0.25, -2.0]), None]
    out = RequestOutput("r", [1, 2], "ab", logprobs, "stop", "x", EngineError("c", "m"))
    out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens = 3, 2, 16
    out.decoder_stats, out.timings = {"forward_passes": 2}, {"e2e": 0.5}
    out.prompt_logprobs = [None, TokenLogprob(5, -1.5, [4], [-0.5], rank=2)]
    assert pickle.loads(ForkingPickler.dumps([out])) == [out]
