"""Server-sent events as the generation routes write them: `data: <json>` per event (a chunk,
or an error once a stream has started), and `data: [DONE]` last."""

from __future__ import annotations

import json

from stride.server.errors import APIError

DONE = "data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MEDIA_TYPE = "text/event-stream"


def event(data: str) -> str:
    """One event carrying `data` (JSON text)."""
    return f"data: {data}\n\n"


def error_event(error: APIError) -> str:
    """The event that ends a stream which failed after its 200 (then comes `DONE`)."""
    return event(json.dumps(error.body(), separators=(",", ":")))
