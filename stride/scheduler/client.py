"""The engine client: the step loop on its own thread, met by asyncio callers through queues.

Callers submit plain `GenerateRequest`s and read plain `RequestOutput`s; the loop never awaits
HTTP, and HTTP never waits on a step. If the loop dies, every request in flight gets
`engine_dead` at once, and the engine is restarted (see `supervision`); a watchdog thread tells
when it has not stepped for a while with requests in flight (`stuck`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
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
from stride.scheduler.supervision import RestartBudget, SupervisionConfig

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
    device: str  # e.g. "cpu", "cuda:0", "2 x cuda" (split over ranks); for the ready line
    dtype: str  # e.g. "float32"
    kv_tokens: int  # tokens the whole KV cache holds
    peak_bandwidth: float  # the device's roof (bytes/s, FLOP/s): measured at start, or given
    peak_flops: float

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
            device=str(engine.device)
            if engine.workers is None
            else f"{engine.config.tensor_parallel_size} x {engine.device.type}",
            dtype=str(engine.dtype).removeprefix("torch."),
            kv_tokens=cache.num_usable_blocks * cache.block_size,
            peak_bandwidth=engine.peaks.bandwidth,
            peak_flops=engine.peaks.flops,
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

    def expire(self) -> list[RequestOutput]:
        """The deadline passed: end every unfinished request with `deadline` now, whatever the
        engine does (a hung engine included); the engine is told to abort them."""
        error = EngineError("deadline_exceeded", "the request's deadline passed")
        outs = [RequestOutput(r, finish_reason="deadline", error=error) for r in self.unfinished]
        for rid in self.unfinished:
            self._client.abort(rid)
        self.unfinished.clear()
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
        prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
        timings=b.timings or a.timings,
        timeline=b.timeline or a.timeline,
    )


class BaseClient:
    """Submission, streams and delivery, common to the thread and the process step loops.

    Also what supervision needs on this side: `dead` (why the engine is down now: it died, or
    is being restarted), the hooks `on_restart` (a restarted engine serves again) and
    `on_give_up` (the restart budget is spent: the server should exit), and the watchdog.
    """

    def __init__(self, supervision: SupervisionConfig | None = None) -> None:
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, Submission]] = {}
        self._live: set[str] = set()  # submitted, and not known to have ended in the engine
        self._lock = threading.Lock()
        self.dead: str | None = None  # why the engine is down, while it is
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

    @property
    def stuck(self) -> str | None:
        """Why the engine looks hung (requests in flight, no step for `watchdog_timeout` s)."""
        with self._lock:
            live = len(self._live)
        quiet = time.monotonic() - self.last_progress
        if not live or self.dead or quiet < self.supervision.watchdog_timeout:
            return None
        return f"no engine step for {quiet:.0f} s with {live} requests in flight"

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
            raise EngineDead(self.dead)
        check_group(requests, self.model.max_waiting)
        if self._num_waiting() >= self.model.max_waiting:
            raise QueueFull("the waiting queue is full")
        loop = asyncio.get_running_loop()
        sub = Submission(self, [r.request_id for r in requests])
        admitted: asyncio.Future = loop.create_future()
        with self._lock:
            if not self._live:  # the watchdog's clock starts with the work
                self.last_progress = time.monotonic()
            for rid in sub.request_ids:
                self._streams[rid] = (loop, sub)
                self._live.add(rid)
        self._add(requests, loop, admitted)
        try:
            await admitted  # raises what admission raised
        except BaseException as e:
            if isinstance(e, (QueueFull, RequestRejected, EngineDead)):
                sub.unfinished.clear()  # nothing was added
                with self._lock:
                    self._live.difference_update(sub.request_ids)
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
                if out.finished:
                    self._live.discard(out.request_id)
                target = self._streams.get(out.request_id)
                if target is not None:
                    by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_dispatch, items)

    def _fail_rest(self, failed: list[RequestOutput]) -> None:
        """The engine died: deliver `failed`, and an error to every other stream still open."""
        answered = {o.request_id for o in failed}
        with self._lock:
            unanswered = [r for r in self._streams if r not in answered]
            self._live.clear()
        error = EngineError("engine_dead", self.dead or "engine loop died")
        for rid in unanswered:  # e.g. requests admitted but not yet in the core
            failed.append(RequestOutput(rid, finish_reason="error", error=error))
        self._deliver(failed)

    def _revived(self) -> None:
        """A restarted engine serves: take requests again."""
        with self._lock:
            self.dead = None
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

    `rebuild` makes a fresh core (a freshly loaded engine) to restart with once the loop died;
    without it the engine stays dead.
    """

    def __init__(
        self,
        core: EngineCore,
        rebuild: Callable[[], EngineCore] | None = None,
        supervision: SupervisionConfig | None = None,
    ) -> None:
        super().__init__(supervision)
        self.core = core
        self._rebuild = rebuild
        self._budget = RestartBudget(self.supervision)
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
                loop.call_soon_threadsafe(settle, fut, EngineDead(self.dead or "engine died"))

    def _restart(self) -> bool:
        """A fresh core after the backoff; False at shutdown or once the budget is spent."""
        while not self._closing.is_set():
            delay = self._budget.next_delay() if self._rebuild is not None else None
            if delay is None:
                self._give_up(self._budget)
                return False
            log.warning("restarting the engine in %.1f s", delay)
            if self._closing.wait(delay):
                return False
            gc.unfreeze()  # the dead core froze its heap; let it be collected
            try:
                core = self._rebuild()
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


def check_group(requests: list[GenerateRequest], max_waiting: int) -> None:
    """Requests admitted together that can never be: more than the waiting queue holds."""
    if len(requests) > max_waiting:
        raise RequestRejected(
            f"{len(requests)} sequences (prompts x n) can never be admitted together: the "
            f"waiting queue holds {max_waiting} (--max-waiting)",
            param="n",
        )


def admit(core: EngineCore, requests: list[GenerateRequest]) -> Exception | None:
    """Add every request to the core, or none of them: the admission error, if any."""
    added: list[str] = []
    try:
        check_group(requests, core.config.max_waiting)
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
