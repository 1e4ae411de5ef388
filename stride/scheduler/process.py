"""The step loop in a process of its own, as vLLM v1 does: HTTP and the engine share no GIL.

The server process sends plain `GenerateRequest`s (and aborts) down a pipe, from a thread of
its own so that an engine that stopped reading never blocks the event loop; the engine process
sends back, per step, the batch of `RequestOutput`s together with the step's numbers
(`StepStats`), from which the server's metrics are kept as they are for a local core. The engine
process ignores SIGINT/SIGTERM (the server drains, then stops it) and exits when the pipe closes.
Several API processes (`stride serve --api-servers N`) each have a pipe of their own; the engine
waits on all of them and exits once every one is closed. While it steps, every pipe hears from
it at least once a second (an empty batch if need be): the API processes' watchdogs listen.
If the engine process dies, its owner restarts it (`supervision`): the client that started it,
or with several API processes their supervisor, which hands each of them its new pipe.
`STRIDE_ENGINE_SETUP=module:function` runs in every spawned process before the model loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from stride.scheduler.admission import admit
from stride.scheduler.client import BaseClient, EngineDead, settle
from stride.scheduler.core import CoreConfig, EngineCore
from stride.scheduler.model_info import ModelInfo
from stride.scheduler.outputs import (
    GenerateRequest,
    RequestOutput,
    StepStats,
    rejection_from_plain,
    rejection_to_plain,
)
from stride.scheduler.supervision import RestartBudget, SupervisionConfig

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # the longest a stepping engine stays silent on a pipe


def start_engine_process(
    config: CoreConfig, num_pipes: int = 1
) -> tuple[BaseProcess, list[Connection]]:
    """Spawn the engine process with one pipe per API process; returns it and our pipe ends.

    The engine process loads the model, then answers "ready" (or "failed") on every pipe.
    """
    ctx = mp.get_context("spawn")  # CUDA cannot be forked
    pipes = [ctx.Pipe() for _ in range(num_pipes)]
    theirs = [b for _, b in pipes]
    process = ctx.Process(target=_main, args=(config, theirs), name="stride-engine", daemon=True)
    process.start()
    for conn in theirs:  # else the engine would never see our side close
        conn.close()
    return process, [a for a, _ in pipes]


class ProcessEngineClient(BaseClient):
    """Talks to the engine process over one pipe (blocks until the model is loaded).

    `start()` also owns the process (one API process) and restarts it when it dies. Several API
    processes each get a pipe to an engine process that their parent started and restarts
    (`stride serve --api-servers N`); the pipe to each new engine comes over `updates`.
    """

    def __init__(
        self,
        conn: Connection,
        process: BaseProcess | None = None,
        config: CoreConfig | None = None,
        updates: Connection | None = None,
        supervision: SupervisionConfig | None = None,
    ) -> None:
        super().__init__(supervision)
        self._process = process
        self._config = config  # to start another engine process with
        self._updates = updates
        self._budget = RestartBudget(self.supervision)
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._keys = itertools.count()
        self._stopping = False
        self._model: ModelInfo = self._handshake(conn)
        self._conn = conn
        self._writer = PipeWriter(conn)
        self.stats = StepStats(0, 0, 0.0, 0, 0, 0)
        self._reader = threading.Thread(target=self._read, name="stride-engine-io", daemon=True)
        self._reader.start()

    @classmethod
    def start(
        cls, config: CoreConfig, supervision: SupervisionConfig | None = None
    ) -> ProcessEngineClient:
        process, (conn,) = start_engine_process(config)
        return cls(conn, process, config, supervision=supervision)

    @property
    def model(self) -> ModelInfo:
        return self._model

    def abort(self, request_id: str) -> None:
        self._writer.put(("abort", request_id))

    def shutdown(self) -> None:
        """Close our pipe; the engine process exits once every pipe to it is closed."""
        self._stopping = True
        self._closing.set()
        self._writer.put(("stop", None))
        self._writer.close(timeout=5)
        if self._process is not None:
            self._process.join(10)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(5)
        self._conn.close()

    def _handshake(self, conn: Connection) -> ModelInfo:
        """Wait for a new engine's "ready" (its model loaded): its ModelInfo, or RuntimeError."""
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):
            kind, payload = "failed", self._exited()
        if kind != "ready":
            if self._process is not None:
                self._process.join(5)
            conn.close()
            raise RuntimeError(payload)
        return payload

    def _exited(self) -> str:
        code = "" if self._process is None else f" ({self._process.exitcode})"
        return f"the engine process exited{code}"

    def _num_waiting(self) -> int:
        # One of several API processes hears the engine's numbers only with its own outputs:
        # they may be old, so it counts what it sent; the engine refuses the rest itself.
        if self._process is None:
            return len(self._pending)
        return self.stats.num_waiting + len(self._pending)

    def _add(self, requests, loop, fut) -> None:
        with self._lock:
            dead = self.dead
            if dead is None:
                key = next(self._keys)
                self._pending[key] = (loop, fut)
        if dead is not None:
            settle(fut, EngineDead(dead, self.retry_after))
            return
        self._writer.put(("add", (key, requests)))

    def _read(self) -> None:
        """Reader thread: serve each engine until it dies, then see to the next one."""
        while True:
            message, failed = self._serve(self._conn)
            if self._stopping:
                return
            self._die(message, failed)
            if not self._recover():
                return

    def _serve(self, conn: Connection) -> tuple[str, list[RequestOutput]]:
        """Each step's outputs to their event loops, admissions settled, until the engine is
        gone: why, and the failed outputs it sent (if it could)."""
        try:
            while True:
                kind, payload = conn.recv()
                self.last_progress = time.monotonic()
                if kind == "outs":
                    outs, stats, seconds = payload
                    self.stats = stats
                    if self.on_step is not None:
                        self.on_step(stats, seconds, outs)
                    self._deliver(outs)
                elif kind == "admitted":
                    key, error = payload
                    with self._lock:
                        waiting = self._pending.pop(key, None)
                    if waiting is not None:
                        loop, fut = waiting
                        loop.call_soon_threadsafe(settle, fut, rejection_from_plain(error))
                elif kind == "dead":
                    return payload
        except (EOFError, OSError):
            if self._process is not None:
                self._process.join(5)  # reap it: no zombie, and its exit code for the message
            return self._exited(), []

    def _die(self, message: str, failed: list[RequestOutput]) -> None:
        log.error("engine died: %s", message)
        with self._lock:
            self.dead = message
            pending, self._pending = list(self._pending.values()), {}
        self._writer.close()
        self._fail_rest(failed)
        for loop, fut in pending:
            loop.call_soon_threadsafe(settle, fut, EngineDead(message, self.retry_after))
        if self._process is not None:  # after "dead" it exits by itself; reap it
            self._process.join(10)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(5)

    def _recover(self) -> bool:
        """Connect to a new engine: one we start after the backoff, or the next one our
        supervisor sends. False at shutdown, or when there will be none."""
        while not self._stopping:
            if self._updates is not None:
                try:
                    conn = self._updates.recv()
                except (EOFError, OSError):  # the supervisor is gone: so is any new engine
                    return False
            elif self._config is not None:
                delay = self._budget.next_delay()
                if delay is None:
                    self._give_up(self._budget)
                    return False
                log.warning("restarting the engine process in %.1f s", delay)
                self.back_at = time.monotonic() + delay
                if self._closing.wait(delay):
                    return False
                try:
                    self._process, (conn,) = start_engine_process(self._config)
                except Exception:
                    log.exception("starting the engine process failed")
                    continue
            else:
                return False
            try:
                self._handshake(conn)
            except RuntimeError as e:
                log.error("the new engine failed to start: %s", e)
                continue
            if self._stopping:
                conn.close()
                return False
            self._conn, self._writer = conn, PipeWriter(conn)
            self.stats = StepStats(0, 0, 0.0, 0, 0, 0)
            self._revived()
            return True
        return False


