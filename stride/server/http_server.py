"""uvicorn as Stride runs it: a socket bound before anything loads, one log format, a ready line
once the model serves, and a first signal that drains requests in flight instead of cutting
them off.

The drain: new requests get 503 while those in flight go on, for at most `--shutdown-timeout`
seconds. Then whatever still runs is answered at once (`Lifecycle.cut_off`: a plain request 503
`server_draining`, a stream an error event and `[DONE]`), and the server exits once those
answers are out: well before uvicorn's own grace period (`GRACE_S`), which would cancel a
request mid-answer (a plain-text 500, a stream cut short, a traceback in the log).
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import time
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

if TYPE_CHECKING:
    from fastapi import FastAPI

    from stride.server.app import Lifecycle, ServerConfig

log = logging.getLogger("stride")
STARTED = time.monotonic()  # the ready line says how long the start took
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
GRACE_S = 2  # uvicorn's wait for connections once it stops; then it cancels their requests
CUT_OFF_S = 1.0  # after the drain deadline: how long the last answers may take to go out
BACKLOG = 2048  # uvicorn's default
# How long an idle connection stays open: longer than clients keep one in their pools (httpx and
# so the openai SDK: 5 s, uvicorn's own default), so that a client never sends a request on a
# connection the server is closing at that moment ("Server disconnected without sending a
# response"); longer than a load balancer's idle timeout (60 s on most), for the same reason.
KEEP_ALIVE_S = 65


class PortUnavailable(Exception):
    """The address to listen on cannot be had (in use, not an address here, out of range)."""


def listen(host: str, port: int, shared: bool = False) -> socket.socket:
    """A listening TCP socket on host:port; `shared`: one that other processes may bind too
    (SO_REUSEPORT: the kernel spreads connections over them). PortUnavailable if it cannot be
    had, saying why in a line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if shared:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        why = e.strerror or str(e)
        raise PortUnavailable(f"cannot listen on {host}:{port}: {why}") from None
    sock.set_inheritable(True)
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn, with a first signal that drains instead of closing the socket, and one ready
    line once the model serves and the socket listens (uvicorn's own "running" is dropped:
    it comes while the model still loads).

    `only_sigterm`: one of several API processes, which a terminal's Ctrl-C reaches too; their
    parent turns it into one SIGTERM each, so a SIGINT of their own is ignored.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        app: FastAPI,
        timeout: float,
        only_sigterm: bool = False,
    ) -> None:
        super().__init__(config)
        self.app = app
        self.lifecycle: Lifecycle = app.state.lifecycle
        self.timeout = timeout
        self.only_sigterm = only_sigterm
        self.deadline: float | None = None  # of the drain
        self.cut_at: float | None = None  # when what still ran at the deadline was answered
        self.failed = False
        self.announced = not app.state.config.step_metrics  # one API process of several says it

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.only_sigterm and sig != signal.SIGTERM:
            return
        if self.deadline is None and not self.should_exit:
            log.warning(
                "%s: draining %d requests (at most %.0f s)",
                signal.Signals(sig).name,
                self.lifecycle.in_flight,
                self.timeout,
            )
            self.lifecycle.begin_drain()
            self.deadline = time.monotonic() + self.timeout
        else:
            self.should_exit = self.force_exit = True

    def announce(self) -> None:
        """The ready line, once the model serves and the socket listens (the app calls this as
        the model becomes ready, before it serves a request; `on_tick` if the socket was not
        bound yet then)."""
        if not self.announced and self.started and self.lifecycle.client is not None:
            self.announced = True
            log.info("%s", ready_line(self.app, self.url()))

    async def on_tick(self, counter: int) -> bool:
        """Every 0.1 s: while draining, exit once idle; at the deadline answer what still runs,
        and exit once those answers are out (or `CUT_OFF_S` later: uvicorn's grace follows)."""
        self.announce()
        if self.deadline is not None and not self.should_exit:
            now = time.monotonic()
            if self.lifecycle.idle:
                self.should_exit = True
            elif self.cut_at is None and now >= self.deadline:
                ended = self.lifecycle.cut_off()
                log.warning(
                    "shutdown timeout: %d requests in flight; %d generations still running "
                    "answered 503 server_draining", self.lifecycle.in_flight, ended
                )  # fmt: skip
                self.cut_at = now
            elif self.cut_at is not None and now >= self.cut_at + CUT_OFF_S:
                self.should_exit = True
        return await super().on_tick(counter)

    def url(self) -> str:
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def ready_line(app: FastAPI, url: str) -> str:
    """What a person starting the server wants to read once it serves."""
    info = app.state.lifecycle.client.model
    decoders = ", ".join(app.state.metrics.strategies)
    return (
        f"ready on {url}: {info.name} on {info.device} ({info.dtype}), KV cache "
        f"{info.kv_tokens:,} tokens, context {info.max_model_len:,} tokens; decoders: "
        f"{decoders}; started in {time.monotonic() - STARTED:.1f} s"
    )


class _NotYetServing(logging.Filter):
    """uvicorn says it is running, and its startup complete, as soon as the socket is bound;
    the model is still loading then. Stride's own ready line comes when requests work."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("Uvicorn running on", "Application startup"))


def setup_logging(args: argparse.Namespace) -> None:
    """One format for Stride's lines and uvicorn's (uvicorn is told not to set up its own)."""
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    logging.getLogger("uvicorn.error").addFilter(_NotYetServing())


def uvicorn_config(app: FastAPI, **kw: Any) -> uvicorn.Config:
    """uvicorn's settings for `app`, with Stride's keep-alive (`KEEP_ALIVE_S`)."""
    return uvicorn.Config(app, timeout_keep_alive=KEEP_ALIVE_S, **kw)


def run_server(
    args: argparse.Namespace,
    server_config: ServerConfig,
    sock: socket.socket,
    only_sigterm: bool = False,
) -> int:
    """Serve on `sock` (bound to `args.host:args.port`); `only_sigterm`: one API process of
    several (see `DrainingServer`)."""
    from stride.server.app import create_app

    app = create_app(server_config)
    config = uvicorn_config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        log_config=None,  # uvicorn's loggers reach the root handler: Stride's format
        timeout_graceful_shutdown=GRACE_S,
        access_log=False,  # Stride's access line has the decoder and tokens too
    )
    server = DrainingServer(config, app, args.shutdown_timeout, only_sigterm)

    def failed(message: str) -> None:
        log.error("cannot serve: %s", message)
        server.failed = server.should_exit = True

    app.state.lifecycle.on_failure = failed
    app.state.lifecycle.on_ready = server.announce
    server.run(sockets=[sock])
    return 1 if server.failed else 0


