"""Time one streamed OpenAI completion on the client, chunk by chunk.

Locust's own timing of a streamed response stops when the headers arrive, so the user reads the
Server-Sent Events itself and measures what a person waiting for text would see.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field


class StreamError(RuntimeError):
    """The server answered 200 but the stream carried an error or ended early."""


@dataclass
class StreamTiming:
    """What one streamed request cost, in seconds from the moment it was sent."""

    ttft: float | None  # time to the first chunk with text (None: no text came back)
    chunk_gaps: list[float] = field(default_factory=list)  # inter-token latency, chunk to chunk
    e2e: float = 0.0  # until the stream ended ([DONE])
    output_tokens: int = 0  # from the final usage chunk, else the number of text chunks
    finish_reason: str | None = None
    # The server's own account (Stride's usage.timings: queue, ttft, e2e in seconds from its
    # arrival), when the final usage chunk carries one.
    server_timings: dict[str, float] | None = None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; fair to decoders that send several per chunk."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def sse_data(lines: Iterable[bytes | str]) -> Iterator[str]:
    """The `data:` payloads of an SSE stream, one per event (multi-line data joined by \\n)."""
    buffer: list[str] = []
    for raw in lines:
        line = raw.decode() if isinstance(raw, bytes) else raw
        line = line.rstrip("\r")
        if not line:
            if buffer:
                yield "\n".join(buffer)
                buffer = []
        elif line.startswith("data:"):
            value = line[5:]
            buffer.append(value[1:] if value.startswith(" ") else value)
    if buffer:
        yield "\n".join(buffer)


def _chunk_text(choice: dict) -> str:
    if "text" in choice:  # /v1/completions
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""  # /v1/chat/completions


def time_stream(
    lines: Iterable[bytes | str], sent_at: float, clock: Callable[[], float] = time.perf_counter
) -> StreamTiming:
    """Read the stream to its end and time it; raise StreamError on an error event or no [DONE]."""
    timing = StreamTiming(ttft=None)
    last_text_at: float | None = None
    text_chunks = 0
    usage_tokens: int | None = None
    for data in sse_data(lines):
        now = clock()
        if data == "[DONE]":
            timing.e2e = now - sent_at
            timing.output_tokens = usage_tokens if usage_tokens is not None else text_chunks
            return timing
        event = json.loads(data)
        if "error" in event:
            error = event["error"]
            message = error.get("message", str(error)) if isinstance(error, dict) else str(error)
            raise StreamError(message)
        if event.get("usage"):
            usage_tokens = event["usage"].get("completion_tokens")
            if isinstance(event["usage"].get("timings"), dict):
                timing.server_timings = event["usage"]["timings"]
        for choice in event.get("choices") or []:
            if choice.get("finish_reason"):
                timing.finish_reason = choice["finish_reason"]
            if not _chunk_text(choice):
                continue
            text_chunks += 1
            if last_text_at is None:
                timing.ttft = now - sent_at
            else:
                timing.chunk_gaps.append(now - last_text_at)
            last_text_at = now
    raise StreamError("stream ended without [DONE]")
