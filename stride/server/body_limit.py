"""A bound on request bodies: 413 before the rest of a body over the limit is read."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stride.server.errors import APIError


class BodyLimit:
    """413 for a body over `limit` bytes, without reading the rest of it: at once if its
    Content-Length says so, else as soon as what was read passes the limit."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await self._too_large().response()(scope, receive, send)
        seen = 0

        async def bounded() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # (FastAPI passes an HTTPException on as it is)
                    raise HTTPException(413, self._too_large().message)
            return message

        await self.app(scope, bounded, send)

    def _too_large(self) -> APIError:
        return APIError(
            "request_too_large",
            f"the request body is larger than {self.limit} bytes (--max-request-body)",
        )
