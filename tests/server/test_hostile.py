"""Hostile and unlucky input over real HTTP: the README's error contract for every path, the
body limit, large bodies that are refused before they are tokenized, and requests that can never
be admitted.
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from stride.scheduler.policy import SchedulerConfig
from tests.helpers.servers import LiveServer, error_of, tiny_config

LIMIT = 4 << 20  # the default --max-request-body


@pytest.fixture(scope="module")
def server(tiny_dir):
    live = LiveServer(tiny_config(tiny_dir, scheduler=SchedulerConfig(max_waiting=4)))
    yield live
    live.stop()


def raw(server: LiveServer, body: bytes, path: str = "/v1/completions") -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    return httpx.post(f"{server.url}{path}", content=body, headers=headers, timeout=60)


BAD_BODIES = [  # (body, code, param, words in the message)
    (b'{"prompt": "\xff\xfe"}', "invalid_request", None, "UTF-8"),
    (b"[" * 100_000, "invalid_request", None, "nested too deeply"),
    (b'{"prompt": "x",', "invalid_request", None, "not valid JSON"),
    (b'{"prompt": "x", "temperature": NaN}', "invalid_request", "temperature", "finite"),
    (b'{"prompt": "x", "top_p": Infinity}', "invalid_request", "top_p", "finite"),
    (b'{"prompt": "x", "top_k": 100000000000000000000}', "invalid_request", "top_k", "less"),
    (b'{"prompt": "x", "logit_bias": {"5": 1e400}}', "invalid_request", "logit_bias.5", ""),
    (b'{"prompt": "x", "logit_bias": {"-1": 1}}', "invalid_request", "logit_bias", ""),
    (b'{"prompt": "x", "seed": 1e30}', "invalid_request", "seed", ""),
    (b'{"prompt": "x", "n": 0}', "invalid_request", "n", ""),
    (b'{"prompt": "x", "n": "2"}', "invalid_request", "n", "integer"),
    (b'{"prompt": "x", "stream": 1}', "invalid_request", "stream", "boolean"),
    (b'{"prompt": [-1]}', "invalid_request", "prompt", ""),
    (b'{"prompt": "x", "stop": [""]}', "invalid_request", "stop", ""),
    (b"[1, 2]", "invalid_request", None, "dictionary"),
    (b'"just a string"', "invalid_request", None, "dictionary"),
]
BAD_DECODERS = [  # every one a 400 invalid_decoder, before or at admission
    {"type": "refine", "method": ["jacobi"]},
    {"type": "refine", "method": {"name": "jacobi"}},
    {"type": "refine", "method": "beam"},
    {"type": "refine", "window": "8"},
    {"type": "refine", "method": "lookahead", "candidates": 33},
    {"type": "speculative", "draft": "nope"},
    {"type": "speculative", "colour": "blue"},
    {"type": "speculative", "num_speculative_tokens": 1e9},
    {"type": "speculative", "draft": "early_exit", "exit_layer": 99},
    {"type": "ar", "window": 2},
    {"type": 5},
    {"no": "type"},
    "nope",
    7,
    ["ar"],
]


@pytest.mark.parametrize("body, code, param, words", BAD_BODIES)
def test_bad_bodies_are_400_as_the_readme_says(server, body, code, param, words):
    error = error_of(raw(server, body), 400, code)
    assert error["param"] == param and words in error["message"]
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("decoder", BAD_DECODERS, ids=str)
def test_bad_decoders_are_400_invalid_decoder(server, decoder):
    body = {"prompt": "hi", "max_tokens": 4, "temperature": 0, "decoder": decoder}
    error = error_of(server.post("/v1/completions", body), 400, "invalid_decoder")
    assert error["param"] == "decoder"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "decoder": decoder}
    error_of(server.post("/v1/chat/completions", chat), 400, "invalid_decoder")


def test_the_engine_survives_all_of_it(server):
    """After the bad bodies above (the two killers of issue 16 among them) it still serves."""
    for body in BAD_BODIES[:6]:
        raw(server, body[0])
    ok = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    server.wait_idle()


def test_a_body_over_the_limit_is_413_before_it_is_read(server):
    """A client that declares 100 MB gets its 413 having sent a kilobyte of it."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(head + b"Content-Length: 100000000\r\n\r\n" + b'{"prompt": "' + b"a" * 1000)
        answer = b""
        while b"}}" not in answer:
            chunk = sock.recv(65536)
            assert chunk, answer
            answer += chunk
    status, _, body = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 413")
    assert b'"code":"request_too_large"' in body and str(LIMIT).encode() in body


