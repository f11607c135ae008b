"""A blocking client for the manager's admin socket."""

from __future__ import annotations

import itertools
import time

import zmq

from daemons import wire


class ManagerUnreachable(Exception):
    pass


class AdminClient:
    def __init__(self, address: str, timeout_s: float = 2.0):
        self.address = address
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._ctx = zmq.Context.instance()
        self._sock = None

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            try:
                self._sock.connect(self.address)
            except zmq.ZMQError as exc:
                self.close()
                raise ManagerUnreachable(f"bad manager address {self.address!r} ({exc}); expected e.g. tcp://127.0.0.1:7100") from None
        return self._sock

    def ask(self, make) -> wire.Message:
        """Send ``make(query_id)`` and wait for the reply with that id."""
        qid = next(self._ids)
        sock = self._socket()
        sock.send(wire.encode(make(qid)))
        deadline = time.monotonic() + self.timeout_s
        while sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            reply = wire.decode(sock.recv())
            if reply is not None and getattr(reply, "query_id", None) == qid:
                if isinstance(reply, wire.ErrorReply):
                    raise RuntimeError(reply.message)
                return reply
        self.close()  # a late reply must not be mistaken for the next one
        raise ManagerUnreachable(f"the manager at {self.address} did not answer within {self.timeout_s:g}s")

    def status(self) -> wire.Snapshot:
        return self.ask(wire.StatusQuery)

    def requests(self) -> wire.RequestsReply:
        return self.ask(wire.RequestsQuery)

    def migrate(self, dst: str, request_id: str = "", src: str = "", count: int = 1, blocking: bool = False) -> wire.MigrateReply:
        return self.ask(lambda qid: wire.MigrateQuery(qid, dst=dst, request_id=request_id, src=src, count=count,
                                                      blocking=blocking))

    def drain(self, instance_id: str, drain: bool = True, cordon_only: bool = False) -> wire.DrainReply:
        return self.ask(lambda qid: wire.DrainQuery(qid, instance_id, drain, cordon_only))

    def remove(self, instance_id: str, timeout_s: float) -> wire.RemoveReply:
        return self.ask(lambda qid: wire.RemoveQuery(qid, instance_id, timeout_s))

    def add(self, count: int = 1, timeout_s: float = 0.0) -> wire.AddReply:
        return self.ask(lambda qid: wire.AddQuery(qid, count, timeout_s))

    def policy(self, **changes: str) -> wire.PolicyReply:
        return self.ask(lambda qid: wire.PolicyQuery(qid, **changes))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
