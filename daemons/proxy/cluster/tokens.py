"""The instance traffic: ``InstancePort`` sends requests, aborts and keepalives to the instances (one socket per
request address, each watched by daemons/links.py), ``receive`` takes tokens, heartbeats, moves and give-backs
in and hands each message to one handler (ClusterClient.on_instance_message)."""

from __future__ import annotations

import logging
from typing import Callable

import zmq
import zmq.asyncio

from daemons import runtime, security, wire
from daemons.links import LinkWatch
from daemons.proxy.cluster.telemetry import M_BAD_FRAMES

log = logging.getLogger("llumnix.proxy")


class InstancePort:
    """Owns the sockets to the instances (by request address: a restarted instance may move), their link
    watches and the address the instances send tokens to (``token_address``, bound by the cluster client's
    ``start``). Receives the ZeroMQ context, the security settings and the link watch."""

    def __init__(self, ctx: zmq.asyncio.Context, sec: security.Security, links: LinkWatch):
        self.ctx = ctx
        self.sec = sec
        self.links = links
        self.sockets: dict[str, zmq.Socket] = {}
        self.token_address = ""

    def send(self, address: str, msg: wire.Message) -> bool:
        sock = self.sockets.get(address)
        if sock is None:
            sock = runtime.tune(self.ctx.socket(zmq.DEALER, socket_class=zmq.Socket))  # send-only
            sock.setsockopt(zmq.SNDHWM, 100_000)
            self.sec.client(self.links.prepare(sock), "instance")
            self.links.watch(address, sock)  # before the connect: its handshake must not go unseen
            try:
                sock.connect(address)
            except zmq.ZMQError as exc:
                self.links.forget(address)
                sock.close(0)
                log.warning("cannot connect to instance address %r (%s); not sending it a %s", address, exc,
                            type(msg).__name__)
                return False
            self.sockets[address] = sock
        if not runtime.send_now(sock, wire.encode(msg)):
            log.warning("request path to %s is full; could not send a %s", address, type(msg).__name__)
            return False
        return True

    def greet(self, address: str) -> None:
        """Tell an instance we are not yet connected to that we live (it streams its load and our tokens to
        the proxies it knows)."""
        if address not in self.sockets:
            self.send(address, wire.ProxyAlive(self.token_address))

    def greet_all(self) -> None:
        """Our keepalive to every instance we are connected to."""
        alive = wire.ProxyAlive(self.token_address)
        for address in list(self.sockets):
            self.send(address, alive)

    def ask_cache(self, address: str) -> None:
        """Ask an instance for its whole prefix cache (our index missed some of it, or we just started)."""
        if address and self.token_address:
            self.send(address, wire.CacheSync(self.token_address))

    def link_state(self, address: str) -> str:
        return self.links.state(address)

    def close_unless(self, keep: set[str]) -> None:
        """Close the sockets (and link watches) of every address not in ``keep``."""
        for address in [a for a in self.sockets if a not in keep]:
            self.links.forget(address)
            self.sockets.pop(address).close(0)

    def close(self) -> None:
        self.links.close()
        for sock in self.sockets.values():
            sock.close(200)  # aborts just sent still go out


async def receive(pull: zmq.asyncio.Socket, secure: bool, handle: Callable[[wire.Message | None, str | None], None]):
    """The token path: every message on ``pull`` to ``handle``, with its sender's CURVE key ("role:name",
    the ZAP User-Id) when ``secure``."""
    if secure:
        async for frames in runtime.receive(pull, copy=False):
            for frame in frames:
                try:
                    handle(wire.decode(frame.buffer), frame.get("User-Id"))
                except Exception:  # this task is essential: one peer's message must not end it
                    M_BAD_FRAMES.inc()
                    log.exception("a message on the token path (%d bytes) broke its handler; dropped it",
                                  len(frame.buffer))
        return
    async for frames in runtime.receive(pull):
        for frame in frames:
            try:
                handle(wire.decode(frame), None)
            except Exception:  # this task is essential: one peer's message must not end it (nor the proxy)
                M_BAD_FRAMES.inc()
                log.exception("a message on the token path (%d bytes) broke its handler; dropped it", len(frame))
