"""Chaos: valid and hostile traffic at once against `stride serve --engine-process`, with a
`kill -9` of the engine process in the middle.

For about a minute, workers send valid requests over every decoder (ar, speculative with the
n-gram and early-exit drafters, refine with Jacobi and lookahead; completions and chat,
streamed or not, greedy or sampled, n of 1 or 2), dropping about one stream in ten after its
first event; one worker sends a corpus of hostile bodies (the two requests that killed the
engine in issue 16, wrong types and ranges for every field, huge and deeply nested bodies,
invalid UTF-8); a third of the way in, the engine process is killed. Then:

- every request got exactly one terminal answer: a response whose choices all finished, one
  error (a status and an OpenAI error), or a stream whose choices each finished once, or that
  ended with one error event, then `[DONE]`;
- no bad input got a 5xx (503 `engine_dead` only while the engine was down), nor a 422;
- every greedy answer equals transformers' greedy tokens, whatever the decoder;
- the server serves again within the restart budget (`/health` 200 and a correct greedy
  answer), restarted once, and the dead engine was reaped;
- the running and waiting gauges and the KV usage are back to 0, and SIGTERM exits 0.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
from transformers import AutoTokenizer

from stride.scheduler.detokenizer import Detokenizer
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

RUN_S = 60.0  # of traffic
KILL_AT_S = 20.0
WORKERS = 5  # valid traffic; one more sends the hostile corpus
PROMPTS = [[5, 17, 42, 99, 7], [3, 1, 4, 1, 5, 9, 2, 6], [200, 100, 50, 25]]
LENGTHS = (6, 12)
DECODERS = [
    "ar",
    {"type": "speculative", "draft": "ngram", "num_speculative_tokens": 3, "adaptive": False},
    {"type": "speculative", "draft": "early_exit", "num_speculative_tokens": 2},
    {"type": "refine", "method": "jacobi", "window": 4},
    {"type": "refine", "method": "lookahead"},
]
SAMPLES = ["ar", {"type": "speculative", "draft": "ngram", "adaptive": False}]
ERROR_CODES = {  # what bad input may be told (README), and engine_dead while it is down
    400: {"invalid_request", "invalid_decoder", "context_length_exceeded"},
    404: {"model_not_found"},
    413: {"request_too_large"},
    503: {"engine_dead"},
}


def hostile_bodies() -> list[tuple[str, bytes, str]]:
    """(label, body, path) for every field's wrong types and ranges, and worse."""
    base = {"prompt": "hi", "max_tokens": 4}
    nan, inf = float("nan"), float("inf")
    bad_values = {
        "model": [5, ["x"], "nope"],
        "n": [0, 129, -1, "2", 1.5, None],
        "temperature": [-0.1, 2.1, "hot", nan, inf],
        "top_p": [0, 1.01, -inf],
        "top_k": [-2, 10**20, 2**31, "5"],
        "min_p": [-0.1, 1.1, nan],
        "seed": [2**63, -(2**63) - 1, "s", 1.5],
        "stop": ["", [""], ["a"] * 17, 5],
        "stop_token_ids": [[-1], [2**31], "x", [10**6]],
        "min_tokens": [-1, 2**31, "1"],
        "presence_penalty": [-2.1, 2.1, nan],
        "frequency_penalty": [3, -3],
        "repetition_penalty": [0, 11, -inf],
        "logit_bias": [{"x": 1}, {"5": 101}, {"-1": 1}, {"999999": 1}, [1], {"5": nan}],
        "stream": ["yes", 2],
        "stream_options": [{"bogus": 1}, 5],
        "user": [5, {}],
        "priority": [2**31, "high"],
        "timeout": [0, -1, 86401, nan],
        "max_tokens": [-1, 2**31, 10**6, "4"],  # (0 is valid: with echo, it scores the prompt)
        "echo": ["yes"],
        "logprobs": [21, -1],
        "ignore_eos": ["no"],
        "skip_special_tokens": [3],
        "prompt": [None, [], [-1], [[1], "a"], 5, [10**9], ""],
        "bogus": [1],
        "decoder": [
            {"type": "refine", "method": ["jacobi"]},  # killed the engine (issue 16)
            {"type": "refine", "method": {"m": 1}},
            {"type": "refine", "method": "lookahead", "window": 0},
            {"type": "speculative", "draft": "nope"},
            {"type": "speculative", "num_speculative_tokens": 17},
            {"type": "speculative", "draft": "early_exit", "exit_layer": 3},
            {"type": "nope"},
            "nope",
            5,
        ],
    }
    out = []
    for name, values in bad_values.items():
        for v in values:
            body = {**base, name: v}
            out.append((f"{name}={v!r}"[:60], json.dumps(body).encode(), "/v1/completions"))
    for messages in ([], [{"role": "robot", "content": "x"}], [{"role": "user", "content": 5}]):
        body = json.dumps({"messages": messages, "max_tokens": 4}).encode()
        out.append((f"messages={messages!r}", body, "/v1/chat/completions"))
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    out.append(("chat n=129", json.dumps({**chat, "n": 129}).encode(), "/v1/chat/completions"))
    out += [
        (
            "top_k 1e20 (issue 16)",
            b'{"prompt":"hi","max_tokens":4,"top_k":1' + b"0" * 20 + b"}",
            "/v1/completions",
        ),
        ("invalid UTF-8", b'{"prompt": "\xff\xfe\xfd", "max_tokens": 4}', "/v1/completions"),
        ("nested 100k", b"[" * 100_000, "/v1/completions"),
        ("nested prompt", b'{"prompt": ' + b"[" * 500 + b"]" * 500 + b"}", "/v1/completions"),
        ("bad JSON", b'{"prompt": "hi",', "/v1/completions"),
        ("5 MiB", json.dumps({"prompt": "a" * (5 << 20)}).encode(), "/v1/completions"),
        ("3 MB prompt", json.dumps({"prompt": "ab " * 1_000_000}).encode(), "/v1/completions"),
        (
            "3 MB chat",
            json.dumps({"messages": [{"role": "user", "content": "x " * 1_500_000}]}).encode(),
            "/v1/chat/completions",
        ),
        ("100k ids", json.dumps({"prompt": [5] * 100_000}).encode(), "/v1/completions"),
        ("not an object", b"[1, 2, 3]", "/v1/completions"),
        ("empty", b"", "/v1/completions"),
    ]
    return out


