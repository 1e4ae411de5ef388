"""Engine output streams as HTTP sees them: several prompts merged, admission first, SSE framing.

A request with several prompts (or n samples) becomes one engine request per prompt and sample,
submitted together; their outputs are merged into one stream of (choice index, output).
`start()` returns once every prompt was admitted and produced its first output, so admission
errors (429, 400) still become a status code before any byte of a stream is sent.
Closing the stream aborts whatever is still running.

A request's deadline (its `timeout`, counted from its arrival) is kept here as well as in the
engine: when it passes, the generation ends with `deadline` whatever the engine is doing, so a
hung engine cannot hold a request past it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.requests import Request

from stride.metrics.registry import Metrics
from stride.scheduler.client import BaseClient, Submission, child, coalesce
from stride.scheduler.outputs import GenerateRequest, RequestOutput
from stride.server.errors import APIError
from stride.tracing import RequestTrace

T = TypeVar("T")


class Generation:
    """n samples of each request, merged; choice index = prompt index * n + sample index."""

    def __init__(
        self,
        client: BaseClient,
        requests: list[GenerateRequest],
        n: int,
        metrics: Metrics | None = None,
        deadline: float | None = None,
        trace: RequestTrace | None = None,
    ) -> None:
        self._client = client
        self._trace = trace
        self._deadline = deadline  # time.monotonic() when the request's timeout runs out
        self._children = [
            child(req, req.request_id if n == 1 else f"{req.request_id}-{j}", j)
            for req in requests
            for j in range(n)
        ]
        self._index = {c.request_id: i for i, c in enumerate(self._children)}
        self._n = n
        trace_id = None if trace is None else trace.trace_id
        self._trackers = (
            [metrics.track(r.decoder, r.user, r.decoder_options, trace_id) for r in requests]
            if metrics
            else []
        )
        self._sub: Submission | None = None
        self._early: list[RequestOutput] = []  # outputs that arrived while start() waited
        self._closed = False

    async def start(self) -> None:
        """Submit everything; return once every prompt produced an output, or raise why not."""
        try:
            left = self._left()
            if left is None:
                self._sub = await self._client.submit(self._children)
            else:
                if left <= 0:
                    raise _late("before it could be admitted")
                for req in self._children:  # the engine's clock: what is left of it
                    req.timeout = left
                try:
                    self._sub = await asyncio.wait_for(self._client.submit(self._children), left)
                except asyncio.TimeoutError:
                    raise _late("while it waited to be admitted") from None
            waiting = set(range(len(self._children) // self._n))
            while waiting and not self._sub.done:
                outs = await self._next()
                self._early += outs
                waiting -= {self._index[o.request_id] // self._n for o in outs}
        except BaseException as e:
            if self._trace is not None:
                self._trace.refused(e)
            self.close()
            raise

    def _left(self) -> float | None:
        return None if self._deadline is None else self._deadline - time.monotonic()

    async def _next(self) -> list[RequestOutput]:
        try:
            outs = await self._sub.next(self._left())
        except asyncio.TimeoutError:
            outs = self._sub.expire()
        if self._trackers:
            for out in outs:
                self._trackers[self._index[out.request_id] // self._n].observe(out)
        if self._trace is not None:
            for out in outs:
                if out.finished:
                    self._trace.finished(out)
        return outs

    async def batches(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        """(choice index, output) of everything that arrived since the consumer last looked.

        A consumer that falls behind (a slow client, a busy event loop) gets each choice's
        queued tokens merged into one output.
        """
        if self._early:
            outs, self._early = coalesce(self._early), []
            yield [(self._index[o.request_id], o) for o in outs]
        while not self._sub.done:
            outs = await self._next()
            yield [(self._index[o.request_id], o) for o in outs]

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        async for batch in self.batches():
            for item in batch:
                yield item

    def close(self) -> None:
        """Abort what still runs. Synchronous, so it also works inside a cancelled scope."""
        if self._closed:
            return
        self._closed = True
        if self._sub is not None:
            self._sub.close()
        admitted = self._sub is not None  # (then every child is the engine's to finish)
        for i, tracker in enumerate(self._trackers):
            samples = self._children[i * self._n : (i + 1) * self._n] if admitted else []
            tracker.close([c.request_id for c in samples])
        if self._trace is not None:
            self._trace.end()


def _late(when: str) -> APIError:
    return APIError("deadline_exceeded", f"the request's deadline passed {when}")


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
