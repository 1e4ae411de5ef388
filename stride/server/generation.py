"""A request's engine side: its sequences submitted together, their outputs merged, and its ends
kept whatever the engine does (the request's deadline, the server's drain deadline).

A request with several prompts (or n samples) becomes one engine request per prompt and sample,
submitted together; their outputs are merged into one stream of (choice index, output).
`start()` returns once every prompt was admitted and produced its first output, so admission
errors (429, 400) still become a status code before any byte of a stream is sent.
Closing the generation aborts whatever is still running.

A request's deadline (its `timeout`, counted from its arrival) is kept here as well as in the
engine: when it passes, the generation ends with `deadline` whatever the engine is doing, so a
hung engine cannot hold a request past it. Likewise the drain deadline of a server that shuts
down (`Running.cut_off`): what still runs then ends with `server_draining`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from stride.metrics.registry import Metrics
from stride.scheduler.client import BaseClient, child
from stride.scheduler.outputs import EngineError, GenerateRequest, RequestOutput
from stride.scheduler.submission import Submission, coalesce
from stride.server.errors import APIError, from_engine_error
from stride.tracing import RequestTrace

DEADLINE = EngineError("deadline_exceeded", "the request's deadline passed")
DRAINED = "the server shut down before the request finished (--shutdown-timeout)"


class Running:
    """The generations running in this API process, so that the drain deadline can end them."""

    def __init__(self) -> None:
        self._generations: set[Generation] = set()
        self.cut = False  # the drain deadline passed: nothing new starts

    def add(self, gen: Generation) -> None:
        if self.cut:
            raise APIError("server_draining", DRAINED)
        self._generations.add(gen)

    def discard(self, gen: Generation) -> None:
        self._generations.discard(gen)

    def cut_off(self) -> int:
        """End every generation now (each answers `server_draining`); how many there were."""
        self.cut = True
        ending = list(self._generations)
        for gen in ending:
            gen.cut_off()
        return len(ending)


class Generation:
    """n samples of each request, merged; choice index = prompt index * n + sample index."""

    def __init__(
        self,
        client: BaseClient,
        requests: list[GenerateRequest],
        n: int,
        running: Running,
        metrics: Metrics | None = None,
        deadline: float | None = None,
        trace: RequestTrace | None = None,
    ) -> None:
        self._client = client
        self._running = running
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
        self._admitting: asyncio.Future | None = None  # the submission, while it is admitted
        self._cut = False
        self._early: list[RequestOutput] = []  # outputs that arrived while start() waited
        self._closed = False

    async def start(self) -> None:
        """Submit everything; return once every prompt produced an output, or raise why not."""
        try:
            self._running.add(self)
            self._sub = await self._admit()
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

    async def _admit(self) -> Submission:
        """The submission once admitted; a passed deadline or the drain deadline refuse it."""
        left = self._left()
        if left is not None:
            if left <= 0:
                raise _late("before it could be admitted")
            for req in self._children:  # the engine's clock: what is left of it
                req.timeout = left
        submit = self._admitting = asyncio.ensure_future(self._client.submit(self._children))
        try:
            await asyncio.wait({submit}, timeout=left)
        finally:
            self._admitting = None
            if not submit.done():  # the deadline passed, or our caller was cancelled
                submit.cancel()
                await asyncio.gather(submit, return_exceptions=True)
        if submit.cancelled():
            raise (
                APIError("server_draining", DRAINED)
                if self._cut
                else _late("while it waited to be admitted")
            )
        return submit.result()

    def _left(self) -> float | None:
        return None if self._deadline is None else self._deadline - time.monotonic()

    async def _next(self) -> list[RequestOutput]:
        try:
            outs = await self._sub.next(self._left())
        except asyncio.TimeoutError:
            self._sub.end(DEADLINE, "deadline")
            outs = await self._sub.next()
        if self._trackers:
            for out in outs:
                self._trackers[self._index[out.request_id] // self._n].observe(out)
        if self._trace is not None:
            for out in outs:
                if out.finished:
                    self._trace.finished(out)
        return outs

    def failure(self, out: RequestOutput) -> APIError:
        """The API error a failed output ends its request with (an engine that died says when
        to retry)."""
        error = from_engine_error(out.error)
        if error.code == "engine_dead":
            error.headers["Retry-After"] = str(self._client.retry_after)
        return error

    def cut_off(self) -> None:
        """The drain deadline passed: end with `server_draining` now, admitted or not."""
        self._cut = True
        if self._admitting is not None:
            self._admitting.cancel()
        elif self._sub is not None:
            self._sub.end(EngineError("server_draining", DRAINED), "abort")

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
        self._running.discard(self)
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
