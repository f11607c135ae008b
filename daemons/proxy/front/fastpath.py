"""The completion routes without FastAPI: POST /v1/completions and /v1/chat/completions as a raw ASGI app in
front of the FastAPI app, which serves every other request (and these two when ``proxy.fast_path = false``).

Per request FastAPI's way costs a router match, Starlette's Request, four middlewares wrapping ``send``, and
for a stream a task group with a task that listens for the client's disconnect; here the request is read
and answered by ``send`` itself, and a stream has one watcher that cancels it if the client goes away. Both
ways run the same request logic (``Proxy.handle`` in daemons/proxy/service.py, which takes a ``Call`` and
returns a ``Reply``, daemons/proxy/front/call.py) and answer with the same status, headers and bytes. API keys, the
body size limit, the request counts and the access line of a refused request are decided by one guard for
both (daemons/proxy/front/guard.py); the OpenAI error bodies and x-request-id behave alike
(tests/unit/test_proxy_fastpath.py compares them).
"""

from __future__ import annotations

import asyncio
import logging

from daemons import metrics
from daemons.clock import Clock
from daemons.proxy.front.apikeys import Principal
from daemons.proxy.front.call import Call, Headers, Reply, error_reply
from daemons.proxy.front.guard import COMPLETIONS
from daemons.proxy.api.protocol import ApiError

log = logging.getLogger("llumnix.proxy")
M_SLOW_READERS = metrics.counter("proxy", "llumnix_proxy_slow_readers_total",
                                 "Streamed requests aborted because their client read nothing for "
                                 "proxy.write_timeout_s (their connection is closed)")

__all__ = ["M_SLOW_READERS", "Call", "FastPath", "Reply"]

ROUTES = COMPLETIONS  # path -> chat
SSE_TYPE = "text/event-stream; charset=utf-8"  # as Starlette's StreamingResponse names it
JSON_TYPE = "application/json"
_DONE = b"data: [DONE]\n\n"


