"""The engine client: the step loop on its own thread, met by asyncio callers through queues.

Callers submit plain `GenerateRequest`s and read plain `RequestOutput`s; the loop never awaits
HTTP, and HTTP never waits on a step. If the loop dies, every request in flight gets an error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from stride.scheduler.core import EngineCore
from stride.scheduler.outputs import (
    EngineError,
    GenerateRequest,
    QueueFull,
    RequestOutput,
    RequestRejected,
    StepStats,
)

log = logging.getLogger(__name__)

_ABORT = "abort"
_ADD = "add"


class EngineDead(RuntimeError):
    """The step loop has stopped; the server answers 503."""


@dataclass
class ModelInfo:
    """What the HTTP edge needs to know about the loaded model (plain data: crosses processes)."""

    name: str
    tokenizer: Any
    max_model_len: int
    capacity: int  # tokens one sequence can hold: the context length, or less if the KV is small
    vocab_size: int
    max_waiting: int
    device: str  # e.g. "cpu", "cuda:0"; this and the rest: for the ready line
    dtype: str  # e.g. "float32"
    kv_tokens: int  # tokens the whole KV cache holds

    @classmethod
    def of(cls, core: EngineCore) -> ModelInfo:
        engine, cache = core.engine, core.engine.cache
        return cls(
            name=engine.name,
            tokenizer=engine.tokenizer,
            max_model_len=engine.max_model_len,
            capacity=min(engine.max_model_len, cache.num_usable_blocks * cache.block_size),
            vocab_size=engine.hf_config.vocab_size,
            max_waiting=core.config.max_waiting,
            device=str(engine.device),
            dtype=str(engine.dtype).removeprefix("torch."),
            kv_tokens=cache.num_usable_blocks * cache.block_size,
        )


class Submission:
    """The outputs of requests submitted together, as they arrive on the caller's event loop.

    The step loop appends each step's outputs here (one thread-safe call per step and event loop,
    not one per output); `next()` takes everything queued since the consumer last looked, merged
    per request. A consumer that falls behind thus gets fewer, larger outputs instead of a backlog.
    """

    def __init__(self, client: BaseClient, request_ids: list[str]) -> None:
        self._client = client
        self.request_ids = request_ids
        self.unfinished = set(request_ids)
        self._pending: list[RequestOutput] = []
        self._waiter: asyncio.Future | None = None
        self._closed = False

    @property
    def done(self) -> bool:
        return not self.unfinished

    def push(self, out: RequestOutput) -> None:
        """On the event loop: queue one output and wake the consumer."""
        self._pending.append(out)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next(self) -> list[RequestOutput]:
        """Everything that arrived since the last call (waits for at least one output)."""
        while not self._pending:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        outs, self._pending = coalesce(self._pending), []
        for out in outs:
            if out.finished:
                self.unfinished.discard(out.request_id)
        return outs

    def close(self) -> None:
        """Abort whatever still runs and stop receiving outputs (idempotent, synchronous)."""
        if self._closed:
            return
        self._closed = True
        for rid in self.unfinished:
            self._client.abort(rid)
        self._client._forget(self.request_ids)


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
        timings=b.timings or a.timings,
    )


class BaseClient:
    """Submission, streams and delivery, common to the thread and the process step loops."""

    def __init__(self) -> None:
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, Submission]] = {}
        self._lock = threading.Lock()
        self.dead: str | None = None  # why the loop died, if it did
        self.on_step: Callable[[StepStats, float, list[RequestOutput]], None] | None = None

    @property
    def model(self) -> ModelInfo:
        raise NotImplementedError

    async def submit(self, requests: list[GenerateRequest]) -> Submission:
        """Admit `requests` together (all or none) and return their outputs to come.

        Raises QueueFull / RequestRejected / EngineDead if they are not admitted. The caller must
        `close()` the submission, which aborts every request that has not finished.
        """
        if self.dead:
            raise EngineDead(self.dead)
        if self._num_waiting() >= self.model.max_waiting:
            raise QueueFull("the waiting queue is full")
        loop = asyncio.get_running_loop()
        sub = Submission(self, [r.request_id for r in requests])
        admitted: asyncio.Future = loop.create_future()
        with self._lock:
            for rid in sub.request_ids:
                self._streams[rid] = (loop, sub)
        self._add(requests, loop, admitted)
        try:
            await admitted  # raises what admission raised
        except BaseException as e:
            if isinstance(e, (QueueFull, RequestRejected, EngineDead)):
                sub.unfinished.clear()  # nothing was added
            sub.close()  # cancelled while being admitted: the add may still land; abort it
            raise
        return sub

    async def generate(
        self, req: GenerateRequest, n: int = 1
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Submit `req` (n samples of it) and yield (index, output) until each sample ends.

        Raises like `submit` before yielding anything. Closing the iterator early aborts every
        sample still running.
        """
        ids = [req.request_id if n == 1 else f"{req.request_id}-{i}" for i in range(n)]
        sub = await self.submit([child(req, rid, i) for i, rid in enumerate(ids)])
        index = {rid: i for i, rid in enumerate(ids)}
        try:
            while not sub.done:
                for out in await sub.next():
                    yield index[out.request_id], out
        finally:
            sub.close()

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    def _num_waiting(self) -> int:
        raise NotImplementedError

    def _add(
        self, requests: list[GenerateRequest], loop: asyncio.AbstractEventLoop, fut: asyncio.Future
    ) -> None:
        raise NotImplementedError

    def _forget(self, ids: list[str]) -> None:
        with self._lock:
            for rid in ids:
                self._streams.pop(rid, None)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their event loops: one thread-safe call per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Submission, RequestOutput]]] = {}
        with self._lock:
            for out in outs:
                target = self._streams.get(out.request_id)
                if target is not None:
                    by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_dispatch, items)

    def _fail_rest(self, failed: list[RequestOutput]) -> None:
        """The loop died: deliver `failed`, and an error to every other stream still open."""
        answered = {o.request_id for o in failed}
        with self._lock:
            unanswered = [r for r in self._streams if r not in answered]
        error = EngineError("engine_dead", self.dead or "engine loop died")
        for rid in unanswered:  # e.g. requests admitted but not yet in the core
            failed.append(RequestOutput(rid, finish_reason="error", error=error))
        self._deliver(failed)


