"""A response's last stage: a generation's outputs, gathered by its view, written as one JSON
response or as server-sent events. Every admitted request leaves through here with exactly one
terminal answer:

- a plain response: the whole response, or the API error its first failed output carries (504
  for a passed deadline, 503 `server_draining` at the drain deadline, ...);
- a stream: its opening chunks, an event per batch of outputs, the usage chunk (with
  `include_usage`), then `data: [DONE]`; a failure after the 200 (a deadline ends a stream with
  `finish_reason: "deadline"` instead) is one error event, then `data: [DONE]`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse
from starlette.requests import Request

from stride.scheduler.outputs import RequestOutput
from stride.server import response_schemas as rs
from stride.server import sse
from stride.server.disconnect import unless_disconnected
from stride.server.errors import APIError
from stride.server.generation import Generation
from stride.server.views import View

log = logging.getLogger(__name__)


async def collect(request: Request, view: View, gen: Generation) -> rs.Response:
    """The whole response (ClientGone if the client leaves first)."""
    return await unless_disconnected(request, _gathered(view, gen))


async def _gathered(view: View, gen: Generation) -> rs.Response:
    try:
        async for index, out in gen:
            if out.error is not None:
                raise gen.failure(out)
            view.add(index, out)
    finally:
        gen.close()
    return view.response()


def stream(view: View, gen: Generation) -> StreamingResponse:
    return StreamingResponse(_events(view, gen), media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)


async def _events(view: View, gen: Generation) -> AsyncIterator[str]:
    """The stream's events: one write per batch of outputs, one event per choice."""
    try:
        for chunk in view.opening():
            yield view.chunk(chunk)
        async for batch in gen.batches():
            events, failure = _batch_events(view, gen, batch)
            if events:
                yield events
            if failure is not None:
                yield sse.error_event(failure) + sse.DONE
                return
        if view.include_usage:
            yield view.chunk(view.final_chunk())
        yield sse.DONE
    except Exception as e:  # a fault of Stride's own: this stream's last word all the same
        log.exception("a stream failed")
        yield sse.error_event(APIError("internal_error", f"internal error: {type(e).__name__}"))
        yield sse.DONE
    finally:
        gen.close()


def _batch_events(
    view: View, gen: Generation, batch: list[tuple[int, RequestOutput]]
) -> tuple[str, APIError | None]:
    """The events of a batch of outputs, up to the first that failed (and its error)."""
    events = []
    for index, out in batch:
        if out.error is not None and out.finish_reason != "deadline":
            return "".join(events), gen.failure(out)
        event = view.event(index, view.add(index, out))
        if event is not None:
            events.append(event)
    return "".join(events), None
