"""Where the server stands (loading, ready, draining, failed), what `/health` says about it,
and the gate every request passes: counted while in flight, refused with 503 once draining.

On SIGTERM the server drains (`begin_drain`): new requests get 503 `server_draining` while
those in flight go on. At the drain deadline (`--shutdown-timeout`) `cut_off` ends whatever
still runs, each with its own last word, so that the process can exit 0 before uvicorn's own
grace period would cancel them mid-answer.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from stride.metrics.edge import PROBES
from stride.scheduler.client import BaseClient
from stride.server.errors import APIError
from stride.server.generation import Running


class Phase(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


class Lifecycle:
    """Where the server stands, how many requests are in flight, and the generations running."""

    def __init__(self) -> None:
        self.phase = Phase.LOADING
        self.client: BaseClient | None = None
        self.error: str | None = None
        self.in_flight = 0
        self.running = Running()
        self.on_failure: Callable[[str], None] | None = None  # e.g. the CLI exits
        self.on_ready: Callable[[], None] | None = None  # e.g. the CLI's ready line

    def begin_drain(self) -> None:
        if self.phase is not Phase.FAILED:
            self.phase = Phase.DRAINING

    def cut_off(self) -> int:
        """The drain deadline passed: every generation still running answers now (503
        `server_draining`, or a stream's error event and [DONE]); how many did."""
        return self.running.cut_off()

    @property
    def idle(self) -> bool:
        return self.in_flight == 0

    def health(self) -> tuple[str, str | None]:
        if self.phase is Phase.FAILED:
            return "failed", self.error
        if self.client is not None and self.client.dead:
            return "dead", self.client.dead
        stuck = None if self.client is None else self.client.stuck
        if stuck is not None:
            return "stuck", stuck
        if self.phase is Phase.READY:
            return "ok", None
        return self.phase.value, None

    def unavailable(self) -> APIError | None:
        """Why a generation route cannot run now, if it cannot."""
        if self.phase is Phase.LOADING:
            return APIError("model_loading", "the model is still loading; retry shortly")
        if self.phase is Phase.FAILED:
            return APIError("model_load_failed", f"the model failed to load: {self.error}")
        client = self.client
        if client is not None and client.dead:
            retry = {"Retry-After": str(client.retry_after)}
            return APIError("engine_dead", client.dead, headers=retry)
        return None


class Gate:
    """Counts requests in flight; once draining, answers new ones with 503 (probes stay open)."""

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle) -> None:
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBES:
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["arrival"] = time.monotonic()  # deadlines run from here
        if self.lifecycle.phase is Phase.DRAINING:
            error = APIError("server_draining", "the server is shutting down")
            return await error.response()(scope, receive, send)
        self.lifecycle.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.in_flight -= 1
