"""Whether a peer's process is there, from what its connection says rather than from how late its messages are.

A peer that is busy (a long engine step, a CPU prefill holding the interpreter, a host whose cores are all
taken) sends its reports late, but its ZeroMQ I/O thread, which runs without Python's GIL, still answers
ZMTP keepalives. A peer whose process died closes its TCP connections at once (the kernel does it); a frozen
process or an unreachable host stops answering keepalives and the connection is dropped after
``timeout_s``. So a watched connection tells "gone" from "slow": the manager and the proxies mark an instance
dead when its connection goes down, not when its heartbeat is late.

``LinkWatch`` sets the keepalive options on a connecting socket and follows its monitor events: a link is
``UP`` once a handshake succeeded, ``DOWN`` after a disconnect, ``UNKNOWN`` before its first handshake (a
peer that could never be reached, or whose keys refuse us: callers then fall back to silence rules).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("llumnix.links")

UP, DOWN, UNKNOWN = "up", "down", "unknown"
_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED


class LinkWatch:
    """The connection state of each watched peer, by key (an address)."""

    def __init__(self, timeout_s: float, on_change: Callable[[str, str], None] | None = None):
        self.timeout_s = timeout_s
        self.on_change = on_change
        self._state: dict[str, str] = {}
        self._since: dict[str, float] = {}
        self._tasks: dict[str, tuple[zmq.Socket, asyncio.Task]] = {}

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
        self._since[key] = time.monotonic()
        self._tasks[key] = (sock, asyncio.get_running_loop().create_task(self._follow(key, mon)))

    def state(self, key: str) -> str:
        return self._state.get(key, UNKNOWN)

    def down_for(self, key: str, now: float | None = None) -> float:
        """Seconds the link has been down (0 unless it is DOWN)."""
        if self._state.get(key) != DOWN:
            return 0.0
        return (time.monotonic() if now is None else now) - self._since.get(key, 0.0)

    def forget(self, key: str) -> None:
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
        self._since[key] = time.monotonic()
        if self.on_change is not None:
            self.on_change(key, state)

    async def _follow(self, key: str, mon) -> None:
        try:
            while True:
                event = parse_monitor_message(await mon.recv_multipart())["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._set(key, UP)
                elif event == zmq.EVENT_DISCONNECTED:
                    # Before any handshake a refused or failed connection says nothing of the peer's process.
                    if self._state.get(key) == UP:
                        self._set(key, DOWN)
                elif event == zmq.EVENT_MONITOR_STOPPED:
                    return
        except (asyncio.CancelledError, zmq.ZMQError):
            pass
        finally:
            mon.close(0)
