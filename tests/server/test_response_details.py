"""The details strict clients check (issue 32), each over real HTTP: fields that never change
type between chunks, the chosen token among completion top_logprobs, a tool call made whole
exactly at max_tokens, deltas that name their role once, and a Retry-After on 503 engine_dead."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers.decoders import extra_decoders
from tests.helpers.servers import LiveServer, error_of, tiny_config

USAGE = {"include_usage": True, "continuous_usage_stats": True}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_dir):
    live = LiveServer(tiny_config(tiny_dir))
    yield live
    live.stop()


def events(server: LiveServer, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(e) for e in data[:-1]]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("n", [1, 2])
def test_continuous_usage_leaves_out_what_has_no_value_yet(server, path, n):
    """`usage.decoder` and `usage.timings` are left out of every chunk until all choices have
    ended; then they are objects (one per choice when n > 1), never `[]`."""
    body = {"max_tokens": 5, "stream": True, "ignore_eos": True, "n": n, "stream_options": USAGE}
    body |= {"messages": ASK} if "chat" in path else {"prompt": "Hi"}
    for _ in range(5):  # deltas that pile up while the API process is busy arrive as one chunk,
        usages = [c["usage"] for c in events(server, path, body)]  # which checks nothing: again
        ended = next(i for i, u in enumerate(usages) if "decoder" in u)  # the last choice's end
        if ended > 0:
            break
    assert all("decoder" not in u and "timings" not in u for u in usages[:ended])
    one = dict if n == 1 else list
    assert all(isinstance(u["decoder"], one) and isinstance(u["timings"], one)
               for u in usages[ended:])  # fmt: skip
    assert ended > 0 and usages[-1]["completion_tokens"] == 5 * n


def test_completion_top_logprobs_always_hold_the_chosen_token(server):
    """Echoed prompt tokens and sampled tokens are often not among the top 1."""
    body = {"prompt": "the cat sat on the mat", "max_tokens": 8, "echo": True, "logprobs": 1,
            "temperature": 1.5, "seed": 3, "ignore_eos": True}  # fmt: skip
    logprobs = server.post("/v1/completions", body).json()["choices"][0]["logprobs"]
    pairs = list(zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True))
    assert pairs[0][1] is None  # the first prompt token: nothing scores it
    for token, top in pairs[1:]:
        assert token in top
    assert any(len(top) == 2 for _, top in pairs[1:])  # chosen beside a better one


def test_stream_deltas_name_their_role_once(server):
    body = {"messages": ASK, "max_tokens": 4, "stream": True, "n": 2, "ignore_eos": True}
    chunks = [c for c in events(server, "/v1/chat/completions", body) if c["choices"]]
    for index in (0, 1):
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"][0]["index"] == index]
        assert deltas[0]["role"] == "assistant"
        assert all("role" not in d for d in deltas[1:]), deltas


def test_engine_dead_says_when_to_retry(tiny_dir):
    """The engine dies (`crash`): its request and the next ones are 503 engine_dead with a
    Retry-After, until the restarted engine serves."""
    with extra_decoders():
        live = LiveServer(tiny_config(tiny_dir))
        try:
            crash = live.post("/v1/completions", {"prompt": "x", "max_tokens": 4,
                                                  "decoder": "crash"})  # fmt: skip
            error_of(crash, 503, "engine_dead")
            assert int(crash.headers["Retry-After"]) >= 1
            after = live.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
            error_of(after, 503, "engine_dead")
            assert int(after.headers["Retry-After"]) >= 1
            live.wait_ready()  # and it serves again
        finally:
            live.stop()


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_a_call_made_whole_exactly_at_max_tokens_finishes_tool_calls(default_server, choice):
    """Every max_tokens up to what the call takes: cut short, `length`; whole (the last token
    allowed closed it), `tool_calls` with the same call as when nothing cut it."""
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": choice, "temperature": 0}
    free = default_server.post("/v1/chat/completions", {**body, "max_tokens": 60}).json()
    assert free["choices"][0]["finish_reason"] == "tool_calls"
    reason, expected = finish(free)
    assert expected is not None
    needed = free["usage"]["completion_tokens"]
    for max_tokens in range(1, needed + 1):
        cut = {**body, "max_tokens": max_tokens}
        reason, arguments = finish(default_server.post("/v1/chat/completions", cut).json())
        if max_tokens == needed:
            assert (reason, arguments) == ("tool_calls", expected)
        else:
            assert (reason, arguments) == ("length", None), max_tokens
    streamed = events(default_server, "/v1/chat/completions",
                      {**body, "max_tokens": needed, "stream": True})  # fmt: skip
    assert streamed[-1]["choices"][0]["finish_reason"] == "tool_calls"


def finish(reply: dict) -> tuple[str, dict | None]:
    """The finish reason and the call's arguments, if they are whole JSON."""
    choice = reply["choices"][0]
    tool_calls = choice["message"].get("tool_calls") or []
    try:
        arguments = json.loads(tool_calls[0]["function"]["arguments"]) if tool_calls else None
    except ValueError:
        arguments = None
    return choice["finish_reason"], arguments