class PipeWriter:
    """Sends what is `put` down `conn`, in order, until `close`, from a thread of its own: an
    engine that stopped reading (hung, or stopped by SIGSTOP) fills its pipe, and a send then
    blocks this thread, never the event loop that puts the message."""

    def __init__(self, conn: Connection) -> None:
        self._queue: queue.SimpleQueue[tuple[str, Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, args=(conn,), name="stride-engine-send", daemon=True
        )
        self._thread.start()

    def put(self, message: tuple[str, Any]) -> None:
        self._queue.put(message)

    def close(self, timeout: float | None = None) -> None:
        """Stop after what was put so far (waiting up to `timeout` s for it to be sent)."""
        self._queue.put(None)
        if timeout:
            self._thread.join(timeout)

    def _run(self, conn: Connection) -> None:
        while (message := self._queue.get()) is not None:
            try:
                conn.send(message)
            except (OSError, ValueError):  # the engine is gone; the reader says why
                return


# ---- the engine process -------------------------------------------------------------------------


def _main(config: CoreConfig, conns: list[Connection]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server drains first, then stops us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pipes = _Pipes(conns)
    try:
        run_setup(os.environ.get("STRIDE_ENGINE_SETUP"))
        core = config.build()
    except Exception as e:
        log.exception("loading the model failed")
        pipes.broadcast(("failed", f"{type(e).__name__}: {e}"))
        return
    pipes.broadcast(("ready", ModelInfo.of(core)))
    try:
        _loop(core, pipes)
    except Exception as e:
        log.exception("engine loop died")
        pipes.die(f"engine loop died: {type(e).__name__}: {e}", core)


def run_setup(spec: str | None) -> None:
    """Call `module:function` first, e.g. to register decoders defined outside Stride: what the
    server process registered does not exist in a fresh (spawned) interpreter."""
    if spec:
        module, _, function = spec.partition(":")
        getattr(importlib.import_module(module), function)()


def _loop(core: EngineCore, pipes: _Pipes) -> None:
    """Take every message waiting (block only when idle), then step; until every pipe closed."""
    while pipes.open:
        ready = pipes.wait(None if not core.has_work else 0)
        for i, conn in ready:
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):  # that API process went away
                pipes.close(i, core)
                continue
            if kind == "stop":
                pipes.close(i, core)
            elif kind == "abort":
                out = core.abort(payload)
                if out is not None:
                    pipes.send_outputs([out], core.stats_without_step(), 0.0, core)
            else:
                key, requests = payload
                error = admit(core, requests)
                if error is None:
                    pipes.own(i, requests)
                pipes.send(i, ("admitted", (key, rejection_to_plain(error))), core)
        if not ready and core.has_work:
            t0 = time.perf_counter()
            outs = core.step()
            pipes.send_outputs(outs, core.stats(), time.perf_counter() - t0, core)


class _Pipes:
    """The engine's ends of the API processes' pipes, and which pipe each request came from.

    Each API process gets the outputs of its own requests only; pipe 0 also gets every step's
    numbers, even with no outputs of its own (its API process keeps the engine-wide metrics).
    A pipe that closes (or breaks) takes its requests with it: they are aborted.
    With one pipe everything goes to it and nothing is tracked (the single-API-process path).
    """

    def __init__(self, conns: list[Connection]) -> None:
        self.conns = dict(enumerate(conns))
        self.owner: dict[str, int] | None = {} if len(conns) > 1 else None
        self.last_sent = dict.fromkeys(self.conns, 0.0)  # when each pipe last heard from us

    @property
    def open(self) -> bool:
        return bool(self.conns)

    def wait(self, timeout: float | None) -> list[tuple[int, Connection]]:
        ready = set(wait(list(self.conns.values()), timeout))
        return [(i, c) for i, c in self.conns.items() if c in ready]

    def own(self, i: int, requests: list[GenerateRequest]) -> None:
        if self.owner is not None:
            for req in requests:
                self.owner[req.request_id] = i

    def send(self, i: int, message: tuple[str, Any], core: EngineCore) -> None:
        conn = self.conns.get(i)
        if conn is None:
            return
        try:
            conn.send(message)
        except (OSError, ValueError):  # that API process went away
            self.close(i, core)
            return
        self.last_sent[i] = time.monotonic()

    def send_outputs(
        self, outs: list[RequestOutput], stats: StepStats, seconds: float, core: EngineCore
    ) -> None:
        if self.owner is None:
            for i in list(self.conns):
                self.send(i, ("outs", (outs, stats, seconds)), core)
            return
        now = time.monotonic()
        for i, mine in self._split(outs).items():
            if mine or i == 0 or now - self.last_sent[i] >= HEARTBEAT_S:
                self.send(i, ("outs", (mine, stats, seconds)), core)

    def _split(self, outs: list[RequestOutput]) -> dict[int, list[RequestOutput]]:
        """Outputs by the pipe their request came from (finished requests are forgotten)."""
        assert self.owner is not None
        by_pipe: dict[int, list[RequestOutput]] = {i: [] for i in self.conns}
        for out in outs:
            rid = out.request_id
            i = self.owner.pop(rid, None) if out.finished else self.owner.get(rid)
            if i in by_pipe:
                by_pipe[i].append(out)
        return by_pipe

    def close(self, i: int, core: EngineCore) -> None:
        """Pipe `i` is done: abort what its API process left running."""
        conn = self.conns.pop(i, None)
        if conn is None:
            return
        conn.close()
        if self.owner is not None:
            for rid in [r for r, owner in self.owner.items() if owner == i]:
                del self.owner[rid]
                core.abort(rid)

    def broadcast(self, message: tuple[str, Any]) -> None:
        for conn in self.conns.values():
            with contextlib.suppress(OSError, ValueError):
                conn.send(message)

    def die(self, message: str, core: EngineCore) -> None:
        """The loop broke: every API process gets the failed outputs of its own requests."""
        failed = core.fail_all(message)
        if self.owner is None:
            self.broadcast(("dead", (message, failed)))
            return
        for i, mine in self._split(failed).items():
            with contextlib.suppress(OSError, ValueError):
                self.conns[i].send(("dead", (message, mine)))
