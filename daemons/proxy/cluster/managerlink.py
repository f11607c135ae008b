"""The proxy's link to the manager: queries and their answers, the snapshot poll, and what we tell it (our
dispatches), batched per loop turn."""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Callable

import zmq.asyncio

from daemons import runtime, wire
from daemons.clock import Clock
from daemons.proxy.cluster.telemetry import M_BAD_FRAMES

log = logging.getLogger("llumnix.proxy")


class ManagerLink:
    """Owns the queries in flight on the manager's socket and the messages due at the end of this loop turn.
    Receives the socket, the clock, the snapshot interval, ``token_address`` (ours, once bound) and
    ``on_snapshot`` (each snapshot, once we hold it)."""

    def __init__(self, sock: zmq.asyncio.Socket, clock: Clock, snapshot_interval_s: float,
                 token_address: Callable[[], str], on_snapshot: Callable[[wire.Snapshot], None]):
        self.sock = sock
        self.clock = clock
        self.snapshot_interval_s = snapshot_interval_s
        self.token_address = token_address
        self.on_snapshot = on_snapshot
        self.asked_at = 0.0  # when we last asked for a snapshot (monotonic)
        self._queries: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._soon: list[wire.Message] = []  # for the manager at the end of this loop turn (tell_soon)

    def next_id(self) -> int:
        return next(self._ids)

    async def ask(self, msg, timeout: float):
        """Send a query and wait for its answer (None: not sent, or no answer within ``timeout``)."""
        fut = asyncio.get_running_loop().create_future()
        self._queries[msg.query_id] = fut
        try:
            if not runtime.send_now(self.sock, wire.encode(msg)):
                return None
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            return None
        finally:
            self._queries.pop(msg.query_id, None)

    async def receive(self) -> None:
        while True:
            msg = wire.decode(await self.sock.recv())
            try:
                if isinstance(msg, wire.Snapshot):
                    self.on_snapshot(msg)
                if isinstance(msg, (wire.DispatchReply, wire.Snapshot, wire.LoraReply, wire.ErrorReply)):
                    fut = self._queries.get(msg.query_id)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                elif msg is None:
                    M_BAD_FRAMES.inc()
            except Exception:  # this task is essential: one message must not end it (nor the proxy)
                M_BAD_FRAMES.inc()
                log.exception("a message from the manager broke its handler; dropped it")

    async def poll(self) -> None:
        """Ask for a snapshot every proxy.snapshot_interval_s."""
        while True:
            self.asked_at = self.clock.monotonic()
            await self.ask(wire.SnapshotQuery(self.next_id(), self.token_address()), self.snapshot_interval_s)
            await self.clock.sleep(self.snapshot_interval_s)

    def tell(self, msg: wire.Message) -> None:
        if not runtime.send_now(self.sock, wire.encode(msg)):
            log.debug("manager unreachable; it will not count a %s", type(msg).__name__)

    def tell_soon(self, msg: wire.Message) -> None:
        """Tell the manager at the end of this loop turn: the request itself goes out first, and the turn's
        messages go together. Every ZeroMQ send that finds the I/O thread asleep wakes it (tens of us on a
        loaded or virtual machine); sends in a row mostly find it awake."""
        if not self._soon:
            asyncio.get_running_loop().call_soon(self._flush_soon)
        self._soon.append(msg)

    def _flush_soon(self) -> None:
        soon, self._soon = self._soon, []
        for msg in soon:
            self.tell(msg)
