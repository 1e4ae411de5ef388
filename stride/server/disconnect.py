"""A client that goes away mid-request: its work is cancelled, and with it its engine requests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed the connection before the answer was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, or cancel it (which aborts its engine requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def client_gone(_: Request, __: Exception) -> Response:
    """The app's handler of ClientGone: nobody is listening (499: nginx's code for it)."""
    return Response(status_code=499)
