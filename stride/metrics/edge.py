"""The HTTP edge: every request's access line, and the generation requests received and refused.

The access line is one log line per HTTP request (`stride.access`), like vLLM's. Method, path,
status and latency come from the middleware; a generation request's decoder and tokens from the
request's tracker, which finds the exchange being served in `current_exchange` (set by the
middleware around each request). Probes (/health, /metrics, every few seconds from
orchestrators and Prometheus) are logged at debug only.

A refused generation request is counted by its status code here. A request that was admitted
(its tracker saw an output) and failed later is counted by its tracker as finished with `error`,
and a deadline that passed once the request was admitted by its tracker too (which also sees
deadlines that end a stream after its 200); one that passed before, by its 504 here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

access_log = logging.getLogger("stride.access")

# Open while loading or draining, never counted as in flight, logged at debug only: orchestrators
# and Prometheus call them every few seconds.
PROBES = frozenset({"/health", "/metrics"})


@dataclass
class Exchange:
    """One HTTP request as the access line tells it (trackers fill in what they see)."""

    admitted: bool = False
    status: int | None = None
    decoder: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


# The HTTP request being served (set by the middleware, seen by trackers made while serving it).
current_exchange: ContextVar[Exchange | None] = ContextVar("stride_http_request", default=None)


def log_access(scope: dict, exchange: Exchange, seconds: float) -> None:
    """Write the access line of one served request (`scope`: its ASGI scope)."""
    level = logging.DEBUG if scope["path"] in PROBES else logging.INFO
    if not access_log.isEnabledFor(level):
        return
    client = scope.get("client")
    tokens = ""
    if exchange.decoder is not None:
        tokens = (
            f" decoder={exchange.decoder} prompt_tokens={exchange.prompt_tokens}"
            f" completion_tokens={exchange.completion_tokens}"
        )
    access_log.log(
        level,
        '%s "%s %s" %s%s %.3fs',
        client[0] if client else "-",
        scope["method"],
        scope["path"],
        exchange.status if exchange.status is not None else "-",
        tokens,
        seconds,
    )


class Counts(Protocol):
    """What the edge counts into (`registry.Metrics`, whose trackers import this module)."""

    def received(self) -> None: ...

    def rejected(self, reason: str) -> None: ...


# HTTP status of a refused generation request -> rejection reason.
STATUS_REASONS = {400: "validation", 404: "validation", 413: "validation", 422: "validation",
                  401: "auth", 429: "queue_full", 500: "internal", 503: "unavailable",
                  504: "deadline"}  # fmt: skip
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class MetricsMiddleware:
    """ASGI middleware: counts generation requests received and refused (by status code), and
    writes the access line of every request.

    Sits outside authentication so that 401s are seen. `get_metrics` may return None (no
    metrics: nothing is counted). Probes (/health, /metrics, every few seconds from
    orchestrators and Prometheus) are logged at debug only.
    """

    def __init__(self, app: Any, get_metrics: Callable[[], Counts | None]) -> None:
        self.app = app
        self.get_metrics = get_metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        metrics = self.get_metrics()
        counted = metrics is not None and scope["path"] in GENERATION_PATHS
        if counted:
            metrics.received()
        exchange = Exchange()
        token = current_exchange.set(exchange)

        async def send_counting(message: dict) -> None:
            if message["type"] == "http.response.start":
                exchange.status = message["status"]
                reason = STATUS_REASONS.get(message["status"])
                if counted and reason is not None and not exchange.admitted:
                    metrics.rejected(reason)
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        finally:
            current_exchange.reset(token)
            log_access(scope, exchange, time.perf_counter() - start)
