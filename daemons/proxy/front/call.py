"""What the request logic (``Proxy.handle``, daemons/proxy/service.py) reads of an HTTP request and returns,
whichever way it came in (the fast path, daemons/proxy/front/fastpath.py, or FastAPI's routes, daemons/proxy/app.py):
a ``Call`` in, a ``Reply`` out."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable

import msgspec

from daemons.proxy.front.apikeys import Principal
from daemons.proxy.api.protocol import ApiError

_json = msgspec.json.encode


class Call:
    """What the completion logic reads of an HTTP request, whichever way it came in."""

    __slots__ = ("headers", "principal", "receive", "read", "echo_id")

    def __init__(self, headers, principal: Principal | None, receive, read: Callable[[], Awaitable[bytes]]):
        self.headers = headers  # .get(lower-case name) -> str | None
        self.principal = principal  # its API key's owner (proxy.api_keys_file), or None
        self.receive = receive  # the ASGI receive: a non-streamed request watches it for the client leaving
        self.read = read  # the body
        self.echo_id: str | None = None  # the client's valid x-request-id: echoed in every answer

    async def unless_disconnected(self, coro):
        """``await coro``, or None as soon as the client disconnects (a non-streaming request's handler is
        not cancelled by the server when its client leaves, so without this it would wait out the request)."""
        async def disconnected() -> None:
            while (await self.receive())["type"] != "http.disconnect":
                pass

        work = asyncio.ensure_future(coro)
        gone = asyncio.ensure_future(disconnected())
        try:
            done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if work in done:
            return work.result()
        work.cancel()
        return None


class Reply:
    """A completion's answer: a JSON body (bytes), or an SSE ``stream`` of byte chunks; ``job`` ends it."""

    __slots__ = ("status", "body", "headers", "stream", "job")

    def __init__(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
                 stream: AsyncIterator[bytes] | None = None, job=None):
        self.status, self.body, self.headers, self.stream, self.job = status, body, headers or {}, stream, job


class Headers:
    """An ASGI scope's headers, looked up by lower-case name (the first of a repeated one, as Starlette)."""

    __slots__ = ("raw",)

    def __init__(self, raw: list[tuple[bytes, bytes]]):
        self.raw = raw

    def get(self, name: str, default: str | None = None) -> str | None:
        key = name.encode()
        for k, v in self.raw:
            if k == key:
                return v.decode("latin-1")
        return default


def error_reply(exc: ApiError, echo_id: str | None) -> Reply:
    headers = dict(getattr(exc, "headers", None) or {})
    if echo_id:
        headers["x-request-id"] = echo_id
    return Reply(exc.status, _json(exc.body()), headers)
