"""Every failure leaves as OpenAI's error shape: `{"error": {message, type, param, code}}`.

Codes are strings a client can switch on; the HTTP status follows from them. FastAPI's 422 for
validation errors becomes a 400, as OpenAI answers; so does a body that is no JSON at all
(invalid UTF-8, nesting too deep for the parser), with code `invalid_request` as any other.
`internal_error` (500) is a bug in Stride: the request it hit failed, nothing else did.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from stride.decoders.base import DecoderError
from stride.scheduler.client import EngineDead
from stride.scheduler.outputs import EngineError, QueueFull, RequestRejected

log = logging.getLogger(__name__)

# code -> (HTTP status, OpenAI error type)
CODES: dict[str, tuple[int, str]] = {
    "invalid_request": (400, "invalid_request_error"),
    "invalid_decoder": (400, "invalid_request_error"),
    "context_length_exceeded": (400, "invalid_request_error"),
    "invalid_api_key": (401, "authentication_error"),
    "model_not_found": (404, "invalid_request_error"),
    "not_found": (404, "invalid_request_error"),
    "method_not_allowed": (405, "invalid_request_error"),
    "request_too_large": (413, "invalid_request_error"),
    "queue_full": (429, "rate_limit_error"),
    "internal_error": (500, "server_error"),
    "model_loading": (503, "service_unavailable"),
    "model_load_failed": (503, "service_unavailable"),
    "server_draining": (503, "service_unavailable"),
    "engine_dead": (503, "service_unavailable"),
    "deadline_exceeded": (504, "timeout_error"),
}


class APIError(Exception):
    def __init__(
        self,
        code: str,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.headers = headers or {}

    @property
    def status(self) -> int:
        return CODES.get(self.code, (500, ""))[0]

    def body(self) -> dict[str, Any]:
        kind = CODES.get(self.code, (500, "server_error"))[1]
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_exception(e: BaseException) -> APIError:
    """Map what the engine client and decoder registry raise onto API errors."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFull):
        return APIError("queue_full", str(e), headers={"Retry-After": str(e.retry_after)})
    if isinstance(e, RequestRejected):  # a 400, or a failure of Stride's own while admitting
        ok = e.code in CODES and CODES[e.code][0] in (400, 500)
        return APIError(e.code if ok else "invalid_request", str(e), e.param)
    if isinstance(e, DecoderError):
        return APIError("invalid_decoder", str(e), "decoder")
    if isinstance(e, EngineDead):
        return APIError("engine_dead", str(e), headers={"Retry-After": str(e.retry_after)})
    log.exception("unexpected error", exc_info=e)
    return APIError("internal_error", f"internal error: {type(e).__name__}")


def from_engine_error(error: EngineError) -> APIError:
    code = error.code if error.code in CODES else "internal_error"
    return APIError(code, error.message)


def _validation_error(exc: RequestValidationError) -> APIError:
    """The first thing wrong with a body, named by its field (`param`)."""
    errors = exc.errors()
    if not errors:
        return APIError("invalid_request", "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":  # its location is an offset into the body
        detail = first.get("ctx", {}).get("error", "JSON decode error")
        return APIError("invalid_request", f"the body is not valid JSON: {detail}")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if "[key]" in loc:  # a bad key of an object (logit_bias): name the object
        loc = loc[: loc.index("[key]") - 1]
    loc = [x for x in loc if not _union_tag(x)]
    param = ".".join(loc) or None
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    where = f"{param}: " if param else ""
    code = "invalid_decoder" if first.get("type") == "invalid_decoder" else "invalid_request"
    return APIError(code, f"{where}{first.get('msg', 'invalid value')}{more}", param)


def _union_tag(x: object) -> bool:
    """A step of an error's location that names the member of a union that was tried (`str`,
    `list[constrained-int]`), not a field: not part of `param`."""
    return isinstance(x, str) and (x in _SCALARS or "[" in x or "-" in x)


_SCALARS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})


def _unparsable(exc: HTTPException) -> APIError:
    """FastAPI's 400 for a body its JSON parser could not read (what it raised is the cause)."""
    cause = exc.__cause__
    if isinstance(cause, RecursionError):
        why = "it is nested too deeply"
    elif isinstance(cause, UnicodeDecodeError):
        why = "it is not valid UTF-8"
    elif cause is not None:
        why = f"{type(cause).__name__}"
    else:
        why = str(exc.detail)
    return APIError("invalid_request", f"the body could not be parsed as JSON: {why}")


def install(app: FastAPI) -> None:
    """Register the handlers that turn every exception into OpenAI's error shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 400:
            return _unparsable(exc).response()
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
            exc.status_code
        )
        if code is None:  # any other status Starlette may raise keeps its status
            error = APIError("invalid_request", str(exc.detail), headers=exc.headers)
            return JSONResponse(error.body(), status_code=exc.status_code, headers=error.headers)
        return APIError(code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return from_exception(exc).response()
