"""A response's last stage: a generation's outputs, gathered by its view, written as one JSON
response or as server-sent events. Every admitted request leaves through here with exactly one
terminal answer:

- a plain response: the whole response, or the API error its first failed output carries (504
  for a passed deadline, 503 `server_draining` at the drain deadline, ...);
- a stream: its opening chunks, an event per batch of outputs, the usage chunk (with
  `include_usage`), then `data: [DONE]`; a failure after the 200 (a deadline ends a stream with
  `finish_reason: "deadline"` instead) is one error event, then `data: [DONE]`.

The stream's framing beyond its chunks (`data: [DONE]`, the error event, the headers) lives here
beside the one writer of it; a chunk's own `data: <json>` event is the view's (`sse_event`).
A client that goes away mid-request is this stage's concern too: its work is cancelled, and with
it its engine requests (`unless_disconnected`, then `ClientGone`, answered 499 by the app).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi.responses import StreamingResponse
from starlette.requests import Request
from starlette.responses import Response

from stride.scheduler.outputs import RequestOutput
from stride.server import response_schemas as rs
from stride.server.errors import APIError
from stride.server.generation import Generation
from stride.server.views import View, sse_event

log = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MEDIA_TYPE = "text/event-stream"

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed the connection before the answer was ready."""


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
    return StreamingResponse(_events(view, gen), media_type=MEDIA_TYPE, headers=HEADERS)


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
                yield error_event(failure) + DONE
                return
        if view.include_usage:
            yield view.chunk(view.final_chunk())
        yield DONE
    except Exception as e:  # a fault of Stride's own: this stream's last word all the same
        log.exception("a stream failed")
        yield error_event(APIError("internal_error", f"internal error: {type(e).__name__}"))
        yield DONE
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


def error_event(error: APIError) -> str:
    """The event that ends a stream which failed after its 200 (then comes `DONE`)."""
    return sse_event(json.dumps(error.body(), separators=(",", ":")))


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, or cancel it (which aborts its engine requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def client_gone(_: Request, __: Exception) -> Response:
    """The app's handler of ClientGone: nobody is listening (499: nginx's code for it)."""
    return Response(status_code=499)