@dataclass
class Record:
    """One request and its terminal answer as the client saw it."""

    label: str
    status: int | None = None
    error_code: str | None = None
    texts: dict[int, str] = field(default_factory=dict)
    finishes: dict[int, list[str]] = field(default_factory=dict)
    stream_error: str | None = None
    dropped: bool = False  # the client went away on purpose
    problem: str | None = None  # a violation of the contract, described
    expected: str | None = None  # greedy: what transformers says
    n: int = 1


class Chaos:
    def __init__(self, url: str, expected: dict[tuple[int, int], str]) -> None:
        self.url = url
        self.expected = expected
        self.records: list[Record] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def keep(self, record: Record) -> None:
        with self.lock:
            self.records.append(record)

    # ---- valid traffic ------------------------------------------------------------------------

    def valid(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self.stop.is_set():
                record = self._one(client, rng)
                self.keep(record)
                if record.status == 503:  # the engine is down: not every millisecond
                    time.sleep(0.05)

    def _one(self, client: httpx.Client, rng: random.Random) -> Record:
        greedy = rng.random() < 0.75
        decoder = rng.choice(DECODERS if greedy else SAMPLES)
        p, length = rng.randrange(len(PROMPTS)), rng.choice(LENGTHS)
        n = rng.choice((1, 1, 2))
        body = {"max_tokens": length, "ignore_eos": True, "n": n, "decoder": decoder}
        body["temperature"] = 0 if greedy else 0.8
        if not greedy:
            body["seed"] = rng.randrange(1000)
        chat = rng.random() < 0.3
        if chat:
            body["messages"] = [{"role": "user", "content": f"Tell me about {p}"}]
        else:
            body["prompt"] = PROMPTS[p]
        stream = rng.random() < 0.6
        record = Record(f"{'chat' if chat else 'cmpl'} {json.dumps(decoder)} n={n}", n=n)
        if greedy and not chat:
            record.expected = self.expected[(p, length)]
        path = "/v1/chat/completions" if chat else "/v1/completions"
        if stream:
            body["stream"] = True
            self._stream(client, path, body, record, drop=rng.random() < 0.1)
        else:
            self._complete(client, path, body, record)
        if record.status == 200 and not record.dropped and not record.stream_error:
            self._check_finished(record, chat, length)
        return record

    def _complete(self, client, path, body, record: Record) -> None:
        r = client.post(path, json=body)
        record.status = r.status_code
        data = r.json()
        if r.status_code != 200:
            record.error_code = data["error"]["code"]
            return
        for choice in data["choices"]:
            i = choice["index"]
            text = choice["text"] if "text" in choice else choice["message"]["content"]
            record.texts[i] = text
            record.finishes.setdefault(i, []).append(choice["finish_reason"])

    def _stream(self, client, path, body, record: Record, drop: bool) -> None:
        with client.stream("POST", path, json=body) as r:
            record.status = r.status_code
            if r.status_code != 200:
                record.error_code = json.loads(r.read())["error"]["code"]
                return
            events = []
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if drop:
                    record.dropped = True
                    return  # leaving the block closes the connection mid-stream
        if events[-1:] != ["[DONE]"]:
            record.problem = f"stream did not end with [DONE]: {events[-2:]}"
            return
        for k, event in enumerate(events[:-1]):
            chunk = json.loads(event)
            if "error" in chunk:
                record.stream_error = chunk["error"]["code"]
                if k != len(events) - 2:
                    record.problem = "events after an error"
                return
            for choice in chunk["choices"]:
                i = choice["index"]
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                record.texts[i] = record.texts.get(i, "") + piece
                if choice["finish_reason"] is not None:
                    record.finishes.setdefault(i, []).append(choice["finish_reason"])

    def _check_finished(self, record: Record, chat: bool, length: int) -> None:
        for i in range(record.n):
            if record.finishes.get(i) != ["length"]:
                record.problem = f"choice {i} ended {record.finishes.get(i)}"
            elif record.expected is not None and record.texts.get(i) != record.expected:
                record.problem = f"choice {i}: {record.texts.get(i)!r} != {record.expected!r}"

    # ---- hostile traffic ----------------------------------------------------------------------

    def hostile(self, bodies: list[tuple[str, bytes, str]]) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self.stop.is_set():
                for label, body, path in bodies:
                    if self.stop.is_set():
                        return
                    record = Record(f"hostile {label}")
                    try:
                        r = client.post(
                            path, content=body, headers={"Content-Type": "application/json"}
                        )
                    except httpx.TransportError as e:  # a 413 may close before the body is sent
                        record.problem = f"no answer: {e!r}"
                        self.keep(record)
                        continue
                    record.status = r.status_code
                    try:
                        record.error_code = r.json()["error"]["code"]
                    except (ValueError, KeyError, TypeError):
                        record.problem = f"not an OpenAI error: {r.status_code} {r.text[:200]}"
                    if record.error_code not in ERROR_CODES.get(r.status_code, ()):
                        record.problem = f"{r.status_code} {r.text[:200]}"
                    self.keep(record)


def _summary(records: list[Record]) -> str:
    """Counts by kind and outcome (printed: `pytest -s` shows what a run did)."""
    counts: dict[str, int] = {}
    for r in records:
        kind = "hostile" if r.label.startswith("hostile") else r.label.split(" ")[0]
        outcome = "dropped" if r.dropped else r.stream_error or r.error_code or str(r.status)
        counts[f"{kind} {outcome}"] = counts.get(f"{kind} {outcome}", 0) + 1
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))


