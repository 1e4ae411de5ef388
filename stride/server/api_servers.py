"""`stride serve --api-servers N`: N HTTP processes in front of one engine process (vLLM's
`--api-server-count`).

One asyncio process parses, formats and writes only so many SSE events a second; at 256 streams
on a GPU the engine makes more. So this process (the supervisor) binds the port, starts the
engine process with one pipe per API process, and spawns N API processes that each run the
usual app and uvicorn on a listening socket of their own and talk to the engine over their pipe.

- Sockets: one per API process, all bound to the port with SO_REUSEPORT, so the kernel spreads
  connections evenly. (One shared socket would not: asyncio accepts every pending connection at
  once, so whichever process wakes first takes a whole burst of them.)
- Metrics: prometheus_client's multiprocess mode in a fresh directory, so any process answers
  `/metrics` for the whole server; API process 0 alone records the engine's step numbers.
- Signals: SIGTERM or SIGINT here becomes one SIGTERM to each API process, which drains as a
  single server does; a second one makes them exit at once. Once they are gone the engine
  process, whose pipes have all closed, exits too. If one API process fails, the others are
  stopped. API processes whose supervisor dies drain and exit; the engine follows them.
- Engine restarts: the API processes fail their requests in flight as soon as the engine's pipe
  breaks; this process reaps the dead engine, starts another after the backoff and sends each
  API process its new pipe over a pipe of their own (`engine_updates`). Once the restart budget
  is spent it stops the API processes and exits 1 (see `stride.scheduler.supervision`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import FrameType

from stride.metrics.registry import MULTIPROC_ENV
from stride.scheduler.core import CoreConfig
from stride.scheduler.process import run_setup, start_engine_process
from stride.scheduler.supervision import RestartBudget, SupervisionConfig
from stride.server.app import ServerConfig
from stride.server.http_server import listen, run_server, setup_logging

log = logging.getLogger("stride")


def serve_many(
    args: argparse.Namespace, config: ServerConfig, n: int, claimed: socket.socket
) -> int:
    """Run N API processes and the engine process until they are done; 0 if all exited 0.

    `claimed`: the port, bound by this process alone (so that a port in use is an error even
    where its holder shares it too); given up for N sockets that share it."""
    port = claimed.getsockname()[1]  # the one chosen, if --port was 0
    claimed.close()
    sockets = [listen(args.host, port, shared=True) for _ in range(n)]
    with tempfile.TemporaryDirectory(prefix="stride-metrics-") as metrics_dir:
        os.environ[MULTIPROC_ENV] = metrics_dir  # before any child imports prometheus_client
        engine_config = config.core
        engine, conns = start_engine_process(engine_config, n)
        ctx = mp.get_context("spawn")
        updates = [ctx.Pipe() for _ in range(n)]  # (ours, theirs): pipes to restarted engines
        servers = [
            ctx.Process(
                target=_api_server,
                args=(
                    args,
                    dataclasses.replace(
                        config, engine_conn=conn, engine_updates=theirs, step_metrics=i == 0
                    ),
                    s,
                ),
                name=f"stride-api-{i}",
                daemon=True,
            )
            for i, (conn, s, (_, theirs)) in enumerate(zip(conns, sockets, updates, strict=True))
        ]
        supervisor = _Supervisor(
            servers, engine, engine_config, [ours for ours, _ in updates], config.supervision
        )
        for p in servers:
            p.start()
        for conn, s, (_, theirs) in zip(conns, sockets, updates, strict=True):  # theirs now
            conn.close()  # (else the engine would not see their end close)
            s.close()
            theirs.close()
        log.info("%d API processes on %s:%d", n, args.host, port)
        codes = supervisor.wait()
        engine = supervisor.engine
        engine.join(10)  # every pipe closed: it is on its way out
        if engine.is_alive():
            engine.kill()
            engine.join(5)
    return 0 if all(c == 0 for c in codes) and not supervisor.gave_up else 1


class _Supervisor:
    """Forwards SIGTERM/SIGINT to the API processes as SIGTERM; waits for all of them, and
    restarts the engine process whenever it dies before they are done."""

    def __init__(
        self,
        servers: list[BaseProcess],
        engine: BaseProcess,
        engine_config: CoreConfig,
        updates: list[Connection],
        supervision: SupervisionConfig,
    ) -> None:
        self.servers = servers
        self.engine = engine
        self.engine_config = engine_config
        self.updates = updates  # to each API process, in order
        self.budget = RestartBudget(supervision)
        self.stopping = False
        self.gave_up = False
        signal.signal(signal.SIGTERM, self._forward)
        signal.signal(signal.SIGINT, self._forward)

    def _forward(self, sig: int, frame: FrameType | None) -> None:
        log.warning("%s: stopping the API processes", signal.Signals(sig).name)
        self.stop()

    def stop(self) -> None:
        self.stopping = True
        for p in self.servers:
            if p.pid is not None and p.exitcode is None:
                os.kill(p.pid, signal.SIGTERM)

    def wait(self) -> list[int]:
        """Exit codes of the API processes; the first failure stops the others."""
        if self.stopping:  # a signal came before they started
            self.stop()
        pending = {p.sentinel: p for p in self.servers}
        engine_up = True
        restart_at: float | None = None  # when the dead engine's successor starts
        while pending:
            watched = list(pending) + ([self.engine.sentinel] if engine_up else [])
            timeout = None if restart_at is None else max(0.0, restart_at - time.monotonic())
            for sentinel in wait(watched, timeout):
                if engine_up and sentinel == self.engine.sentinel:
                    engine_up = False
                    self.engine.join()  # reaped: no zombie
                    log.error("the engine process exited with %s", self.engine.exitcode)
                    restart_at = self._next_restart()
                    continue
                p = pending.pop(sentinel)
                p.join()
                if p.exitcode != 0 and not self.stopping:
                    log.error("%s exited with %s: stopping the others", p.name, p.exitcode)
                    self.stop()
            if restart_at is not None and time.monotonic() >= restart_at:
                restart_at = None
                if not self.stopping:
                    engine_up = self._restart_engine()
                    if not engine_up:
                        restart_at = self._next_restart()
        return [p.exitcode for p in self.servers]

    def _next_restart(self) -> float | None:
        """When to start the next engine (None: not again; the budget is spent: stop)."""
        if self.stopping:
            return None
        delay = self.budget.next_delay()
        if delay is None:
            log.error("giving up on the engine: %s", self.budget.describe())
            self.gave_up = True
            self.stop()
            return None
        log.error("restarting the engine process in %.1f s", delay)
        return time.monotonic() + delay

    def _restart_engine(self) -> bool:
        """A new engine process, its pipes sent to the API processes; False if it failed."""
        try:
            self.engine, conns = start_engine_process(self.engine_config, len(self.servers))
        except Exception:
            log.exception("starting the engine process failed")
            return False
        for ours, conn in zip(self.updates, conns, strict=True):
            try:
                ours.send(conn)  # (a Connection travels as a duplicated descriptor)
            except (OSError, ValueError):  # that API process is gone
                pass
            conn.close()
        return True


def _api_server(args: argparse.Namespace, config: ServerConfig, sock: socket.socket) -> None:
    """One API process: the app and uvicorn on `sock`, the engine behind `config.engine_conn`."""
    run_setup(os.environ.get("STRIDE_ENGINE_SETUP"))  # e.g. decoders registered outside Stride
    setup_logging(args)
    _drain_when_orphaned()
    sys.exit(run_server(args, config, sock, only_sigterm=True))


def _drain_when_orphaned() -> None:
    """If the supervisor dies (even by SIGKILL), drain and exit as on SIGTERM."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch(sentinel: int) -> None:
        wait([sentinel])
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, args=(parent.sentinel,), daemon=True).start()
