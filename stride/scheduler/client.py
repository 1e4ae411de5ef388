"""The engine client: the step loop on its own thread, met by asyncio callers through queues.

Callers submit plain `GenerateRequest`s (`admission` decides whether they may wait in the queue)
and read plain `RequestOutput`s (`submission`); the loop never awaits HTTP, and HTTP never waits
on a step. If the loop dies, every request in flight gets `engine_dead` at once, and the engine
is restarted (see `supervision`); a watchdog thread tells when it has not stepped for a while
with requests in flight (`stuck`). `process` runs the same loop in a process of its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import math
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from functools import cached_property
from typing import Any

from stride.scheduler.admission import Admission, admit, check_group
from stride.scheduler.core import EngineCore
from stride.scheduler.model_info import ModelInfo
from stride.scheduler.outputs import (
    EngineError,
    GenerateRequest,
    QueueFull,
    RequestOutput,
    RequestRejected,
    StepStats,
)
from stride.scheduler.submission import Submission
from stride.scheduler.supervision import RestartBudget, SupervisionConfig

log = logging.getLogger(__name__)

_ABORT = "abort"
_ADD = "add"


class EngineDead(RuntimeError):
    """The step loop has stopped; the server answers 503 with `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class BaseClient:
    """Submission, streams and delivery, common to the thread and the process step loops.

    Also what supervision needs on this side: `dead` (why the engine is down now: it died, or
    is being restarted) and `back_at` (when a restarted one should serve, if known), the hooks
    `on_restart` (a restarted engine serves again) and `on_give_up` (the restart budget is
    spent: the server should exit), and the watchdog.
    """

    def __init__(self, supervision: SupervisionConfig | None = None) -> None:
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, Submission]] = {}
        self._live: set[str] = set()  # submitted, and not known to have ended in the engine
        self._answered: set[str] = set()  # live, but answered here already (deadline, drain)
        self._queued: set[str] = set()  # submitted, and no output yet: waiting in the queue
        self._lock = threading.Lock()
        self.dead: str | None = None  # why the engine is down, while it is
        self.back_at: float | None = None  # (time.monotonic) when a restarted engine may serve
        self.on_step: Callable[[StepStats, float, list[RequestOutput]], None] | None = None
        self.on_restart: Callable[[], None] | None = None
        self.on_give_up: Callable[[str], None] | None = None
        self.supervision = supervision or SupervisionConfig()
        self.last_progress = time.monotonic()  # the engine's last step (or message)
        self._closing = threading.Event()
        threading.Thread(target=self._watchdog, name="stride-watchdog", daemon=True).start()

    @property
    def model(self) -> ModelInfo:
        raise NotImplementedError

    @cached_property
    def admission(self) -> Admission:
        return Admission(self.model.max_waiting)

    @property
    def stuck(self) -> str | None:
        """Why the engine looks hung (work in the engine, no step for `watchdog_timeout` s).

        Requests answered already (a passed deadline) or left by their clients are in flight
        no more, but a hung engine has not let go of them: they count apart."""
        with self._lock:
            live, answered = len(self._live), len(self._live & self._answered)
        quiet = time.monotonic() - self.last_progress
        if not live or self.dead or quiet < self.supervision.watchdog_timeout:
            return None
        held = f" (and {answered} answered or left already, not let go)" if answered else ""
        return f"no engine step for {quiet:.0f} s with {live - answered} requests in flight{held}"

    @property
    def retry_after(self) -> int:
        """Seconds until the dead engine's successor should serve (at least 1)."""
        back_at = self.back_at
        wait = 1.0 if back_at is None else back_at - time.monotonic()
        return max(1, math.ceil(wait))

    def _watchdog(self) -> None:
        """Log when the engine gets stuck and when it moves again (`/health` reads `stuck`)."""
        was = None
        while not self._closing.wait(1.0):
            now = self.stuck
            if now and not was:
                log.error("watchdog: the engine looks stuck: %s", now)
            elif was and not now:
                log.warning("watchdog: the engine moves again")
            was = now

    async def submit(self, requests: list[GenerateRequest]) -> Submission:
        """Admit `requests` together (all or none) and return their outputs to come.

        Raises QueueFull / RequestRejected / EngineDead if they are not admitted. The caller must
        `close()` the submission, which aborts every request that has not finished.
        """
        if self.dead:
            raise EngineDead(self.dead, self.retry_after)
        check_group(requests, self.model.max_waiting)
        loop = asyncio.get_running_loop()
        sub = Submission(self, [r.request_id for r in requests])
        admitted: asyncio.Future = loop.create_future()
        with self._lock:
            self.admission.check(len(requests), self._num_waiting())
            if not self._live:  # the watchdog's clock starts with the work
                self.last_progress = time.monotonic()
            for rid in sub.request_ids:
                self._streams[rid] = (loop, sub)
                self._live.add(rid)
                self._queued.add(rid)
        self._add(requests, loop, admitted)
        try:
            await admitted  # raises what admission raised
        except BaseException as e:
            if isinstance(e, (QueueFull, RequestRejected, EngineDead)):
                sub.unfinished.clear()  # nothing was added
                with self._lock:
                    self._live.difference_update(sub.request_ids)
                    self._queued.difference_update(sub.request_ids)
                    if isinstance(e, QueueFull):  # (the engine's count was ahead of ours)
                        e = self.admission.refuse(len(requests), self._num_waiting())
            sub.close()  # cancelled while being admitted: the add may still land; abort it
            if isinstance(e, QueueFull):
                raise e from None
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

    def forget(self, ids: list[str]) -> None:
        """Their submission is closed: outputs still to come for `ids` go nowhere."""
        with self._lock:
            for rid in ids:
                self._streams.pop(rid, None)

    def answered(self, ids: list[str]) -> None:
        """Nobody waits for `ids` any more, whatever the engine does with them: answered without
        it (a deadline, the drain deadline), or left by their client."""
        with self._lock:
            self._answered.update(r for r in ids if r in self._live)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their event loops: one thread-safe call per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Submission, RequestOutput]]] = {}
        with self._lock:
            left = 0  # sequences that left the waiting queue: their first output
            for out in outs:
                rid = out.request_id
                if rid in self._queued:
                    self._queued.discard(rid)
                    left += 1
                if out.finished:
                    self._live.discard(rid)
                    self._answered.discard(rid)
                target = self._streams.get(out.request_id)
                if target is not None:
                    by_loop.setdefault(target[0], []).append((target[1], out))
            if left:
                self.admission.departed(left)
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_dispatch, items)

    def _fail_rest(self, failed: list[RequestOutput]) -> None:
        """The engine died: deliver `failed`, and an error to every other stream still open."""
        answered = {o.request_id for o in failed}
        with self._lock:
            unanswered = [r for r in self._streams if r not in answered]
            self._live.clear()
            self._answered.clear()
            self._queued.clear()
        error = EngineError("engine_dead", self.dead or "engine loop died")
        for rid in unanswered:  # e.g. requests admitted but not yet in the core
            failed.append(RequestOutput(rid, finish_reason="error", error=error))
        self._deliver(failed)

    def _revived(self) -> None:
        """A restarted engine serves: take requests again."""
        with self._lock:
            self.dead = self.back_at = None
            self.last_progress = time.monotonic()
        log.warning("the engine serves again")
        if self.on_restart is not None:
            self.on_restart()

    def _give_up(self, budget: RestartBudget) -> None:
        with self._lock:
            self.dead = f"{self.dead}; not restarted again: {budget.describe()}"
        log.error("giving up on the engine: %s", self.dead)
        if self.on_give_up is not None:
            self.on_give_up(self.dead)


class EngineClient(BaseClient):
    """The step loop on a thread of this process (tests reach the core through `client.core`).

    `rebuild` makes a fresh core to restart with from the one whose loop died (whose weights
    it may reuse: `CoreConfig.build`); without it the engine stays dead.
    """

    def __init__(
        self,
        core: EngineCore,
        rebuild: Callable[[EngineCore], EngineCore] | None = None,
        supervision: SupervisionConfig | None = None,
    ) -> None:
        super().__init__(supervision)
        self.core = core
        self._rebuild = rebuild
        self._budget = RestartBudget(self.supervision)
        self._load_s = 0.0  # how long the last restart took to build the core
        self._model = ModelInfo.of(core)
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="stride-engine", daemon=True)
        self._thread.start()

    @property
    def model(self) -> ModelInfo:
        return self._model

    def abort(self, request_id: str) -> None:
        self._inbox.put((_ABORT, request_id))

    def shutdown(self) -> None:
        self._closing.set()
        self._inbox.put((_ABORT, None))
        self._thread.join(timeout=10)

    def _num_waiting(self) -> int:
        return len(self.core.scheduler.waiting) + self._inbox.qsize()

    def _add(self, requests, loop, fut) -> None:
        self._inbox.put((_ADD, (requests, loop, fut)))

    # ---- loop side (engine thread) ------------------------------------------------------------

    def _run(self) -> None:
        """The loop, and after each death a restart, until shutdown or the budget is spent."""
        while True:
            try:
                self._loop()
                return  # shut down
            except BaseException as e:  # the loop is broken: answer everyone, refuse new work
                log.exception("engine loop died")
                self._died(f"engine loop died: {type(e).__name__}: {e}")
            if not self._restart():
                return

    def _loop(self) -> None:
        while not self._closing.is_set():
            self._drain(block=not self.core.has_work)
            self.last_progress = time.monotonic()
            if not self.core.has_work:
                continue
            t0 = time.perf_counter()
            outs = self.core.step()
            self.last_progress = time.monotonic()
            if self.on_step is not None:
                self.on_step(self.core.stats(), time.perf_counter() - t0, outs)
            self._deliver(outs)

    def _died(self, message: str) -> None:
        with self._lock:
            self.dead = message
        try:
            failed = self.core.fail_all(message)
        except Exception:  # the core's state is beyond use; the client answers everyone
            log.exception("failing the requests in flight failed")
            failed = []
        self._fail_rest(failed)
        self._refuse_queued()

    def _refuse_queued(self) -> None:
        """Admissions queued for a dead loop fail with EngineDead (aborts are moot)."""
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == _ADD:
                _, loop, fut = payload
                dead = EngineDead(self.dead or "engine died", self.retry_after)
                loop.call_soon_threadsafe(settle, fut, dead)

    def _restart(self) -> bool:
        """A fresh core after the backoff; False at shutdown or once the budget is spent."""
        while not self._closing.is_set():
            delay = self._budget.next_delay() if self._rebuild is not None else None
            if delay is None:
                self._give_up(self._budget)
                return False
            log.warning("restarting the engine in %.1f s", delay)
            self.back_at = time.monotonic() + delay + self._load_s
            if self._closing.wait(delay):
                return False
            gc.unfreeze()  # the dead core froze its heap; let it be collected
            try:
                started = time.monotonic()
                core = self._rebuild(self.core)
                self._load_s = time.monotonic() - started
            except Exception:
                log.exception("restarting the engine failed")
                continue
            self.core = core
            self._refuse_queued()  # added while it was down: already answered EngineDead
            self._revived()
            return True
        return False

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
                    if self.on_step is not None:
                        self.on_step(self.core.stats_without_step(), 0.0, [out])
                    self._deliver([out])
            return
        requests, loop, fut = payload
        loop.call_soon_threadsafe(settle, fut, admit(self.core, requests))


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