@pytest.fixture(scope="module")
def expected(tiny_dir, tiny_hf) -> dict[tuple[int, int], str]:
    """The text of transformers' greedy tokens, as the server streams text (a character cut
    at the end stays out)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    out = {}
    for p, ids in enumerate(PROMPTS):
        tokens = hf_greedy(tiny_hf, ids, max(LENGTHS))
        for length in LENGTHS:
            detok = Detokenizer(tokenizer, [], skip_special_tokens=True)
            for t in tokens[:length]:
                detok.add(t)
            out[(p, length)] = detok.take(final=True)
    return out


def test_chaos(tiny_dir, expected):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve_engine_process(tiny_dir, port)
    try:
        wait_healthy(url, proc)
        chaos = Chaos(url, expected)
        workers = [threading.Thread(target=chaos.valid, args=(i,)) for i in range(WORKERS)]
        workers.append(threading.Thread(target=chaos.hostile, args=(hostile_bodies(),)))
        for w in workers:
            w.start()
        time.sleep(KILL_AT_S)
        killed = engine_pid(proc.pid)
        os.kill(killed, signal.SIGKILL)
        time.sleep(RUN_S - KILL_AT_S)
        chaos.stop.set()
        for w in workers:
            w.join(180)
            assert not w.is_alive(), "a request never got an answer"

        records = chaos.records
        print(_summary(records))
        problems = [(r.label, r.problem) for r in records if r.problem]
        assert not problems, problems[:20]
        statuses = {r.status for r in records}
        assert statuses <= {200, 400, 404, 413, 503}, statuses  # never 5xx but 503, never 422
        for r in records:
            if r.status == 503 or r.stream_error:
                assert (r.error_code or r.stream_error) == "engine_dead", r
        valid = [r for r in records if not r.label.startswith("hostile")]
        assert sum(r.status == 200 and not r.stream_error for r in valid) > 50
        assert any(r.dropped for r in valid)
        assert any(r.error_code == "engine_dead" or r.stream_error for r in valid)
        hostile = [r for r in records if r.label.startswith("hostile")]
        assert len(hostile) >= len(hostile_bodies())

        # Serving again: within the restart budget, a correct answer, one restart, no zombie.
        deadline = time.monotonic() + 120
        while httpx.get(f"{url}/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "not serving again"
            time.sleep(0.2)
        body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert answer["choices"][0]["text"] == expected[(0, 12)]
        assert scrape(url, "stride_engine_restarts_total") == 1
        assert reaped(killed)
        for gauge in ("requests_running", "requests_waiting", "kv_cache_usage_ratio"):
            deadline = time.monotonic() + 30
            while scrape(url, f"stride_{gauge}") != 0:
                assert time.monotonic() < deadline, f"stride_{gauge} stays above 0"
                time.sleep(0.2)
        assert scrape(url, "stride_requests_rejected_total", reason="internal") == 0

        children = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        wait_gone(children)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
