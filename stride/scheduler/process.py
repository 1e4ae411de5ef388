"""The step loop in a process of its own, as vLLM v1 does: HTTP and the engine share no GIL.

The server process sends plain `GenerateRequest`s (and aborts) down a pipe; the engine process
sends back, per step, the batch of `RequestOutput`s together with the step's numbers
(`StepStats`), from which the server's metrics are kept as they are for a local core. The engine
process ignores SIGINT/SIGTERM (the server drains, then stops it) and exits when the pipe closes.
`STRIDE_ENGINE_SETUP=module:function` runs in the engine process before the model loads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import itertools
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from stride.decoders.registry import DecodersConfig, build_decoders
from stride.engine.engine import Engine, EngineConfig
from stride.scheduler.client import BaseClient, EngineDead, ModelInfo, admit, settle
from stride.scheduler.core import EngineCore
from stride.scheduler.outputs import QueueFull, RequestOutput, RequestRejected, StepStats
from stride.scheduler.policy import SchedulerConfig

log = logging.getLogger(__name__)


@dataclass
class EngineProcessConfig:
    engine: EngineConfig
    scheduler: SchedulerConfig
    decoders: DecodersConfig


class ProcessEngineClient(BaseClient):
    """Starts the engine process (blocks until the model is loaded) and talks to it."""

    def __init__(self, config: EngineProcessConfig) -> None:
        super().__init__()
        ctx = mp.get_context("spawn")  # CUDA cannot be forked
        self._conn, theirs = ctx.Pipe()
        self._process = ctx.Process(target=_main, args=(config, theirs), name="stride-engine")
        self._process.daemon = True
        self._process.start()
        theirs.close()
        self._send_lock = threading.Lock()
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._keys = itertools.count()
        self._stopping = False
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            kind, payload = "failed", f"the engine process exited ({self._process.exitcode})"
        if kind != "ready":
            self._process.join(5)
            raise RuntimeError(payload)
        self._model: ModelInfo = payload
        self.stats = StepStats(0, 0, 0.0, 0, 0, 0)
        self._reader = threading.Thread(target=self._read, name="stride-engine-io", daemon=True)
        self._reader.start()

    @property
    def model(self) -> ModelInfo:
        return self._model

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def shutdown(self) -> None:
        self._stopping = True
        self._send(("stop", None))
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._conn.close()

    def _num_waiting(self) -> int:
        return self.stats.num_waiting + len(self._pending)

    def _add(self, requests, loop, fut) -> None:
        key = next(self._keys)
        self._pending[key] = (loop, fut)
        if not self._send(("add", (key, requests))):
            self._pending.pop(key, None)
            settle(fut, EngineDead(self.dead or "the engine process is gone"))

    def _send(self, message: tuple[str, Any]) -> bool:
        try:
            with self._send_lock:
                self._conn.send(message)
            return True
        except (OSError, ValueError):  # the process is gone; the reader reports why
            return False

    def _read(self) -> None:
        """Reader thread: each step's outputs to their event loops, admissions settled."""
        try:
            while True:
                kind, payload = self._conn.recv()
                if kind == "outs":
                    outs, stats, seconds = payload
                    self.stats = stats
                    if self.on_step is not None:
                        self.on_step(stats, seconds, outs)
                    self._deliver(outs)
                elif kind == "admitted":
                    key, error = payload
                    loop, fut = self._pending.pop(key)
                    loop.call_soon_threadsafe(settle, fut, _rejection(error))
                elif kind == "dead":
                    message, outs = payload
                    self._die(message, outs)
                    return
        except (EOFError, OSError):
            if not self._stopping:
                self._die(f"the engine process exited ({self._process.exitcode})", [])

    def _die(self, message: str, failed: list[RequestOutput]) -> None:
        log.error("engine died: %s", message)
        self.dead = message
        self._fail_rest(failed)
        for loop, fut in list(self._pending.values()):
            loop.call_soon_threadsafe(settle, fut, EngineDead(message))
        self._pending.clear()


def _rejection(error: tuple[str, str, str, str | None] | None) -> Exception | None:
    if error is None:
        return None
    kind, message, code, param = error
    return QueueFull(message) if kind == "queue_full" else RequestRejected(message, code, param)


# ---- the engine process -------------------------------------------------------------------------


def _main(config: EngineProcessConfig, conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server drains first, then stops us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        _run_setup(os.environ.get("STRIDE_ENGINE_SETUP"))
        engine = Engine(config.engine)
        core = EngineCore(engine, config.scheduler, build_decoders(engine, config.decoders))
    except Exception as e:
        log.exception("loading the model failed")
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", ModelInfo.of(core)))
    try:
        _loop(core, conn)
    except (EOFError, OSError):  # the server went away
        return
    except Exception as e:
        log.exception("engine loop died")
        message = f"engine loop died: {type(e).__name__}: {e}"
        conn.send(("dead", (message, core.fail_all(message))))


def _run_setup(spec: str | None) -> None:
    """Call `module:function` first, e.g. to register decoders defined outside Stride: what the
    server process registered does not exist in this fresh (spawned) interpreter."""
    if spec:
        module, _, function = spec.partition(":")
        getattr(importlib.import_module(module), function)()


def _loop(core: EngineCore, conn: Connection) -> None:
    while True:
        while not core.has_work or conn.poll():  # block for work; else take what is there
            kind, payload = conn.recv()
            if kind == "stop":
                return
            if kind == "abort":
                out = core.abort(payload)
                if out is not None:
                    idle = dataclasses.replace(core.stats(), batch_size=0, num_tokens=0)
                    conn.send(("outs", ([out], idle, 0.0)))  # gauges see the freed KV at once
            else:
                key, requests = payload
                conn.send(("admitted", (key, _plain(admit(core, requests)))))
        t0 = time.perf_counter()
        outs = core.step()
        conn.send(("outs", (outs, core.stats(), time.perf_counter() - t0)))


def _plain(error: Exception | None) -> tuple[str, str, str, str | None] | None:
    """An admission error as plain data (RequestRejected's fields do not survive pickling)."""
    if error is None:
        return None
    if isinstance(error, QueueFull):
        return ("queue_full", str(error), "queue_full", None)
    assert isinstance(error, RequestRejected)
    return ("rejected", str(error), error.code, error.param)
