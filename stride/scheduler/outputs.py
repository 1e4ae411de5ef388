"""Plain records that cross the boundary between the HTTP edge and the step loop.

Only data goes in and out (no engine objects), so the loop can run in a process of its own
(`process`); how the records cross that pipe is theirs too, kept here beside them: a
RequestOutput pickles as its field values, an admission error travels as a plain tuple.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any

from stride.decoders.drawn_logprobs import Logprobs
from stride.decoders.sampling import TokenLogprob
from stride.engine.roofline import StepLoad
from stride.engine.sequence import SamplingParams
from stride.scheduler.timeline import Timeline


@dataclass
class GenerateRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    decoder: str = "ar"
    decoder_options: dict[str, Any] = field(default_factory=dict)
    priority: int = 0  # lower runs first; ties in arrival order
    timeout: float | None = None  # seconds from arrival until the request fails with 'deadline'
    user: str | None = None
    trace: bool = False  # keep its timeline for an OpenTelemetry trace (`Timeline`)


@dataclass
class EngineError:
    """A request's terminal error, in OpenAI's vocabulary (the server maps code to a status)."""

    code: str  # e.g. "deadline_exceeded", "engine_dead", "context_length_exceeded"
    message: str


@dataclass
class RequestOutput:
    """New tokens of one request since its last output; the last one carries the end."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: Logprobs = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort", "deadline" or None
    stop_reason: str | int | None = None  # the stop string or token that ended it
    error: EngineError | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # (final output) prompt tokens whose K/V came from the prefix cache
    decoder_stats: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    # (first output) SamplingParams.prompt_logprobs: one per prompt token, the first one None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    timeline: Timeline | None = None  # (final output of a traced request) its path, for spans

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


def _as_fields(record: RequestOutput | TokenLogprob) -> tuple[type, tuple]:
    """A record as its field values in order (every field is an __init__ argument), not the
    default pickled __dict__: about half the time to pickle and unpickle a step's outputs and
    their logprobs, one per row (docs/BENCHMARKS.md, "Design choices")."""
    return type(record), tuple(record.__dict__.values())


ForkingPickler.register(RequestOutput, _as_fields)  # what Connection.send pickles with
ForkingPickler.register(TokenLogprob, _as_fields)


@dataclass
class StepStats:
    """The engine's numbers after one step: what the metrics read, in either client mode."""

    num_running: int
    num_waiting: int
    kv_usage: float
    batch_size: int
    num_tokens: int
    num_preemptions: int  # since the start
    prefix_cache_queries: int = 0  # since the start: prompt tokens looked up at first admission
    prefix_cache_hits: int = 0  # since the start: of those, tokens found in the prefix cache
    load: StepLoad = field(default_factory=StepLoad)  # what the step asked of the device


class QueueFull(RuntimeError):
    """The waiting queue is at capacity; the server answers 429 with `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestRejected(ValueError):
    """The request cannot be admitted as asked (too long, bad decoder options); 400."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param


def rejection_to_plain(error: Exception | None) -> tuple[str, str, str, str | None] | None:
    """An admission error as plain data (RequestRejected's fields do not survive pickling)."""
    if error is None:
        return None
    if isinstance(error, QueueFull):
        return ("queue_full", str(error), "queue_full", None)
    assert isinstance(error, RequestRejected)
    return ("rejected", str(error), error.code, error.param)


def rejection_from_plain(error: tuple[str, str, str, str | None] | None) -> Exception | None:
    """The admission error that `rejection_to_plain` sent (None: admitted)."""
    if error is None:
        return None
    kind, message, code, param = error
    return QueueFull(message) if kind == "queue_full" else RequestRejected(message, code, param)
