"""The HTTP API through the official `openai` SDK against a real uvicorn server (tiny model)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from stride.scheduler.policy import SchedulerConfig
from tests.helpers.decoders import extra_decoders
from tests.helpers.servers import (
    PROMPT_IDS,
    LiveServer,
    error_of,
    hf_greedy,
    scrape,
    tiny_config,
)


@pytest.fixture(scope="module")
def server(tiny_dir):
    with extra_decoders():
        live = LiveServer(tiny_config(tiny_dir))
        yield live
        live.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai()


@pytest.fixture(scope="module")
def model(server) -> str:
    return server.app.state.serving.model_name


def greedy(client, model, prompt, max_tokens=8, **kw):
    return client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, **kw
    )


# ---- happy paths ------------------------------------------------------------------------------


def test_health_and_models(server, client, model):
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    models = client.models.list().data
    assert [m.id for m in models] == [model]


def test_greedy_completion_matches_transformers(client, model, tiny_hf, server):
    out = greedy(client, model, PROMPT_IDS, max_tokens=8, extra_body={"ignore_eos": True})
    expected = hf_greedy(tiny_hf, PROMPT_IDS, 8)
    tok = server.app.state.serving.tokenizer
    assert out.choices[0].text == tok.decode(expected, skip_special_tokens=True)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(PROMPT_IDS)
    assert out.usage.completion_tokens == 8
    assert out.usage.total_tokens == len(PROMPT_IDS) + 8
    extra = out.usage.model_extra
    assert extra["decoder"]["decoder"] == "ar" and extra["decoder"]["forward_passes"] == 8
    assert {"e2e", "ttft", "queue"} <= set(extra["timings"])


def test_prompt_forms(client, model, server):
    texts = ["Hello, world!", "Once upon a time"]
    single = greedy(client, model, texts[0]).choices[0].text
    many = greedy(client, model, texts)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == single
    ids = server.post("/tokenize", {"prompt": texts[0]}).json()["tokens"]
    assert greedy(client, model, ids).choices[0].text == single
    both = greedy(client, model, [ids, PROMPT_IDS])
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == single
    assert both.usage.prompt_tokens == len(ids) + len(PROMPT_IDS)


def test_chat(client, model):
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=6, temperature=0
    )
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert out.usage.completion_tokens <= 6
    assert choice.finish_reason in {"stop", "length"}
    parts = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
        max_tokens=6,
        temperature=0,
    )
    assert parts.choices[0].message.content == choice.message.content


def test_streaming_completion_with_usage(client, model):
    full = greedy(client, model, "Hello", max_tokens=10, extra_body={"ignore_eos": True})
    chunks = list(
        greedy(
            client,
            model,
            "Hello",
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.model_extra["decoder"]["decoder"] == "ar"
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_streaming_chat_with_usage(client, model):
    kw = dict(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0
    )
    full = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_raw_sse_ends_with_done(server, model):
    body = {"model": model, "prompt": "Hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-1])
    assert "usage" not in json.loads(events[0][6:])


def test_n_and_seed(client, model):
    kw = dict(model=model, prompt="Once", max_tokens=12, temperature=1.0, seed=1234, n=3)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # samples of one request differ
    assert len(a.usage.model_extra["decoder"]) == 3  # one summary per choice
    other = client.completions.create(**{**kw, "seed": 99})
    assert [c.text for c in other.choices] != [c.text for c in a.choices]
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=2
    )
    assert [c.index for c in chat.choices] == [0, 1]


def test_completion_logprobs_and_echo(client, model, server):
    out = greedy(client, model, "Hello", max_tokens=4, logprobs=3, echo=True)
    choice = out.choices[0]
    assert choice.text.startswith("Hello")
    lp = choice.logprobs
    n_prompt = out.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == n_prompt + 4
    # the prompt is scored too (tests/scheduler/test_prompt_logprobs.py checks the values)
    assert lp.token_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:n_prompt])
    for token, value, top in zip(
        lp.tokens[n_prompt:], lp.token_logprobs[n_prompt:], lp.top_logprobs[n_prompt:], strict=True
    ):
        assert value <= 0 and len(top) <= 3
        assert max(top.values()) == pytest.approx(value)  # greedy picks the top token
        assert token in top
    assert lp.text_offset == sorted(lp.text_offset)
    streamed = list(
        greedy(client, model, "Hello", max_tokens=4, logprobs=3, echo=True, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    tokens = [t for c in streamed for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens
    values = [v for c in streamed for v in c.choices[0].logprobs.token_logprobs]
    assert values == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_chat_logprobs(client, model):
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert bytes(entry.bytes).decode(errors="replace") == entry.token


def test_stop(client, model):
    full = greedy(client, model, PROMPT_IDS, max_tokens=12, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = text[4:6]
    cut = greedy(client, model, PROMPT_IDS, max_tokens=12, stop=[stop])
    choice = cut.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == text[: text.index(stop)]
    assert choice.model_extra["stop_reason"] == stop


def test_decoder_via_extra_body(client, model):
    plain = greedy(client, model, "Hello").choices[0].text
    for spec in ("ar", {"type": "ar"}, "slow"):
        out = greedy(client, model, "Hello", extra_body={"decoder": spec})
        assert out.choices[0].text == plain
        name = spec if isinstance(spec, str) else spec["type"]
        assert out.usage.model_extra["decoder"]["decoder"] == name


def test_tokenize_detokenize(server, model):
    ids = server.post("/tokenize", {"model": model, "prompt": "Hello, world!"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0
    text = server.post("/detokenize", {"model": model, "tokens": ids["tokens"]}).json()
    assert text["prompt"] == "Hello, world!"
    chat = server.post("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 2


# ---- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "temperature": 5}, "temperature"),
        ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": "x", "bogus": 1}, "bogus"),
        ({}, "prompt"),
        ({"prompt": "x", "logit_bias": {"nope": 1}}, "logit_bias"),
        ({"prompt": "x", "stop_token_ids": [10**6]}, "stop_token_ids"),
        ({"prompt": [10**6]}, "prompt"),
        ({"prompt": []}, "prompt"),
    ],
)
def test_validation_is_400(server, body, param):
    error = error_of(server.post("/v1/completions", body), 400, "invalid_request")
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_sdk_sees_errors(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", max_tokens=100_000)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x")
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], extra_body={"decoder": "nope"}
        )
    assert e.value.code == "invalid_decoder" and "valid decoders: ar" in e.value.message


def test_unknown_route_and_method(server):
    error_of(httpx.get(f"{server.url}/v1/nothing"), 404, "not_found")
    error_of(httpx.get(f"{server.url}/v1/completions"), 405, "method_not_allowed")
    error_of(server.post("/detokenize", {"tokens": [10**6]}), 400, "invalid_request")


def test_deadline(server, client, model):
    body = {"model": model, "prompt": "x", "max_tokens": 500, "ignore_eos": True}
    slow = {**body, "decoder": "slow", "timeout": 0.3}
    error_of(server.post("/v1/completions", slow), 504, "deadline_exceeded")
    chunks = list(
        client.completions.create(
            model=model,
            prompt="x",
            max_tokens=500,
            stream=True,
            extra_body={"decoder": "slow", "timeout": 0.3, "ignore_eos": True},
        )
    )
    assert chunks[-1].choices[0].finish_reason == "deadline"
    server.wait_idle()


def test_disconnect_mid_stream_frees_the_engine(server, model):
    server.wait_idle()
    body = {
        "model": model,
        "prompt": "x",
        "max_tokens": 500,
        "stream": True,
        "decoder": "slow",
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert server.core.num_running == 1
    server.wait_idle()  # running back to 0, every KV block free
    # No step follows the abort: the gauges must hear of it from the abort itself.
    for gauge in ("requests_running", "kv_cache_usage_ratio"):
        deadline = time.monotonic() + 10
        while scrape(server.url, f"stride_{gauge}") != 0:
            assert time.monotonic() < deadline, f"stride_{gauge} stays above 0 after the abort"
            time.sleep(0.05)


def test_disconnect_while_waiting_for_a_full_response(server, model):
    server.wait_idle()
    body = {"model": model, "prompt": "x", "max_tokens": 500, "decoder": "slow", "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        server.post("/v1/completions", body, timeout=0.5)
    server.wait_idle()


# ---- servers of their own ---------------------------------------------------------------------


def test_api_key(tiny_dir):
    live = LiveServer(tiny_config(tiny_dir, api_key="s3cret"))
    try:
        assert httpx.get(f"{live.url}/health").status_code == 200
        error_of(httpx.get(f"{live.url}/v1/models"), 401, "invalid_api_key")
        bad = {"Authorization": "Bearer wrong"}
        error_of(httpx.get(f"{live.url}/v1/models", headers=bad), 401, "invalid_api_key")
        with pytest.raises(openai.AuthenticationError):
            live.openai(api_key="wrong").models.list()
        assert live.openai().models.list().data
    finally:
        live.stop()


SLOW = {"prompt": "x", "max_tokens": 500, "decoder": "slow", "ignore_eos": True}


@contextlib.contextmanager
def one_at_a_time(tiny_dir, max_waiting: int) -> Iterator[LiveServer]:
    """A server that runs one sequence at a time (and has the `slow` decoder)."""
    config = tiny_config(
        tiny_dir, scheduler=SchedulerConfig(max_num_seqs=1, max_waiting=max_waiting)
    )
    with extra_decoders():
        live = LiveServer(config)
        try:
            yield live
        finally:
            live.stop()


@contextlib.contextmanager
def running(live: LiveServer) -> Iterator[None]:
    """A slow stream admitted and running for the block: the next request must wait."""
    url = f"{live.url}/v1/completions"
    with httpx.stream("POST", url, json={**SLOW, "stream": True}, timeout=30) as r:
        lines = r.iter_lines()
        next(lines)  # (the stream stays open while `lines` lives)
        yield


def test_queue_full_is_429(tiny_dir):
    with one_at_a_time(tiny_dir, max_waiting=1) as live:
        with running(live):
            answers: list[httpx.Response] = []
            waiting = threading.Thread(
                target=lambda: answers.append(
                    live.post("/v1/completions", {**SLOW, "max_tokens": 2})
                )
            )
            waiting.start()
            deadline = time.monotonic() + 30
            while live.core.num_waiting == 0 and not answers and time.monotonic() < deadline:
                time.sleep(0.01)
            assert live.core.num_waiting == 1, answers and answers[0].text
            r = live.post("/v1/completions", SLOW)
            error_of(r, 429, "queue_full")
            assert int(r.headers["Retry-After"]) >= 1
        waiting.join(timeout=30)  # the running one was aborted: the waiting one ran
        assert answers[0].status_code == 200
        live.wait_idle()


def test_a_request_that_leaves_while_waiting_counts_as_aborted(tiny_dir):
    """Every admitted request ends in `stride_requests_finished_total`, also one whose client left
    before the engine ever ran it (no output, no HTTP status: not a rejection either)."""
    with one_at_a_time(tiny_dir, max_waiting=4) as live:
        url = f"{live.url}/v1/completions"
        with running(live):
            with pytest.raises(httpx.ReadTimeout):  # (headers come with the first token)
                with httpx.stream("POST", url, json={**SLOW, "stream": True}, timeout=0.5):
                    pass
        live.wait_idle()
        deadline = time.monotonic() + 10
        while scrape(live.url, "stride_requests_finished_total", finish_reason="abort") < 2:
            assert time.monotonic() < deadline, "the one that left is uncounted"
            time.sleep(0.05)
        assert scrape(live.url, "stride_requests_finished_total") == 2
        assert scrape(live.url, "stride_requests_rejected_total") == 0


def test_a_request_that_fails_mid_stream_fails_alone(server, model):
    """The engine pins the failure on its request: an error event, and everyone else goes on."""
    body = {"prompt": "x", "max_tokens": 20, "stream": True, "decoder": "broken"}
    # greedy, and logprobs so that a token whose text is held back (part of a UTF-8
    # character) still makes an event: the tokens before the failure are what is checked
    body.update(ignore_eos=True, temperature=0, logprobs=1)
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "internal_error" and "injected failure" in error["message"]
    tokens = [t for e in events[:-2] for t in json.loads(e)["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) >= 2  # the tokens of the steps before the failure came first
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    ok = server.post("/v1/completions", {"prompt": "x", "max_tokens": 3, "model": model})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    server.wait_idle()


def test_loading_then_draining_is_503(tiny_dir, monkeypatch):
    import stride.server.app as app_module

    gate = threading.Event()
    build = app_module.build_client
    monkeypatch.setattr(
        app_module, "build_client", lambda config: (gate.wait(30), build(config))[1]
    )
    live = LiveServer(tiny_config(tiny_dir), wait=False)
    try:
        live.wait_listening()
        health = httpx.get(f"{live.url}/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "loading"
        error_of(live.post("/v1/completions", {"prompt": "x"}), 503, "model_loading")
        gate.set()
        live.wait_ready()
        live.app.state.lifecycle.begin_drain()
        health = httpx.get(f"{live.url}/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        error_of(live.post("/v1/completions", {"prompt": "x"}), 503, "server_draining")
    finally:
        gate.set()
        live.stop()