class EngineClient(BaseClient):
    """The step loop on a thread of this process (tests reach the core through `client.core`)."""

    def __init__(self, core: EngineCore) -> None:
        super().__init__()
        self.core = core
        self._model = ModelInfo.of(core)
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="stride-engine", daemon=True)
        self._thread.start()

    @property
    def model(self) -> ModelInfo:
        return self._model

    def abort(self, request_id: str) -> None:
        self._inbox.put((_ABORT, request_id))

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put((_ABORT, None))
        self._thread.join(timeout=10)

    def _num_waiting(self) -> int:
        return len(self.core.scheduler.waiting) + self._inbox.qsize()

    def _add(self, requests, loop, fut) -> None:
        self._inbox.put((_ADD, (requests, loop, fut)))

    # ---- loop side (engine thread) ------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.core.has_work)
                if not self.core.has_work:
                    continue
                t0 = time.perf_counter()
                outs = self.core.step()
                if self.on_step is not None:
                    self.on_step(self.core.stats(), time.perf_counter() - t0, outs)
                self._deliver(outs)
        except Exception as e:  # the loop is broken: answer everyone, then refuse new work
            log.exception("engine loop died")
            self.dead = f"engine loop died: {type(e).__name__}: {e}"
            self._fail_rest(self.core.fail_all(self.dead))
            while not self._inbox.empty():
                kind, payload = self._inbox.get()
                if kind == _ADD:
                    _, loop, fut = payload
                    loop.call_soon_threadsafe(settle, fut, EngineDead(self.dead))

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == _ABORT:
            if payload is not None:
                out = self.core.abort(payload)
                if out is not None:
                    self._deliver([out])
            return
        requests, loop, fut = payload
        loop.call_soon_threadsafe(settle, fut, admit(self.core, requests))


def admit(core: EngineCore, requests: list[GenerateRequest]) -> Exception | None:
    """Add every request to the core, or none of them: the admission error, if any."""
    added: list[str] = []
    try:
        for req in requests:
            core.add(req)
            added.append(req.request_id)
    except (QueueFull, RequestRejected) as e:
        for rid in added:
            core.abort(rid)
        return e
    return None


def _dispatch(items: list[tuple[Submission, RequestOutput]]) -> None:
    for sub, out in items:
        sub.push(out)


def settle(fut: asyncio.Future, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


def child(req: GenerateRequest, request_id: str, index: int) -> GenerateRequest:
    params = req.params
    if params.seed is not None and index:
        params = dataclasses.replace(params, seed=params.seed + index)
    return dataclasses.replace(req, request_id=request_id, params=params)
