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
from typing import Any

from stride.scheduler.core import EngineCore
from stride.scheduler.outputs import (
    EngineError,
    GenerateRequest,
    QueueFull,
    RequestOutput,
    RequestRejected,
)

log = logging.getLogger(__name__)

_ABORT = "abort"
_ADD = "add"


class EngineDead(RuntimeError):
    """The step loop has stopped; the server answers 503."""


class EngineClient:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.dead: str | None = None  # why the loop died, if it did
        self.on_step: Callable[[EngineCore, float, list[RequestOutput]], None] | None = None
        self._thread = threading.Thread(target=self._loop, name="stride-engine", daemon=True)
        self._thread.start()

    # ---- caller side (asyncio) ----------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def generate(self, req: GenerateRequest, n: int = 1) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Submit `req` (n samples of it) and yield (index, output) until each sample ends.

        Raises QueueFull / RequestRejected / EngineDead before yielding anything if the request
        is not admitted. Closing the iterator early aborts every sample still running.
        """
        if self.dead:
            raise EngineDead(self.dead)
        if len(self.core.scheduler.waiting) + self._inbox.qsize() >= self.core.config.max_waiting:
            raise QueueFull("the waiting queue is full")
        loop = asyncio.get_running_loop()
        out_q: asyncio.Queue = asyncio.Queue()
        ids = [req.request_id if n == 1 else f"{req.request_id}-{i}" for i in range(n)]
        admitted: asyncio.Future = loop.create_future()
        children = [_child(req, rid, i) for i, rid in enumerate(ids)]
        with self._lock:
            for rid in ids:
                self._streams[rid] = (loop, out_q)
        self._inbox.put((_ADD, (children, loop, admitted)))
        try:
            await admitted  # raises what admission raised
        except BaseException as e:
            self._forget(ids)
            if not isinstance(e, (QueueFull, RequestRejected, EngineDead)):
                for rid in ids:  # cancelled while being admitted: the add may still land
                    self.abort(rid)
            raise
        index = {rid: i for i, rid in enumerate(ids)}
        remaining = set(ids)
        try:
            while remaining:
                out: RequestOutput = await out_q.get()
                if out.finished:
                    remaining.discard(out.request_id)
                yield index[out.request_id], out
        finally:
            for rid in remaining:
                self.abort(rid)
            self._forget(ids)

    def abort(self, request_id: str) -> None:
        self._inbox.put((_ABORT, request_id))

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put((_ABORT, None))
        self._thread.join(timeout=10)

    def _forget(self, ids: list[str]) -> None:
        with self._lock:
            for rid in ids:
                self._streams.pop(rid, None)

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
                    self.on_step(self.core, time.perf_counter() - t0, outs)
                self._deliver(outs)
        except Exception as e:  # the loop is broken: answer everyone, then refuse new work
            log.exception("engine loop died")
            self.dead = f"engine loop died: {type(e).__name__}: {e}"
            failed = self.core.fail_all(self.dead)
            self._deliver(failed)
            answered = {o.request_id for o in failed}
            with self._lock:
                streams = [(r, t) for r, t in self._streams.items() if r not in answered]
            for rid, (loop, q) in streams:  # requests admitted but not yet in the core
                err = RequestOutput(
                    rid, finish_reason="error", error=EngineError("engine_dead", self.dead)
                )
                loop.call_soon_threadsafe(q.put_nowait, err)
            while not self._inbox.empty():
                kind, payload = self._inbox.get()
                if kind == _ADD:
                    _, loop, fut = payload
                    loop.call_soon_threadsafe(_settle, fut, EngineDead(self.dead))

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
        children, loop, fut = payload
        added: list[str] = []
        try:
            for child in children:
                self.core.add(child)
                added.append(child.request_id)
        except (QueueFull, RequestRejected) as e:
            for rid in added:
                self.core.abort(rid)
            loop.call_soon_threadsafe(_settle, fut, e)
            return
        loop.call_soon_threadsafe(_settle, fut, None)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        with self._lock:
            targets = [(self._streams.get(o.request_id), o) for o in outs]
        for target, out in targets:
            if target is not None:
                loop, q = target
                loop.call_soon_threadsafe(q.put_nowait, out)


def _settle(fut: asyncio.Future, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


def _child(req: GenerateRequest, request_id: str, index: int) -> GenerateRequest:
    params = req.params
    if params.seed is not None and index:
        params = dataclasses.replace(params, seed=params.seed + index)
    return dataclasses.replace(req, request_id=request_id, params=params)
