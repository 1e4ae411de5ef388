"""The access line: one log line per HTTP request (`stride.access`), like vLLM's.

Method, path, status and latency come from the middleware; a generation request's decoder and
tokens from the request's tracker, which finds the exchange being served in `current_exchange`
(set by the middleware around each request). Probes (/health, /metrics, every few seconds from
orchestrators and Prometheus) are logged at debug only.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from dataclasses import dataclass

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
