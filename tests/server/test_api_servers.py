"""`stride serve --api-servers 2`: two HTTP processes in front of one engine process."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from stride.server.cli import build_parser, default_api_servers, main, server_config
from tests.helpers.servers import (
    assert_sigterm_drains,
    descendants,
    free_port,
    hf_greedy,
    scrape,
    serve_engine_process,
    wait_gone,
    wait_healthy,
)

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 17, 42, 99, 7], [3, 1, 4, 1, 5, 9], [200, 100, 50], [7, 7, 7, 7]]
NEW = 6
SLOW = {"prompt": "x", "max_tokens": 40, "ignore_eos": True, "stream": True, "decoder": "slow"}


@pytest.fixture(scope="module")
def served(tiny_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve_engine_process(tiny_dir, port, api_servers=2)
    try:
        wait_healthy(url, proc, fresh=20)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _complete(url: str, ids: list[int], stream: bool) -> list[str]:
    """The generated tokens (as the text of each), streamed or not."""
    body = {"prompt": ids, "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    if not stream:
        out = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        return out["choices"][0]["logprobs"]["tokens"]
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0]["logprobs"] for e in events[:-1]]
    return [token for c in chunks for token in c["tokens"]]


def test_flag_environment_and_default(monkeypatch):
    monkeypatch.setenv("STRIDE_API_SERVERS", "3")
    args = build_parser().parse_args(["serve", "--device", "cpu"])
    assert args.api_servers == 3
    assert default_api_servers(server_config(args)) == 1  # the engine shares a CPU process
    assert main(["serve", "--api-servers", "2", "--no-engine-process"]) == 2
    assert main(["serve", "--api-servers", "0"]) == 2


def test_concurrent_requests_match_transformers(served, tiny_hf, tiny_dir):
    url, _ = served
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    expected = [[tokenizer.decode([t]) for t in hf_greedy(tiny_hf, p, NEW)] for p in PROMPTS]
    jobs = [(i % len(PROMPTS), i % 2 == 0) for i in range(24)]  # fresh connection each
    with ThreadPoolExecutor(12) as pool:
        tokens = list(pool.map(lambda job: _complete(url, PROMPTS[job[0]], job[1]), jobs))
    assert tokens == [expected[p] for p, _ in jobs]
    bad = httpx.post(f"{url}/v1/completions", json={"prompt": [5], "model": "nope"}, timeout=60)
    assert bad.status_code == 404 and bad.json()["error"]["code"] == "model_not_found"


def test_metrics_count_every_process(served):
    url, _ = served
    sent = scrape(url, "stride_requests_received_total")
    tokens = scrape(url, "stride_generation_tokens_total")
    ids = PROMPTS[0]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: _complete(url, ids, i % 2 == 0), range(16)))
    for _ in range(8):  # each scrape on a fresh connection: either process may answer
        assert scrape(url, "stride_requests_received_total") == sent + 16
        assert scrape(url, "stride_generation_tokens_total") == tokens + 16 * NEW
        assert scrape(url, "stride_engine_step_duration_seconds_count") > 0
        assert scrape(url, "stride_requests_running") == 0
        assert scrape(url, "stride_kv_cache_usage_ratio") == 0


def test_sigterm_drains_and_leaves_no_process(served):
    url, proc = served
    children = descendants(proc.pid)
    assert len(children) >= 3  # the engine and two API processes
    assert_sigterm_drains(url, proc, SLOW, 4)
    wait_gone(children, timeout=10)


def test_killed_supervisor_leaves_no_process(tiny_dir):
    port = free_port()
    proc = serve_engine_process(tiny_dir, port, api_servers=2)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, fresh=20)
        children = descendants(proc.pid)
        proc.kill()
        proc.wait()
        wait_gone(children)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
