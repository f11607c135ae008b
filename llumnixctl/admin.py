"""A blocking client for the manager's admin socket."""

from __future__ import annotations

import itertools
import os
import threading
import time
import uuid

import zmq

from daemons import wire


_contexts: dict[str, zmq.Context] = {}
_contexts_lock = threading.Lock()


def _context() -> zmq.Context:
    """The process's ZeroMQ context, or one of the calling thread's own network namespace: a context's I/O
    threads connect from the namespace they started in, and tests and benchmarks put threads on other
    "hosts" (llumnixctl/lab/netns.py)."""
    try:
        here, main = os.readlink("/proc/thread-self/ns/net"), os.readlink("/proc/self/ns/net")
    except OSError:
        return zmq.Context.instance()
    if here == main:
        return zmq.Context.instance()
    with _contexts_lock:
        if here not in _contexts:
            _contexts[here] = zmq.Context()
        return _contexts[here]


class ManagerUnreachable(Exception):
    def __init__(self, message: str, refused: bool = False):
        super().__init__(message)
        self.refused = refused  # it answered the connection but refused our key (CURVE)


class AdminClient:
    def __init__(self, address: str, timeout_s: float = 2.0, sec=None):
        """``sec``: a daemons.security.Security for a cluster whose sockets use CURVE keys."""
        self.address = address
        self.timeout_s = timeout_s
        self.sec = sec
        self._ids = itertools.count(1)
        self._sock = None
        self._monitor = None

    @classmethod
    def for_settings(cls, address: str, config: str | None, sets: list[str], timeout_s: float = 2.0) -> "AdminClient":
        """A client with the keys of these settings (``--config`` file and ``--set`` overrides), if any."""
        from daemons.config import load_config
        from daemons.security import Security

        sc = load_config(config, sets).security
        return cls(address, timeout_s, sec=Security(sc, "llumnixctl") if sc.keys_dir else None)

    @classmethod
    def for_args(cls, address: str, args: list[str], timeout_s: float = 2.0) -> "AdminClient":
        """The same, from daemon arguments (``--config FILE``, ``--set section.key=value`` pairs)."""
        config = next((b for a, b in zip(args, args[1:]) if a == "--config"), None)
        sets = [b for a, b in zip(args, args[1:]) if a == "--set"]
        return cls.for_settings(address, config, sets, timeout_s)

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            self._sock = _context().socket(zmq.DEALER)  # of the network namespace it is used in
            self._sock.setsockopt(zmq.LINGER, 0)
            if self.sec is not None:
                self.sec.client(self._sock, "manager")
            # To say "key refused" or "the manager wants keys" rather than "no answer".
            # A name of its own: pyzmq's default (the socket's fd) is reused by the next socket, and a client
            # nobody closed still holds it, in this context, while it lives (in-process callers make many).
            self._monitor = self._sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                addr=f"inproc://llumnixctl-monitor-{uuid.uuid4().hex}")
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
        refused = self._refused()
        self.close()  # a late reply must not be mistaken for the next one
        if refused:
            raise ManagerUnreachable(refused, refused=True)
        raise ManagerUnreachable(f"the manager at {self.address} did not answer within {self.timeout_s:g}s")

    def _refused(self) -> str:
        """Why the manager refused our key or our connection, if it did (ZMTP handshake events).

        A CURVE manager that a client without keys reaches fails the handshake on the mechanism (PROTOCOL).
        On a loaded host it may also close the connection before we read its greeting (NO_DETAIL), and
        that can repeat on every reconnect: it counts too, as the least certain sign."""
        if self._monitor is None:
            return ""
        from zmq.utils.monitor import recv_monitor_message

        seen: set[int] = set()
        while self._monitor.poll(0):
            seen.add(recv_monitor_message(self._monitor)["event"])
        secured = self.sec is not None and self.sec.enabled
        if zmq.EVENT_HANDSHAKE_FAILED_AUTH in seen and secured:
            return (f"the manager at {self.address} refused our key {self.sec.name!r} (not among its allowed "
                    f"keys in security.keys_dir/public, or not a role that may connect)")
        if seen & {zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL}:
            return (f"the manager at {self.address} refused our connection: it uses CURVE keys; set "
                    f"security.keys_dir (and security.key) in the config given with --config"
                    if not secured else
                    f"the manager at {self.address} failed our CURVE handshake: does our "
                    f"security.keys_dir hold its public/manager.key?")
        if zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL in seen:
            return (f"the manager at {self.address} closed our connection during the handshake: most likely it "
                    f"uses CURVE keys; set security.keys_dir (and security.key) in the config given with --config "
                    f"(or the address is not a llumnix manager's)"
                    if not secured else
                    f"the manager at {self.address} closed our connection during the CURVE handshake: does our "
                    f"security.keys_dir hold its public/manager.key?")
        return ""

    def status(self) -> wire.Snapshot:
        return self.ask(wire.StatusQuery)

    def requests(self) -> wire.RequestsReply:
        return self.ask(wire.RequestsQuery)

    def sessions(self, limit: int = 0) -> wire.SessionsReply:
        return self.ask(lambda qid: wire.SessionsQuery(qid, limit))

    def migrate(self, dst: str, request_id: str = "", src: str = "", count: int = 1, blocking: bool = False) -> wire.MigrateReply:
        return self.ask(lambda qid: wire.MigrateQuery(qid, dst=dst, request_id=request_id, src=src, count=count,
                                                      blocking=blocking))

    def drain(self, instance_id: str, drain: bool = True, cordon_only: bool = False) -> wire.DrainReply:
        return self.ask(lambda qid: wire.DrainQuery(qid, instance_id, drain, cordon_only))

    def role(self, instance_id: str, role: str = "") -> wire.RoleReply:
        return self.ask(lambda qid: wire.RoleQuery(qid, instance_id, role))

    def remove(self, instance_id: str, timeout_s: float) -> wire.RemoveReply:
        return self.ask(lambda qid: wire.RemoveQuery(qid, instance_id, timeout_s))

    def add(self, count: int = 1, timeout_s: float = 0.0) -> wire.AddReply:
        return self.ask(lambda qid: wire.AddQuery(qid, count, timeout_s))

    def policy(self, **changes: str) -> wire.PolicyReply:
        return self.ask(lambda qid: wire.PolicyQuery(qid, **changes))

    def close(self) -> None:
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(0)
            self._monitor = None
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
