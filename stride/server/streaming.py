"""Engine output streams as HTTP sees them: several prompts merged, admission first, SSE framing.

A request with several prompts (or n samples) becomes one engine generation per prompt; their
outputs are merged into one stream of (choice index, output). `start()` returns once every prompt
was admitted and produced its first output, so admission errors (429, 400) still become a status
code before any byte of a stream is sent. Closing the stream aborts whatever is still running.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import Any, TypeVar

from starlette.requests import Request

from stride.metrics import Metrics
from stride.scheduler.client import EngineClient
from stride.scheduler.outputs import EngineError, GenerateRequest, RequestOutput

T = TypeVar("T")
_DONE = object()


class Generation:
    """n samples of each request, merged; choice index = prompt index * n + sample index."""

    def __init__(
        self,
        client: EngineClient,
        requests: list[GenerateRequest],
        n: int,
        metrics: Metrics | None = None,
    ) -> None:
        self._client = client
        self._requests = requests
        self._n = n
        self._trackers = (
            [metrics.track(r.decoder, r.user, r.decoder_options) for r in requests]
            if metrics
            else []
        )
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._first: list[asyncio.Future] = []

    async def start(self) -> None:
        """Submit everything; raise the first admission error (after aborting the rest)."""
        loop = asyncio.get_running_loop()
        self._first = [loop.create_future() for _ in self._requests]
        self._tasks = [
            asyncio.create_task(self._pump(i, req)) for i, req in enumerate(self._requests)
        ]
        try:
            await asyncio.gather(*self._first)
        except BaseException:
            self.close()
            raise

    async def _pump(self, i: int, req: GenerateRequest) -> None:
        first = self._first[i]
        try:
            async with aclosing(self._client.generate(req, n=self._n)) as outs:
                async for j, out in outs:
                    if not first.done():
                        first.set_result(None)
                    if self._trackers:
                        self._trackers[i].observe(out)
                    self._queue.put_nowait((i * self._n + j, out))
        except Exception as e:
            if not first.done():
                first.set_exception(e)
            else:  # not expected after admission: still end the choice with an error
                error = EngineError("internal_error", f"{type(e).__name__}: {e}")
                self._queue.put_nowait((i * self._n, RequestOutput(req.request_id, error=error)))
        finally:
            if self._trackers:
                self._trackers[i].close()
            self._queue.put_nowait(_DONE)

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        live = len(self._tasks)
        while live:
            item = await self._queue.get()
            if item is _DONE:
                live -= 1
            else:
                yield item

    def close(self) -> None:
        """Abort what still runs. Synchronous, so it also works inside a cancelled scope."""
        for task in self._tasks:
            task.cancel()
        for fut in self._first:  # mark errors of prompts nobody waited for as seen
            if fut.done() and not fut.cancelled():
                fut.exception()


class ClientGone(Exception):
    """The client closed the connection before the answer was ready."""


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


def sse(payload: Any) -> str:
    """One server-sent event carrying a JSON payload (a pydantic model or a dict)."""
    if hasattr(payload, "model_dump_json"):
        data = payload.model_dump_json(exclude_unset=False)
    else:
        data = json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
