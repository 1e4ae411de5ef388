"""Stepped concurrency: 1, 2, 4, … users, each step held for a fixed time, then stop.

Users tag every request with the step it started in. The shape runs on the master (or the only
process); in a distributed run it tells the workers about each new step with a custom message.
"""

from __future__ import annotations

import logging
import time

from locust import LoadTestShape
from locust.runners import MasterRunner

from loadtest.stats import StepWindow, parse_steps

STEP_MESSAGE = "stride_step"
log = logging.getLogger("stride.loadtest")

_current_step = 0  # this process's view of the running step (set by the shape or a message)


def current_step() -> int:
    return _current_step


def set_step(index: int) -> None:
    global _current_step
    _current_step = index


class StepShape(LoadTestShape):
    """Holds each concurrency of `--steps` for `--hold` seconds; records when each step ran."""

    def __init__(self) -> None:
        super().__init__()
        self.windows: list[StepWindow] = []

    def tick(self) -> tuple[int, float] | None:
        options = self.runner.environment.parsed_options
        steps, hold = parse_steps(options.steps), float(options.hold)
        index = int(self.get_run_time() // hold)
        if index >= len(steps):
            self.close()
            return None
        if not self.windows or self.windows[-1].index != index:
            self._enter(index, steps)
        users = steps[index]
        return users, float(users)  # spawn a step's new users within about a second

    def _enter(self, index: int, steps: list[int]) -> None:
        now = time.time()
        if self.windows:
            self.windows[-1].end = now
        self.windows.append(StepWindow(index=index, users=steps[index], start=now))
        set_step(index)
        if isinstance(self.runner, MasterRunner):
            self.runner.send_message(STEP_MESSAGE, index)
        log.info("step %d/%d: %d concurrent users", index + 1, len(steps), steps[index])

    def close(self) -> None:
        """End the last step's window (idempotent)."""
        if self.windows and self.windows[-1].end is None:
            self.windows[-1].end = time.time()
