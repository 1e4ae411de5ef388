"""Keeping the engine up: restarts after it dies, a budget for them, and a watchdog.

The engine dies when its step loop raises (a fault no request can be blamed for: see
`core`), or when its process exits (a crash, `kill -9`, the OOM killer). Whoever owns it (the
thread-mode client, the process-mode client, or the `--api-servers` supervisor) answers the
requests in flight with `engine_dead` at once and starts a fresh engine after a backoff: 0.5 s,
then twice as long after each restart of the last `restart_window` seconds (30 s at most). More
than `max_restarts` restarts in that window mean a fault that restarts do not fix: the owner
gives up and the server exits non-zero, so that its orchestrator replaces it.

The watchdog covers a hung engine, which nothing else notices (a step that never returns, a
stopped process): with requests in flight and no engine step for `watchdog_timeout` seconds,
`/health` answers 503 until the engine steps again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0


@dataclass
class SupervisionConfig:
    max_restarts: int = 5  # restarts allowed within `restart_window`; one more gives up
    restart_window: float = 300.0  # seconds
    watchdog_timeout: float = 30.0  # seconds without a step, with requests in flight: stuck


class RestartBudget:
    """When to restart the engine next (backoff), or that the budget is spent."""

    def __init__(
        self, config: SupervisionConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.clock = clock
        self._restarts: list[float] = []  # when each restart of the window began

    def next_delay(self) -> float | None:
        """Seconds to wait before the next restart (counting it), or None: give up."""
        now = self.clock()
        window = self.config.restart_window
        self._restarts = [t for t in self._restarts if now - t < window]
        if len(self._restarts) >= self.config.max_restarts:
            return None
        delay = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** len(self._restarts))
        self._restarts.append(now)
        return delay

    def describe(self) -> str:
        return (
            f"{self.config.max_restarts} restarts within {self.config.restart_window:.0f} s "
            "did not keep it up"
        )
