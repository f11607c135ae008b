"""An instance's links to the proxies it serves: the token path (one PUSH socket per proxy), what waits
when a proxy's queue is full, and whether each proxy is still there.

Nothing is dropped silently: a message that finds a proxy's queue full waits in that proxy's backlog, in
order, and goes out before anything newer. A proxy whose backlog outgrows ``max_backlog`` or that has not
been heard from (requests, ``ProxyAlive``) for ``orphan_timeout_s`` is gone: the instance aborts its
requests (``gone``), since nobody reads their tokens.
"""

from __future__ import annotations

import logging
from collections import deque

import msgspec
import zmq

from daemons import runtime, wire
from daemons.clock import Clock

log = logging.getLogger("llumnix.instance")


class _Link:
    __slots__ = ("sock", "backlog", "seen", "full_since")

    def __init__(self, sock: zmq.Socket, now: float):
        self.sock = sock
        self.backlog: deque[bytes] = deque()
        self.seen = now
        self.full_since = 0.0


class ProxyLinks:
    def __init__(self, ctx: zmq.Context, orphan_timeout_s: float, max_backlog: int = 10_000, sndhwm: int = 100_000,
                 secure=None, clock: Clock | None = None):
        """``clock``: when a proxy was last heard from (the instance's; virtual in tests/support)."""
        self.ctx = ctx
        self.clock = clock or Clock()
        self.secure = secure or (lambda sock: sock)  # CURVE: authenticate to the proxy's token socket
        self.orphan_timeout_s = orphan_timeout_s
        self.max_backlog = max_backlog
        self.sndhwm = sndhwm
        self.links: dict[str, _Link] = {}

    def _link(self, address: str) -> _Link:
        link = self.links.get(address)
        if link is None:
            sock = self.ctx.socket(zmq.PUSH, socket_class=zmq.Socket)  # send-only: plain sends never wait
            sock.setsockopt(zmq.LINGER, 2000)  # let the last tokens out on shutdown, but never hang
            sock.setsockopt(zmq.SNDHWM, self.sndhwm)
            self.secure(sock)
            sock.connect(address)
            link = self.links[address] = _Link(sock, self.clock.monotonic())
        return link

    def send(self, address: str, msg: wire.Message) -> None:
        link = self._link(address)
        frame = wire.encode(msg)
        if link.backlog and not self._flush(link):
            link.backlog.append(frame)
        elif not runtime.send_now(link.sock, frame):
            if not link.backlog:
                link.full_since = self.clock.monotonic()
                log.warning("token path to %s is full; holding its messages", address)
            link.backlog.append(frame)

    def _flush(self, link: _Link) -> bool:
        """Send what waits; True once nothing does."""
        while link.backlog:
            if not runtime.send_now(link.sock, link.backlog[0]):
                return False
            link.backlog.popleft()
        link.full_since = 0.0
        return True

    def flush(self) -> None:
        for link in self.links.values():
            if link.backlog:
                self._flush(link)

    def seen(self, address: str) -> None:
        """The proxy at ``address`` spoke to us (a request, ProxyAlive)."""
        self._link(address).seen = self.clock.monotonic()

    def broadcast(self, msg: wire.Message) -> None:
        """``msg`` to every proxy we know."""
        for address in list(self.links):
            self.send(address, msg)

    def heartbeat(self, msg: wire.Heartbeat, taken: dict[str, int] | None = None) -> None:
        """``msg`` to every proxy, each with the count of its own Submits we took in (``taken``)."""
        taken = taken or {}
        for address in list(self.links):
            n = taken.get(address, 0)
            self.send(address, msgspec.structs.replace(msg, taken=n) if n else msg)

    def gone(self, addresses: set[str]) -> list[tuple[str, str]]:
        """Of ``addresses`` (proxies with requests here, and the others we know), those that are gone, each with why."""
        now = self.clock.monotonic()
        out = []
        for address in addresses:
            link = self._link(address)
            if len(link.backlog) > self.max_backlog:
                out.append((address, f"its token path has been full since {now - link.full_since:.1f}s "
                                     f"({len(link.backlog)} messages waiting)"))
            elif now - link.seen > self.orphan_timeout_s:
                out.append((address, f"not heard from for {now - link.seen:.1f}s (instance.orphan_timeout_s)"))
        return out

    def drop(self, address: str) -> None:
        """Forget a gone proxy's backlog (its requests were aborted); a live one reconnects on next use."""
        link = self.links.pop(address, None)
        if link is not None:
            link.sock.close(0)

    def close(self) -> None:
        self.flush()
        for link in self.links.values():
            link.sock.close()  # with its linger: what was sent last still goes out
        self.links.clear()
