"""Whether a peer's process is there, from what its connection says rather than from how late its messages are.

A peer that is busy (a long engine step, a CPU prefill holding the interpreter, a host whose cores are all
taken) sends its reports late, but its ZeroMQ I/O thread, which runs without Python's GIL, still answers
ZMTP keepalives. A peer whose process died closes its TCP connections at once (the kernel does it); a frozen
process or an unreachable host stops answering keepalives and the connection is dropped after
``timeout_s``. So a watched connection tells "gone" from "slow": the manager and the proxies mark an instance
dead when its connection goes down, not when its heartbeat is late.

A dropped connection is not yet a dead peer. When a whole machine stalls (a virtual machine whose host
throttles it once it has used its CPU quota: every thread in it stops for seconds, and the observer's own
keepalive timer expires the moment it runs again), the connection is dropped although the peer is there.
ZeroMQ reconnects at once; so a drop becomes ``DOWN`` only when the reconnection is refused (the peer's
process is gone: its port is closed) or has not completed a handshake within ``timeout_s`` (the host is
unreachable, or the peer's process is frozen). A reconnection that completes keeps the link ``UP``.

``LinkWatch`` sets the keepalive options on a connecting socket and follows its monitor events: a link is
``UP`` once a handshake succeeded, ``DOWN`` after a disconnect that no reconnection healed, ``UNKNOWN``
before its first handshake (a peer that could never be reached, or whose keys refuse us: callers then fall
back to silence rules).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from daemons.clock import Clock

log = logging.getLogger("llumnix.links")

UP, DOWN, UNKNOWN = "up", "down", "unknown"
# A reconnection window's timer that ran this late found our own process (or machine) stalled: the events that
# came in meanwhile (a completed reconnection, say) are handled before it decides, within REGRACE_S.
LATE_S = 0.25
REGRACE_S = 1.0
_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
           | zmq.EVENT_MONITOR_STOPPED)


@dataclass
class _Drop:
    """An UP link reconnecting since a drop."""

    since: float
    timer: asyncio.TimerHandle  # makes it DOWN when no reconnection has completed
    retries: int = 0  # reconnections ZeroMQ scheduled since the drop


class LinkWatch:
    """The connection state of each watched peer, by key (an address)."""

    def __init__(self, timeout_s: float, on_change: Callable[[str, str], None] | None = None,
                 on_heal: Callable[[str], None] | None = None, clock: Clock | None = None):
        """``on_change(key, state)``: a link's state changed; ``on_heal(key)``: a drop that a reconnection
        healed (the state stayed UP); ``clock``: its owner's (default: the real one)."""
        self.clock = clock or Clock()
        self.timeout_s = timeout_s
        self.on_change = on_change
        self.on_heal = on_heal
        self._state: dict[str, str] = {}
        self._since: dict[str, float] = {}
        self._tasks: dict[str, tuple[zmq.Socket, asyncio.Task]] = {}
        self._dropped: dict[str, _Drop] = {}
        self.came_back = 0  # drops that a reconnection healed

    def prepare(self, sock: zmq.Socket) -> zmq.Socket:
        """Keepalives on ``sock`` (before it connects): a ping every third of the timeout; no answer to
        any traffic for ``timeout_s`` drops the connection."""
        ms = max(int(self.timeout_s * 1000), 30)
        sock.setsockopt(zmq.HEARTBEAT_IVL, max(ms // 3, 10))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ms)
        return sock

    def watch(self, key: str, sock: zmq.Socket) -> None:
        """Follow ``sock``'s connection (a socket made by a zmq.asyncio context, prepared, and connected
        only after this: a handshake before the monitor starts would go unseen). A key watched again
        replaces the old watch."""
        self.forget(key)
        mon = sock.get_monitor_socket(_EVENTS)
        self._state[key] = UNKNOWN
        self._since[key] = self.clock.monotonic()
        self._tasks[key] = (sock, asyncio.get_running_loop().create_task(self._follow(key, mon)))

    def state(self, key: str) -> str:
        return self._state.get(key, UNKNOWN)

    def down_for(self, key: str, now: float | None = None) -> float:
        """Seconds the link has been down (0 unless it is DOWN)."""
        if self._state.get(key) != DOWN:
            return 0.0
        return (self.clock.monotonic() if now is None else now) - self._since.get(key, 0.0)

    def forget(self, key: str) -> None:
        self._undrop(key)
        entry = self._tasks.pop(key, None)
        self._state.pop(key, None)
        self._since.pop(key, None)
        if entry is not None:
            sock, task = entry
            task.cancel()
            if not sock.closed:
                try:
                    sock.disable_monitor()
                except zmq.ZMQError:
                    pass

    def close(self) -> None:
        for key in list(self._tasks):
            self.forget(key)

    def _set(self, key: str, state: str) -> None:
        if self._state.get(key) == state:
            return
        self._state[key] = state
        self._since[key] = self.clock.monotonic()
        if self.on_change is not None:
            self.on_change(key, state)

    def _undrop(self, key: str) -> float | None:
        """End ``key``'s reconnection window; when it had one, the time it began."""
        drop = self._dropped.pop(key, None)
        if drop is None:
            return None
        drop.timer.cancel()
        return drop.since

    def _down(self, key: str, why: str) -> None:
        if self._undrop(key) is not None:
            log.info("connection to %s dropped and %s", key, why)
            self._set(key, DOWN)

    def _expire(self, key: str, due: float) -> None:
        drop = self._dropped.get(key)
        if drop is None:
            return
        if self.clock.monotonic() - due > LATE_S:
            # We were stalled ourselves: what arrived meanwhile is read first (this runs before it).
            grace = min(self.timeout_s, REGRACE_S)
            drop.timer = self.clock.call_later(grace, self._expire, key, self.clock.monotonic() + grace)
            return
        self._down(key, f"no reconnection completed within {(self.clock.monotonic() - drop.since):.1f}s")

    async def _follow(self, key: str, mon) -> None:
        try:
            while True:
                event = parse_monitor_message(await mon.recv_multipart())["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    since = self._undrop(key)
                    if since is not None:
                        self.came_back += 1
                        log.warning("connection to %s dropped (no keepalive answer for %gs) and came back after "
                                    "%.0f ms: its process is there (this host or the peer's stalled)", key,
                                    self.timeout_s, (self.clock.monotonic() - since) * 1000)
                        if self.on_heal is not None:
                            self.on_heal(key)
                    self._set(key, UP)
                elif event == zmq.EVENT_DISCONNECTED:
                    # Before any handshake a refused or failed connection says nothing of the peer's process.
                    if self._state.get(key) == UP and key not in self._dropped:
                        now = self.clock.monotonic()
                        self._dropped[key] = _Drop(now, self.clock.call_later(self.timeout_s, self._expire, key,
                                                                        now + self.timeout_s))
                elif event == zmq.EVENT_CONNECT_RETRIED and key in self._dropped:
                    # ZeroMQ says so when it schedules a reconnection: once right after the drop, then again
                    # after each attempt that failed.
                    drop = self._dropped[key]
                    drop.retries += 1
                    if drop.retries > 1:
                        self._down(key, "the reconnection was refused (nothing listens there)")
                elif event == zmq.EVENT_MONITOR_STOPPED:
                    return
        except (asyncio.CancelledError, zmq.ZMQError):
            pass
        finally:
            mon.close(0)
