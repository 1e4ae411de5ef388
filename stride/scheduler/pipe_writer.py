"""Messages down a pipe, sent from a thread of their own.

An engine process that stopped reading (hung, or stopped by SIGSTOP) fills its pipe; a send
then blocks. Here that blocks this thread, never the event loop that puts the message.
"""

from __future__ import annotations

import queue
import threading
from multiprocessing.connection import Connection
from typing import Any


class PipeWriter:
    """Sends what is `put` down `conn`, in order, until `close`."""

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
