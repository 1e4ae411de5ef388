"""Chaos traffic against a live `stride serve`: valid requests over every decoder, a corpus of
hostile bodies, the contract every answer is checked against, and the run that sends them
(tests/server/test_chaos.py, test_chaos_default.py).

Each request gets exactly one terminal answer: a response whose choices all finished, one
error (a status and an OpenAI error), or a stream whose choices each finished once, or that
ended with one error event, then `[DONE]`. Once the server was told to stop (`stopping`), a
refused connection is an answer too: the process has gone.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

ERROR_CODES = {  # what bad input may be told (README), and what a server in trouble says
    400: {"invalid_request", "invalid_decoder", "context_length_exceeded"},
    404: {"model_not_found"},
    413: {"request_too_large"},
    429: {"queue_full"},
    503: {"engine_dead", "server_draining"},
}


def hostile_bodies(decoders: list[Any]) -> list[tuple[str, bytes, str]]:
    """(label, body, path) for every field's wrong types and ranges, and worse; every hostile
    decoder object on both routes."""
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
    }
    out = []
    for name, values in bad_values.items():
        for v in values:
            body = {**base, name: v}
            out.append((f"{name}={v!r}"[:60], json.dumps(body).encode(), "/v1/completions"))
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for decoder in decoders:  # (the objects that killed the engine in issue 16 among them)
        for route, body in (("/v1/completions", base), ("/v1/chat/completions", chat)):
            label = f"{route.split('/')[-1]} decoder={json.dumps(decoder)}"[:80]
            out.append((label, json.dumps({**body, "decoder": decoder}).encode(), route))
    for messages in ([], [{"role": "robot", "content": "x"}], [{"role": "user", "content": 5}]):
        body = json.dumps({"messages": messages, "max_tokens": 4}).encode()
        out.append((f"messages={messages!r}", body, "/v1/chat/completions"))
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
        ("3 MB tokenize", json.dumps({"prompt": "ab " * 1_000_000}).encode(), "/tokenize"),
        ("100k ids", json.dumps({"prompt": [5] * 100_000}).encode(), "/v1/completions"),
        ("not an object", b"[1, 2, 3]", "/v1/completions"),
        ("empty", b"", "/v1/completions"),
    ]
    return out


HOSTILE_DECODERS = [
    {"type": "refine", "method": ["jacobi"]},  # killed the engine (issue 16)
    {"type": "refine", "method": {"m": 1}},
    {"type": "refine", "method": "lookahead", "window": 0},
    {"type": "speculative", "draft": "nope"},
    {"type": "speculative", "num_speculative_tokens": 17},
    {"type": "speculative", "draft": "early_exit", "exit_layer": 1000},
    {"type": "nope"},
    "nope",
    5,
]


@dataclass
class Traffic:
    """What the valid workers send: prompts (token ids or text), decoders for greedy requests
    and for sampled ones, output lengths, and the text greedy decoding gives for each (prompt
    index, length) on /v1/completions."""

    prompts: list[Any]
    greedy: list[Any]
    sampled: list[Any]
    lengths: tuple[int, ...]
    expected: dict[tuple[int, int], str] = field(default_factory=dict)


@dataclass
class Record:
    """One request and its terminal answer as the client saw it."""

    label: str
    status: int | None = None
    error_code: str | None = None
    retry_after: str | None = None
    texts: dict[int, str] = field(default_factory=dict)
    finishes: dict[int, list[str]] = field(default_factory=dict)
    stream_error: str | None = None
    dropped: bool = False  # the client went away on purpose
    gone: bool = False  # no connection: the server had been told to stop and exited
    problem: str | None = None  # a violation of the contract, described
    expected: str | None = None  # greedy: what plain decoding says
    n: int = 1


class Chaos:
    def __init__(self, url: str, traffic: Traffic) -> None:
        self.url = url
        self.traffic = traffic
        self.records: list[Record] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.stopping = threading.Event()  # the server was sent SIGTERM

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
                if record.gone:
                    return
                if record.status in (429, 503):  # not every millisecond
                    time.sleep(0.05)

    def _one(self, client: httpx.Client, rng: random.Random) -> Record:
        t = self.traffic
        greedy = rng.random() < 0.75
        decoder = rng.choice(t.greedy if greedy else t.sampled)
        p, length = rng.randrange(len(t.prompts)), rng.choice(t.lengths)
        n = rng.choice((1, 1, 2))
        body = {"max_tokens": length, "ignore_eos": True, "n": n, "decoder": decoder}
        body["temperature"] = 0 if greedy else 0.8
        if not greedy:
            body["seed"] = rng.randrange(1000)
        chat = rng.random() < 0.3
        if chat:
            body["messages"] = [{"role": "user", "content": f"Tell me about {p}"}]
        else:
            body["prompt"] = t.prompts[p]
        stream = rng.random() < 0.6
        record = Record(f"{'chat' if chat else 'cmpl'} {json.dumps(decoder)} n={n}", n=n)
        if greedy and not chat:
            record.expected = t.expected.get((p, length))
        path = "/v1/chat/completions" if chat else "/v1/completions"
        try:
            if stream:
                body["stream"] = True
                self._stream(client, path, body, record, drop=rng.random() < 0.1)
            else:
                self._complete(client, path, body, record)
        except httpx.TransportError as e:  # (a stream cut after its 200 is no answer)
            record.gone = self.stopping.is_set() and record.status is None
            if not record.gone:
                record.problem = f"no answer: {e!r}"
        if record.status == 200 and not record.dropped and not record.stream_error:
            self._check_finished(record, length)
        return record

    def burst(self, count: int, body: dict) -> None:
        """`count` copies of the completion `body` at once (more than the queue holds)."""

        def one() -> None:
            record = Record(f"burst n={body.get('n', 1)}", n=body.get("n", 1))
            with httpx.Client(base_url=self.url, timeout=120) as client:
                self._complete(client, "/v1/completions", body, record)
            self.keep(record)

        threads = [threading.Thread(target=one) for _ in range(count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)

    def _complete(self, client, path, body, record: Record) -> None:
        r = client.post(path, json=body)
        record.status = r.status_code
        data = r.json()
        if r.status_code != 200:
            record.error_code = data["error"]["code"]
            record.retry_after = r.headers.get("Retry-After")
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
                record.retry_after = r.headers.get("Retry-After")
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

    def _check_finished(self, record: Record, length: int) -> None:
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
                    if self.stop.is_set() or self.stopping.is_set():
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
                    record.retry_after = r.headers.get("Retry-After")
                    try:
                        record.error_code = r.json()["error"]["code"]
                    except (ValueError, KeyError, TypeError):
                        record.problem = f"not an OpenAI error: {r.status_code} {r.text[:200]}"
                    if record.error_code not in ERROR_CODES.get(r.status_code, ()):
                        record.problem = f"{r.status_code} {r.text[:200]}"
                    self.keep(record)


def summary(records: list[Record]) -> str:
    """Counts by kind and outcome (printed: `pytest -s` shows what a run did)."""
    counts: dict[str, int] = {}
    for r in records:
        kind = "hostile" if r.label.startswith("hostile") else r.label.split(" ")[0]
        outcome = "dropped" if r.dropped else r.stream_error or r.error_code or str(r.status)
        counts[f"{kind} {outcome}"] = counts.get(f"{kind} {outcome}", 0) + 1
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))


def check_answers(records: list[Record], allowed: set[str]) -> None:
    """The contract over every record: no problem, no 5xx but 503, no 422, and the error codes
    of 429 and 503 (and stream errors) among `allowed`; a 429 and a 503 engine_dead say when to
    come back."""
    problems = [(r.label, r.problem) for r in records if r.problem]
    assert not problems, problems[:20]
    statuses = {r.status for r in records if not r.gone}
    assert statuses <= {200, 400, 404, 413, 429, 503}, statuses
    for r in records:
        if r.status in (429, 503) or r.stream_error:
            assert (r.error_code or r.stream_error) in allowed, r
        if r.status == 429 or (r.status == 503 and r.error_code == "engine_dead"):
            assert r.retry_after is not None and int(r.retry_after) >= 1, r


# ---- running it -------------------------------------------------------------------------------

RUN_S = 9.0  # of traffic, before the end
KILL_AT_S = 4.0
AFTER_S = 3.0  # of traffic at least after the middle (which may outlast RUN_S: restarts)
WORKERS = 5  # valid traffic; one more sends the hostile corpus
LENGTHS = (6, 12)  # max_tokens of valid requests


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