class _FastCall(Call):
    """A Call whose client is watched by one task for the whole request (not two tasks and a wait per
    phase): while ``guarded``, the client's leaving cancels the request's task, which takes it as the client
    gone (``gone``) and stops."""

    __slots__ = ("task", "watcher", "guarded", "gone", "writing", "slow")

    def __init__(self, headers, principal: Principal | None, receive, read):
        super().__init__(headers, principal, receive, read)
        self.task = asyncio.current_task()
        self.watcher: asyncio.Future | None = None
        self.guarded = False
        self.gone = False
        self.writing = 0.0  # clock time a write began that has not returned (its client reads nothing), or 0
        self.slow = False  # cancelled for that: its client read nothing for proxy.write_timeout_s

    def watch(self) -> None:
        if self.watcher is None:
            self.watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        # uvicorn answers http.disconnect once the client left or the response is complete
        while (await self.receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        if self.guarded:
            self.task.cancel()

    def stop_watching(self) -> None:
        # Not cancelled: the watcher ends by itself once the response is complete (uvicorn then answers
        # http.disconnect), and a cancelled one would leave a reference cycle (its CancelledError's traceback
        # holds this call) for the garbage collector, per request.
        self.guarded = False
        self.watcher = None

    async def unless_disconnected(self, coro):
        if self.gone:
            coro.close()
            return None
        self.watch()
        self.guarded = True
        try:
            return await coro
        except asyncio.CancelledError:
            if not self.gone:
                raise
            self.task.uncancel()  # the cancel was ours: the client left
            return None
        finally:
            self.guarded = False


class FastPath:
    """ASGI app: the completion routes here, everything else to ``app`` (FastAPI). Receives the app, the
    proxy (its request logic ``handle`` and its guard), the write timeout and the clock that times writes."""

    def __init__(self, app, proxy, max_body_bytes: int | None = None, write_timeout_s: float = 0.0,
                 clock: Clock | None = None):
        """``max_body_bytes``: another body limit than the proxy's guard has (None: the guard's)."""
        self.app = app
        self.proxy = proxy
        self.guard = proxy.guard if max_body_bytes is None else proxy.guard.with_limit(max_body_bytes)
        self.clock = clock or proxy.clock
        self.write_timeout_s = write_timeout_s  # 0: none
        self.streaming: set[_FastCall] = set()
        self._writes_watched: asyncio.Task | None = None

    async def __call__(self, scope, receive, send):
        chat = ROUTES.get(scope.get("path")) if scope["type"] == "http" and scope["method"] == "POST" else None
        if chat is None:
            return await self.app(scope, receive, send)
        path = scope["path"]
        headers = Headers(scope["headers"])
        call = None
        try:
            principal = self.guard.check(path, headers.get("authorization"), headers.get("content-length"))
        except ApiError as exc:  # refused before the request is read: still one access line and count
            self.guard.refused(path, exc.status)
            return await self._write(send, error_reply(exc, None))
        call = _FastCall(headers, principal, receive, lambda: self.guard.read_body(receive))
        try:
            try:
                reply = await self.proxy.handle(call, chat)
            except ApiError as exc:
                if exc.status >= 500:
                    log.warning("%s failed: %s", path, exc.message)
                return await self._answer(send, path, error_reply(exc, call.echo_id))
            except Exception as exc:
                log.exception("%s: internal error", path)
                return await self._answer(send, path, error_reply(
                    ApiError(500, f"internal error: {type(exc).__name__}: {exc}"), call.echo_id))
            if reply.stream is None:
                return await self._answer(send, path, reply)
            self.guard.count(path, 200)
            await self._stream(call, send, reply)
        finally:
            call.stop_watching()

    async def _answer(self, send, path: str, reply: Reply) -> None:
        self.guard.count(path, reply.status)
        await self._write(send, reply)

    @staticmethod
    async def _write(send, reply: Reply) -> None:
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers.items()]
        raw.append((b"content-length", str(len(reply.body)).encode()))
        if reply.body:  # (an empty one: 499, the client went away)
            raw.append((b"content-type", JSON_TYPE.encode()))
        await send({"type": "http.response.start", "status": reply.status, "headers": raw})
        await send({"type": "http.response.body", "body": reply.body})

    async def _stream(self, call: _FastCall, send, reply: Reply) -> None:
        """Write the SSE chunks as they come, one write each (the last one with the end of the body); a client
        that leaves cancels the stream."""
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in reply.headers.items()]
        raw.append((b"content-type", SSE_TYPE.encode()))
        body = reply.stream
        if call.gone:  # the generator never runs: its finalizer ends the request (Proxy._abandoned)
            return
        call.watch()
        call.guarded = True
        clock = self.clock
        if self.write_timeout_s:
            self.streaming.add(call)
            if self._writes_watched is None or self._writes_watched.done():
                self._writes_watched = asyncio.ensure_future(self._watch_writes())
        try:
            call.writing = clock.monotonic()
            await send({"type": "http.response.start", "status": 200, "headers": raw})
            call.writing = 0.0
            async for chunk in body:
                call.writing = clock.monotonic()
                if chunk.endswith(_DONE):  # the stream's last event: the response ends with it
                    call.guarded = False
                    await send({"type": "http.response.body", "body": chunk, "more_body": False})
                else:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                call.writing = 0.0
            if call.guarded:
                call.guarded = False
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if call.slow:  # ours: the client read nothing for write_timeout_s; the server closes the connection
                call.task.uncancel()
                if reply.job is not None:
                    reply.job.status = 408
                M_SLOW_READERS.inc()
                log.warning("%s: the client read nothing for %gs (proxy.write_timeout_s): request aborted, "
                            "connection closed", reply.job.id if reply.job is not None else "a stream",
                            self.write_timeout_s)
            elif not call.gone:
                raise
            else:
                call.task.uncancel()  # the client left: the stream's end is logged (499); nothing to tell the server
        finally:
            call.guarded = False
            call.writing = 0.0
            self.streaming.discard(call)
            await body.aclose()  # runs its cleanup now (the request's abort, its access line), if not yet run

    async def _watch_writes(self) -> None:
        """While streams are being written: cancel those whose write has waited past write_timeout_s (a
        client that reads nothing: its socket's buffers are full, and its tokens would pile up here)."""
        period = min(self.write_timeout_s / 4, 1.0)
        while self.streaming:
            await self.clock.sleep(period)
            now = self.clock.monotonic()
            for call in list(self.streaming):
                if call.writing and now - call.writing > self.write_timeout_s and not call.slow:
                    call.slow = True
                    call.task.cancel()