def test_a_connection_idle_as_long_as_clients_keep_one_is_still_answered(server):
    """Clients keep an idle connection in their pools for 5 s (httpx, so the openai SDK); a
    request they send on it then is answered, not cut by the server closing it at that moment
    ("Server disconnected without sending a response")."""

    def health(sock: socket.socket) -> bytes:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while not answer.endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                return answer
            answer += chunk
        return answer

    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        assert health(sock).startswith(b"HTTP/1.1 200")
        time.sleep(6)
        assert health(sock).startswith(b"HTTP/1.1 200")


def test_a_streamed_body_over_the_limit_is_413(server):
    def chunks():  # no Content-Length: read until it passes the limit
        yield b'{"prompt": "'
        for _ in range(LIMIT // 65536 + 2):
            yield b"a" * 65536
        yield b'"}'

    error_of(raw(server, chunks()), 413, "request_too_large")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "hello world, this is a long prompt. " * 80_000},  # ~2.9 MB
        {"messages": [{"role": "user", "content": "x " * 1_500_000}]},
    ],
)
def test_tokenize_is_bounded_like_the_generation_routes(server, body):
    """A text too long for the context is refused before it is tokenized, while /health
    answers meanwhile; one that fits is tokenized."""
    answers: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: answers.append(server.post("/tokenize", body)))
    worker.start()
    assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200
    worker.join(120)
    param = "prompt" if "prompt" in body else "messages"
    error = error_of(answers[0], 400, "context_length_exceeded")
    assert error["param"] == param
    fits = server.post("/tokenize", {"prompt": "hello world " * 10})
    assert fits.status_code == 200 and fits.json()["count"] > 10


@pytest.mark.parametrize("prompt", ["ab " * 400_000, [5] * 100_000])
def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(server, prompt):
    error = error_of(
        server.post("/v1/completions", {"prompt": prompt}), 400, "context_length_exceeded"
    )
    assert error["param"] == "prompt"


def test_more_sequences_than_the_queue_holds_is_400_not_429(server):
    """max_waiting is 4: n = 5, 3 prompts x n = 2, or best_of 5 can never be admitted (the
    error names the field that asked for them); n = 4 can."""
    for body, param in (
        ({"prompt": "x", "n": 5}, "n"),
        ({"prompt": ["a", "b", "c"], "n": 2}, "n"),
        ({"prompt": "x", "best_of": 5}, "best_of"),
    ):
        error = error_of(
            server.post("/v1/completions", {**body, "max_tokens": 2}), 400, "invalid_request"
        )
        assert (
            error["param"] == param
            and "4" in error["message"]
            and "--max-waiting" in error["message"]
        )
    chat = {"messages": [{"role": "user", "content": "x"}], "n": 5, "max_tokens": 2}
    error_of(server.post("/v1/chat/completions", chat), 400, "invalid_request")
    ok = server.post("/v1/completions", {"prompt": "x", "n": 4, "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4
    server.wait_idle()


def test_a_deadline_runs_from_arrival(server):
    """A body that takes longer to arrive than the request's timeout is late already."""

    def slowly():
        yield b'{"prompt": "x", "max_tokens": 2, '
        time.sleep(1.5)
        yield b'"timeout": 1}'

    error = error_of(raw(server, slowly()), 504, "deadline_exceeded")  # type: ignore[arg-type]
    assert "before it could be admitted" in error["message"]
