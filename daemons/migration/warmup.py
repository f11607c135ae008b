"""Links made ahead: what a move's first stage would otherwise set up while its request waits (issue #38, "set-up
off the request path"). A prefill instance hands each request over at its first token; the first handover to a
decode instance must not pay for the socket to it, the Gloo pair's rendezvous and connections, the staging
buffers and the KV layout check, all inside that request's time to first token.

The manager tells a prefill instance about each decode (or mixed) instance when either joins (wire.PeerLink);
the instance then, in the background:

    source (us)                                 destination
    socket to it; our end of the KV pair        (on LinkOpen) layouts agree? join the pair, post an empty
    LinkOpen(pair key, layout, chunk size) ───▶ receive (it resolves once the pair is formed); LinkReady
    (on LinkReady ok) an empty send: resolves once the pair's Gloo group is formed at both ends

Both ends keep what they made (the peers never prune it) until the peer is declared dead. A move to that
instance later finds the socket and the pair formed (``KvTransport.source_pair`` returns the same pair;
``dest_pair`` the same key). An empty transfer posts nothing on the wire, so it does not disturb the order in
which a pair matches sends and receives; it runs under the destination's move lock, so no move interleaves.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

from daemons import wire
from daemons.kv.layout import KvLayout
from daemons.migration.side import Parts
from daemons.migration.telemetry import M_LINK_SECONDS, M_LINKS
from daemons.migration.transport import TransferError

log = logging.getLogger("llumnix.migration")


@dataclass
class Link:
    """One link made ahead, to a destination: how it went ("ready", "refused", "failed") and how long it took."""

    instance_id: str
    address: str
    state: str = "linking"
    reason: str = ""
    seconds: float = 0.0


class Warmup:
    """Owns ``links`` (by destination id): the links this instance made ahead, and the answers it waits for.
    Receives the instance (``host``), the engine (its KV's layout and bytes), the KV transport, the peers
    (socket, rendezvous relay, what is kept), ``lock`` (a destination's move lock, daemons/migration/source.py)
    and ``spawn``."""

    def __init__(self, parts: Parts, lock: Callable[[str], asyncio.Lock], spawn: Callable):
        self.host, self.cfg, self.engine, self.kv, self.peers, self.clock = (parts.host, parts.cfg, parts.engine,
                                                                             parts.kv, parts.peers, parts.clock)
        self.lock = lock
        self.spawn = spawn
        self.links: dict[str, Link] = {}
        self.waits: dict[str, asyncio.Future] = {}  # LinkReady by pair key

    # ---------------------------------------------------------------- source: make a link

    def link(self, instance_id: str, address: str) -> None:
        """(wire.PeerLink) Make the links to ``instance_id`` at ``address`` in the background."""
        if instance_id == self.host.instance_id:
            return
        old = self.links.get(instance_id)
        if old is not None and old.address == address and old.state in ("linking", "ready"):
            return
        self.peers.revive(address)  # the manager sees it live (a restarted instance may have a dead one's address)
        self.links[instance_id] = Link(instance_id, address)
        self.spawn(self._link(self.links[instance_id]))

    async def _link(self, link: Link) -> None:
        start = self.clock.monotonic()
        async with self.lock(link.instance_id):  # no move to it interleaves its transfers with ours
            try:
                link.reason = await self._open(link)
                link.state = "refused" if link.reason else "ready"
            except (TransferError, asyncio.TimeoutError) as exc:
                link.state, link.reason = "failed", str(exc) or f"no answer within {self.cfg.timeout_s:g}s"
            if link.state != "ready":  # a move there makes its own, as without links made ahead
                self.peers.unkeep(link.instance_id, link.address)
                self.kv.forget(link.instance_id)
        link.seconds = self.clock.monotonic() - start
        M_LINKS.labels(link.state).inc()
        if link.state == "ready":
            M_LINK_SECONDS.observe(link.seconds)
            log.info("links to %s made ahead in %.1f ms (socket, KV pair, layout checked)", link.instance_id,
                     link.seconds * 1e3)
        else:
            log.warning("links to %s could not be made ahead (%s): %s; a move there makes them itself",
                        link.instance_id, link.state, link.reason)

    async def _open(self, link: Link) -> str:
        """The socket, the pair, the destination's word; then the pair formed. Returns a refusal, or ""."""
        me, kb, peers = self.host.instance_id, self.engine.kv_blocks(), self.peers
        pair = self.kv.source_pair(me, link.instance_id, link.address)
        peers.keep(link.instance_id, link.address)
        peers.pair_used(link.instance_id)
        peers.socket(link.address)
        peers.relay_rendezvous(pair, lambda msg: peers.send(link.address, msg))
        chunk_blocks = max(1, self.cfg.chunk_bytes // kb.block_nbytes)
        waiting = self.waits[pair.key] = asyncio.get_running_loop().create_future()
        try:
            if not peers.send(link.address, wire.LinkOpen(pair.key, me, kb.spec, self.kv.address, chunk_blocks)):
                raise TransferError("the destination's socket is not accepting messages")
            ready = await asyncio.wait_for(waiting, self.cfg.timeout_s)
        finally:
            self.waits.pop(pair.key, None)
        if not ready.ok:
            return ready.reason
        # Resolves once the pair's group is formed at both ends (an empty transfer moves no bytes).
        await asyncio.wait_for(asyncio.wrap_future(pair.send(kb, [], chunk_blocks)), self.cfg.timeout_s)
        return ""

    def on_ready(self, msg: wire.LinkReady) -> None:
        waiting = self.waits.get(msg.pair_key)
        if waiting is not None and not waiting.done():
            waiting.set_result(msg)

    def forget(self, instance_id: str) -> None:
        """The peer was declared dead: a link made again later starts anew."""
        self.links.pop(instance_id, None)

    # ---------------------------------------------------------------- destination: join a link

    def on_open(self, identity: bytes, msg: wire.LinkOpen) -> None:
        """A source makes its links to us ahead: check the layouts, join its pair (kept), form it."""
        answer = self.host.reply_peer
        kb = self.engine.kv_blocks()
        if msg.kv_spec != kb.spec:
            answer(identity, wire.LinkReady(msg.pair_key, False,
                                            f"KV layout differs: {KvLayout.difference(msg.kv_spec, kb.spec)}"))
            return
        try:
            pair = self.kv.dest_pair(msg.pair_key, msg.kv_address)
        except TransferError as exc:
            answer(identity, wire.LinkReady(msg.pair_key, False, str(exc)))
            return
        self.peers.keep(msg.pair_key, "")
        self.peers.pair_used(msg.pair_key)
        self.peers.relay_rendezvous(pair, lambda m: answer(identity, m))
        formed = asyncio.wrap_future(pair.recv(kb, [], max(1, msg.chunk_blocks)))
        answer(identity, wire.LinkReady(msg.pair_key))
        self.spawn(self._formed(msg, formed))

    async def _formed(self, msg: wire.LinkOpen, formed: asyncio.Future) -> None:
        try:
            await asyncio.wait_for(formed, self.cfg.timeout_s)
            log.info("KV pair %s from %s formed ahead of its moves", msg.pair_key, msg.src)
        except (TransferError, asyncio.TimeoutError) as exc:
            self.peers.unkeep(msg.pair_key, "")
            log.warning("KV pair %s from %s did not form ahead of its moves: %s", msg.pair_key, msg.src,
                        str(exc) or "timed out")
