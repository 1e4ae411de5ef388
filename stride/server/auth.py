"""Bearer-token check for every route but the probes, compared in constant time."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from stride.server.errors import APIError


class APIKeyMiddleware:
    """Requires `Authorization: Bearer <key>`; `/health` (and `/metrics` unless asked) are open."""

    def __init__(self, app: ASGIApp, api_key: str, protect_metrics: bool = False) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._open = {"/health"} | (set() if protect_metrics else {"/metrics"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open:
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if not hmac.compare_digest(given, self._expected):
            error = APIError(
                "invalid_api_key", "missing or invalid API key (Authorization: Bearer)"
            )
            error.headers["WWW-Authenticate"] = "Bearer"
            return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)
