"""The HTTP edge's count of requests received and refused, and the access line of each.

A refused generation request is counted by its status code here. A request that was admitted
(its tracker saw an output) and failed later is counted by its tracker as finished with `error`,
and a deadline that passed once the request was admitted by its tracker too (which also sees
deadlines that end a stream after its 200); one that passed before, by its 504 here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from stride.metrics.access import Exchange, current_exchange, log_access
from stride.metrics.registry import Metrics

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

    def __init__(self, app: Any, get_metrics: Callable[[], Metrics | None]) -> None:
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
