"""The HTTP front's one guard, for the completion routes' fast path (daemons/proxy/front/fastpath.py) and the
framework's routes (FastAPI, daemons/proxy/app.py) alike: who presents which API key (proxy.api_keys_file),
whether a body is within proxy.max_body_bytes (by its Content-Length, or counted as it arrives, so that no
larger body is ever held in memory), and the request counts (``llumnix_proxy_requests_total``) with the
access line of a request refused before its route runs."""

from __future__ import annotations

from typing import Awaitable, Callable

from daemons import metrics
from daemons.proxy.front.access import AccessLog
from daemons.proxy.front.apikeys import ApiKeys, Principal
from daemons.proxy.api.openapi import needs_key
from daemons.proxy.api.protocol import ApiError

M_REQUESTS = metrics.P_REQUESTS  # defined in daemons/metrics.py

COMPLETIONS = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> chat
BODY_ROUTES = (*COMPLETIONS, "/tokenize", "/detokenize")  # a refusal before their route runs is counted too


class Guard:
    """Receives the API keys (None: none needed), the body limit and the access log."""

    def __init__(self, keys: ApiKeys | None, max_body_bytes: int, access: AccessLog):
        self.keys = keys
        self.limit = max_body_bytes
        self.access = access
        self._ok = {path: M_REQUESTS.labels(path, "200") for path in BODY_ROUTES}

    def with_limit(self, max_body_bytes: int) -> "Guard":
        """The same keys, counts and log with another body limit."""
        return Guard(self.keys, max_body_bytes, self.access)

    def check(self, path: str, authorization: str | None, content_length: str | None) -> Principal | None:
        """Before a request's route runs: its key's owner (None where no key is needed); raises ApiError
        (401 for a missing or wrong key, 413 for a declared length past the limit)."""
        principal = None
        if self.keys is not None and needs_key(path):
            principal = self.keys.check(authorization)
        if content_length is not None and content_length.strip().isdigit() and int(content_length) > self.limit:
            raise self.too_large()
        return principal

    def too_large(self) -> ApiError:
        return ApiError(413, f"Request body too large: this proxy accepts at most {self.limit} bytes "
                             f"(proxy.max_body_bytes).", type_="invalid_request_error", code="request_too_large")

    def count(self, route: str, status: int) -> None:
        """One answered request of ``route`` (the route's path, never the raw path)."""
        ok = self._ok.get(route) if status == 200 else None
        (ok if ok is not None else M_REQUESTS.labels(route, str(status))).inc()

    def refused(self, path: str, status: int) -> None:
        """A request refused before its route ran (its body unread): completion and chat requests get their
        access line and count, the other body routes their count, as when a route refuses them."""
        if path in BODY_ROUTES:
            self.count(path, status)
        chat = COMPLETIONS.get(path)
        if chat is not None:
            self.access.write(None, chat, self.access.now(), status)

    def limited(self, receive: Callable[[], Awaitable[dict]]) -> Callable[[], Awaitable[dict]]:
        """An ASGI ``receive`` that raises 413 once the body grows past the limit (a chunked body, or one
        longer than it said)."""
        received = 0

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise self.too_large()
            return message

        return limited_receive

    async def read_body(self, receive: Callable[[], Awaitable[dict]]) -> bytes:
        """The whole request body, refused (413) as soon as it grows past the limit: never held whole if
        larger. The pieces are joined once at the end (adding each to the whole would copy it again per
        piece: quadratic, ~0.5 GB of copying on the event loop for one 8 MiB body)."""
        pieces: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # http.disconnect
                raise ApiError(499, "the client went away before sending its whole body")
            piece = message.get("body", b"")
            if piece:
                pieces.append(piece)
                size += len(piece)
            if size > self.limit:  # a chunked body, or one longer than it said
                raise self.too_large()
            if not message.get("more_body", False):
                return pieces[0] if len(pieces) == 1 else b"".join(pieces)
