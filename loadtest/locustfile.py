"""Locust users that stream completions from an OpenAI-compatible server (Stride or any other).

Run from the repository root, e.g.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless \\
        --steps 1,2,4,8 --hold 20 --decoders ar:1,speculative:1 --max-tokens 64:256

Each request streams over SSE and is timed chunk by chunk (time to first token, inter-token
latency, time per output token, end to end); those land in Locust's statistics as request types
TTFT / ITL / TPOT / E2E (the E2E entry's "content size" is the output token count) and as raw
records that `--summary-out` turns into exact per-step percentiles for `loadtest.sweep`.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import time
from pathlib import Path
from typing import Any

import gevent
from locust import HttpUser, constant, events, task
from locust.runners import MasterRunner, WorkerRunner

from loadtest.prompts import IntDistribution, PromptSource, parse_decoder_mix
from loadtest.shapes import STEP_MESSAGE, StepShape, current_step, set_step
from loadtest.stats import RequestRecord, summarize
from loadtest.stream import StreamError, time_stream

__all__ = ["StepShape", "StrideUser"]

RECORDS_KEY = "stride_records"
FAILURE_BACKOFF_S = 0.5  # a failing user must not spin: no think time means no natural pause
log = logging.getLogger("stride.loadtest")
_records: list[RequestRecord] = []  # this process's finished requests (workers ship theirs)
_user_numbers = itertools.count()


@events.init_command_line_parser.add_listener
def _add_options(parser) -> None:
    group = parser.add_argument_group("Stride workload")
    group.add_argument(
        "--steps",
        default="1,2,4,8,16",
        env_var="STRIDE_LT_STEPS",
        help="Concurrency per step: '1,2,4,8' or '1:64' (powers of two)",
    )
    group.add_argument(
        "--hold",
        type=float,
        default=20.0,
        env_var="STRIDE_LT_HOLD",
        help="Seconds each concurrency step is held",
    )
    group.add_argument(
        "--decoders",
        default="ar",
        env_var="STRIDE_LT_DECODERS",
        help="Decoder mix over users, e.g. 'ar' or 'ar:3,speculative:1'",
    )
    group.add_argument(
        "--endpoint",
        choices=["chat", "completions"],
        default="chat",
        env_var="STRIDE_LT_ENDPOINT",
        help="/v1/chat/completions or /v1/completions",
    )
    group.add_argument(
        "--model",
        default="",
        env_var="STRIDE_LT_MODEL",
        help="The request's model field (empty: ask /v1/models)",
    )
    group.add_argument(
        "--prompts",
        choices=PromptSource.KINDS,
        default="mixed",
        env_var="STRIDE_LT_PROMPTS",
        help="Built-in prompts, synthetic or both",
    )
    group.add_argument(
        "--prompt-words",
        default="8:256",
        env_var="STRIDE_LT_PROMPT_WORDS",
        help="Synthetic prompt length in words: '64', '8:256' or '16,128,512'",
    )
    group.add_argument(
        "--max-tokens",
        default="128",
        env_var="STRIDE_LT_MAX_TOKENS",
        help="max_tokens per request: '128', '16:256' or '32,128,512'",
    )
    group.add_argument(
        "--ignore-eos",
        action="store_true",
        env_var="STRIDE_LT_IGNORE_EOS",
        help="Generate exactly max_tokens (the server extension ignore_eos)",
    )
    group.add_argument("--temperature", type=float, default=0.0, env_var="STRIDE_LT_TEMPERATURE")
    group.add_argument(
        "--user-ids",
        type=int,
        default=0,
        env_var="STRIDE_LT_USER_IDS",
        help="Distinct values of the request's user field (0: one per Locust user)",
    )
    group.add_argument(
        "--seed",
        type=int,
        default=0,
        env_var="STRIDE_LT_SEED",
        help="Seed of each user's prompt and length choices",
    )
    group.add_argument(
        "--api-key",
        default="",
        env_var="STRIDE_LT_API_KEY",
        help="Sent as 'Authorization: Bearer KEY' (servers started with --api-key)",
    )
    group.add_argument(
        "--summary-out",
        default="",
        env_var="STRIDE_LT_SUMMARY_OUT",
        help="Write per-step results (JSON) here when the run ends",
    )


@events.init.add_listener
def _wire_processes(environment, **_: Any) -> None:
    """Workers follow the master's steps and ship their records in every stats report."""
    runner = environment.runner
    if isinstance(runner, WorkerRunner):
        runner.register_message(STEP_MESSAGE, lambda msg, **__: set_step(msg.data))

        @events.report_to_master.add_listener
        def _ship(data: dict, **__: Any) -> None:
            data[RECORDS_KEY] = [r.to_dict() for r in _records]
            _records.clear()

    elif isinstance(runner, MasterRunner):

        @events.worker_report.add_listener
        def _collect(data: dict, **__: Any) -> None:
            _records.extend(RequestRecord(**r) for r in data.get(RECORDS_KEY, []))


