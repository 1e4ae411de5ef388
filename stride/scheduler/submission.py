"""The outputs of requests submitted together, as they arrive on the caller's event loop.

The step loop appends each step's outputs here (one thread-safe call per step and event loop,
not one per output); `next()` takes everything queued since the consumer last looked, merged
per request (`coalesce`). A consumer that falls behind thus gets fewer, larger outputs instead
of a backlog. `end()` answers what is still running here and now, whatever the engine does:
a passed deadline, or the drain deadline of a server that shuts down.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from stride.scheduler.outputs import EngineError, RequestOutput


class Requests(Protocol):
    """What a submission asks of its client (`client.BaseClient`) when it ends early."""

    def abort(self, request_id: str) -> None: ...

    def answered(self, request_ids: list[str]) -> None: ...

    def forget(self, request_ids: list[str]) -> None: ...


class Submission:
    def __init__(self, client: Requests, request_ids: list[str]) -> None:
        self._client = client
        self.request_ids = request_ids
        self.unfinished = set(request_ids)
        self._pending: list[RequestOutput] = []
        self._ended: set[str] = set()  # answered by `end`: the engine's later outputs are moot
        self._waiter: asyncio.Future | None = None
        self._closed = False

    @property
    def done(self) -> bool:
        return not self.unfinished

    def push(self, out: RequestOutput) -> None:
        """On the event loop: queue one output and wake the consumer."""
        if out.request_id in self._ended:
            return
        self._pending.append(out)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next(self, timeout: float | None = None) -> list[RequestOutput]:
        """Everything that arrived since the last call (waits for at least one output).

        Raises asyncio.TimeoutError if nothing arrived within `timeout` seconds.
        """
        while not self._pending:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                if timeout is None:
                    await self._waiter
                else:
                    await asyncio.wait_for(self._waiter, max(timeout, 0.0))
            finally:
                self._waiter = None
        outs, self._pending = coalesce(self._pending), []
        for out in outs:
            if out.finished:
                self.unfinished.discard(out.request_id)
        return outs

    def end(self, error: EngineError, finish_reason: str) -> None:
        """End every request not yet finished with `error`, now: their last outputs are queued
        for `next()` (after what arrived before), and the engine is told to abort them."""
        over = self._ended | {o.request_id for o in self._pending if o.finished}
        ending = [r for r in self.request_ids if r in self.unfinished and r not in over]
        for rid in ending:
            self.push(RequestOutput(rid, finish_reason=finish_reason, error=error))
            self._ended.add(rid)
            self._client.abort(rid)
        self._client.answered(ending)

    def close(self) -> None:
        """Abort whatever still runs (nobody waits for it now) and stop receiving outputs
        (idempotent, synchronous)."""
        if self._closed:
            return
        self._closed = True
        running = [r for r in self.request_ids if r in self.unfinished and r not in self._ended]
        for rid in running:
            self._client.abort(rid)
        self._client.answered(running)
        self._client.forget(self.request_ids)


def coalesce(outs: list[RequestOutput]) -> list[RequestOutput]:
    """Merge consecutive outputs of each request into one (text, tokens, logprobs; end carried).

    Outputs with an error stay apart, so the tokens before an error still reach the client.
    """
    if len(outs) < 2:
        return outs
    result: list[RequestOutput] = []
    last: dict[str, int] = {}  # request id -> position of its latest output in `result`
    for out in outs:
        i = last.get(out.request_id)
        if i is None or result[i].finished or out.error is not None:
            last[out.request_id] = len(result)
            result.append(out)
        else:
            result[i] = _joined(result[i], out)
    return result


def _joined(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    return RequestOutput(
        b.request_id,
        token_ids=a.token_ids + b.token_ids,
        text=a.text + b.text,
        logprobs=a.logprobs + b.logprobs,
        finish_reason=b.finish_reason,
        stop_reason=b.stop_reason,
        num_prompt_tokens=b.num_prompt_tokens or a.num_prompt_tokens,
        num_output_tokens=b.num_output_tokens or a.num_output_tokens,
        num_cached_tokens=b.num_cached_tokens or a.num_cached_tokens,
        decoder_stats=b.decoder_stats or a.decoder_stats,
        prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
        timings=b.timings or a.timings,
        timeline=b.timeline or a.timeline,
    )