@events.quitting.add_listener
def _write_summary(environment, **_: Any) -> None:
    options = environment.parsed_options
    shape = environment.shape_class
    if isinstance(environment.runner, WorkerRunner) or not isinstance(shape, StepShape):
        return
    shape.close()
    summary = summarize(_records, shape.windows)
    for decoder, steps in summary.items():
        for step in steps:
            log.info(
                "%s c=%d: %d requests, %d failures, %.1f tok/s, TTFT p50 %s ms, ITL p50 %s ms",
                decoder,
                step["concurrency"],
                step["requests"],
                step["failures"],
                step["output_tokens_per_s"],
                _fmt(step["ttft_ms"]["p50"]),
                _fmt(step["itl_ms"]["p50"]),
            )
    if options and options.summary_out:
        result = {
            "host": environment.host,
            "steps": [w.__dict__ for w in shape.windows],
            "decoders": summary,
            "requests": [r.to_dict() for r in _records],  # raw, for the timeline picture
        }
        Path(options.summary_out).write_text(json.dumps(result, indent=1))


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


class StrideUser(HttpUser):
    """Sends one streamed request after another (no think time): concurrency = users.

    Subclass with a fixed `decoder` (and a Locust `weight`) to mix decoders by user class;
    otherwise each user takes its decoder from `--decoders`.
    """

    wait_time = constant(0)
    decoder: str | None = None

    def on_start(self) -> None:
        options = self.environment.parsed_options
        number = next(_user_numbers)
        worker = getattr(self.environment.runner, "worker_index", None)
        self.rng = random.Random(f"{options.seed}/{worker}/{number}")
        self.decoder_name = self.decoder or _pick(parse_decoder_mix(options.decoders), number)
        ident = number % options.user_ids if options.user_ids > 0 else number
        self.user_id = f"loadtest-{ident}" if worker is None else f"loadtest-{worker}-{ident}"
        self.prompts = PromptSource(options.prompts, options.prompt_words)
        self.max_tokens = IntDistribution.parse(options.max_tokens)
        if options.api_key:
            self.client.headers["Authorization"] = f"Bearer {options.api_key}"
        self.model = options.model or self._served_model()

    def _served_model(self) -> str:
        response = self.client.get("/v1/models", name="/v1/models")
        models = response.json().get("data") if response.ok else None
        return models[0]["id"] if models else "default"

    def _body(self) -> tuple[str, dict[str, Any]]:
        options = self.environment.parsed_options
        prompt = self.prompts.sample(self.rng)
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.max_tokens.sample(self.rng),
            "temperature": options.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": self.user_id,
            "decoder": self.decoder_name,
        }
        if options.ignore_eos:
            body["ignore_eos"] = True
        if options.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
            return "/v1/chat/completions", body
        body["prompt"] = prompt
        return "/v1/completions", body

    @task
    def stream_completion(self) -> None:
        path, body = self._body()
        step = current_step()
        sent_wall, sent = time.time(), time.perf_counter()
        record = RequestRecord(
            decoder=self.decoder_name, step=step, ok=False, sent_at=sent_wall, e2e=0.0
        )
        with self.client.post(
            path, json=body, stream=True, catch_response=True, name=f"{path} [{self.decoder_name}]"
        ) as response:
            try:
                if response.status_code != 200:
                    raise StreamError(f"HTTP {response.status_code}: {response.text[:200]}")
                timing = time_stream(response.iter_lines(chunk_size=None), sent)
            except Exception as error:  # the request failed: count it, keep the user running
                record.e2e = time.perf_counter() - sent
                record.error = f"{type(error).__name__}: {error}"[:300]
                response.failure(record.error)
                _records.append(record)
                gevent.sleep(FAILURE_BACKOFF_S)
                return
            response.success()
        record.ok = True
        record.e2e, record.ttft, record.tpot = timing.e2e, timing.ttft, timing.tpot
        record.chunk_gaps, record.output_tokens = timing.chunk_gaps, timing.output_tokens
        record.server_timings = timing.server_timings
        _records.append(record)
        self._fire(record)

    def _fire(self, record: RequestRecord) -> None:
        """Report the streamed timings as Locust metrics (milliseconds), one name per decoder."""
        fire, name = self.environment.events.request.fire, self.decoder_name
        common = dict(name=name, exception=None, context={"step": record.step})
        if record.ttft is not None:
            fire(request_type="TTFT", response_time=record.ttft * 1000, response_length=0, **common)
        for gap in record.chunk_gaps:
            fire(request_type="ITL", response_time=gap * 1000, response_length=0, **common)
        if record.tpot is not None:
            fire(request_type="TPOT", response_time=record.tpot * 1000, response_length=0, **common)
        fire(
            request_type="E2E",
            response_time=record.e2e * 1000,
            response_length=record.output_tokens,
            **common,
        )


def _pick(wheel: list[str], number: int) -> str:
    return wheel[number % len(wheel)]
