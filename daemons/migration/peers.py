"""The sockets between instances: one DEALER per destination (its replies routed to their migrations, its
drop watched), the messages a source receives as a destination, and prefix queries (which leading blocks
a destination holds already, so they stay out of the copy)."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import zmq
import zmq.asyncio
import zmq.utils.monitor

from daemons.clock import loop_time
from daemons import runtime, wire
from daemons.engine.base import EngineError
from daemons.migration.records import (GONE, PREFIX_QUERY_TIMEOUT_S, DestinationFailed, Incoming, Outgoing,
                                       Refused)
from daemons.migration.telemetry import M_IN_FLIGHT

log = logging.getLogger("llumnix.migration")


PEER_IDLE_S = 300.0  # a peer socket or KV pair unused this long (and in no migration) is closed


class PeersMixin:
    """Of the Migrator: owns ``peers`` and the prefix queries, and closes what peers no longer use: a fleet
    that replaces instances (new ids, new ports) must not grow every instance's sockets, tasks and KV pairs
    (with their staging buffers) for ever."""

    def _peer(self, address: str) -> zmq.asyncio.Socket:
        self.prune_peers()
        self._peer_used[address] = loop_time()
        sock = self.peers.get(address)
        if sock is None:
            sock = self.peers[address] = self.inst.sec.client(runtime.tune(self.inst.ctx.socket(zmq.DEALER)), "instance")
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sock.connect(address)
            self._peer_tasks[address] = (self.spawn(self._read_peer(sock)), self.spawn(self._watch_peer(address, monitor)))
        return sock

    def pair_used(self, name: str) -> None:
        """A KV pair (by the name the transport's ``forget`` takes) is in use now."""
        self._pair_used[name] = loop_time()

    def prune_peers(self) -> None:
        """Close the peer sockets and forget the KV pairs not used for PEER_IDLE_S that no migration holds
        (looked at no more than every PEER_IDLE_S / 4)."""
        now = loop_time()
        if now < self._next_prune:
            return
        self._next_prune = now + PEER_IDLE_S / 4
        cut = now - PEER_IDLE_S
        busy = {o.dst_address for o in self.outgoing.values()}
        for address in [a for a, at in self._peer_used.items() if at < cut and a not in busy]:
            del self._peer_used[address]
            for task in self._peer_tasks.pop(address, ()):
                task.cancel()
            sock = self.peers.pop(address, None)
            if sock is not None:
                sock.close(0)
        held = {o.dst for o in self.outgoing.values()} | {getattr(i.pair, "key", None) for i in self.incoming.values()}
        for name in [n for n, at in self._pair_used.items() if at < cut and n not in held]:
            del self._pair_used[name]
            self.kv.forget(name)

    async def _watch_peer(self, address: str, monitor) -> None:
        """A destination that dies drops its connection (the kernel closes it): end the waits of our
        migrations to it at once rather than after migration.timeout_s, while the request is suspended."""
        try:
            while True:
                event = await zmq.utils.monitor.recv_monitor_message(monitor)
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    for out in self.outgoing.values():
                        if out.dst_address == address:
                            out.replies.put_nowait(GONE)
        finally:
            monitor.close(0)

    async def _read_peer(self, sock) -> None:
        while True:
            msg = wire.decode(await sock.recv())
            if isinstance(msg, (wire.MigReady, wire.MigDone)):
                out = self.outgoing.get(msg.mig_id)
                if out is not None:
                    out.replies.put_nowait(msg)
            elif isinstance(msg, wire.PrefixHits):
                waiting = self._prefix_waits.get(msg.query_id)
                if waiting is not None and not waiting.done():
                    waiting.set_result(msg.blocks)
            elif isinstance(msg, wire.KvRendezvous):
                self._relayed(msg)
            else:
                log.warning("dropped an unexpected message from a migration peer")

    # ---------------------------------------------------------------- KV pair rendezvous (kvtransfer.RelayStore)

    def relay_rendezvous(self, pair, send: Callable[[wire.Message], None]) -> None:
        """The pair's rendezvous writes go to its peer as wire.KvRendezvous through ``send`` (on the event
        loop: the writes come from the pair's thread). A transport without a relay (a tensor-parallel
        engine's TCPStore, the tests' in-memory pairs) needs nothing."""
        relay = getattr(pair, "relay", None)
        if relay is None:
            return
        loop = asyncio.get_running_loop()
        key = pair.key

        def on_set(store_key: str, value: bytes) -> None:
            loop.call_soon_threadsafe(self._send_rendezvous, send, wire.KvRendezvous(key, store_key, value))

        relay.attach(on_set)

    @staticmethod
    def _send_rendezvous(send: Callable[[wire.Message], None], msg: wire.KvRendezvous) -> None:
        try:
            send(msg)
        except zmq.ZMQError as exc:  # the peer's socket was closed meanwhile: the pair times out and breaks
            log.warning("KV pair %s: its rendezvous could not be sent: %s", msg.pair_key, exc)

    def _relayed(self, msg: wire.KvRendezvous) -> None:
        relayed = getattr(self.kv, "relayed", None)
        if relayed is None:
            log.warning("dropped a KV rendezvous for pair %s: this instance's pairs meet at a store", msg.pair_key)
            return
        relayed(msg.pair_key, msg.key, msg.value)

    async def _reply(self, out: Outgoing, kind: type, stage: int, what: str):
        deadline = loop_time() + self.cfg.timeout_s
        while True:
            left = deadline - loop_time()
            if left <= 0:
                raise DestinationFailed(f"destination did not answer {what} within {self.cfg.timeout_s:g}s")
            try:
                msg = await asyncio.wait_for(out.replies.get(), left)
            except asyncio.TimeoutError:
                continue
            if msg is GONE:
                raise DestinationFailed(f"the connection to the destination dropped while waiting for {what} (did it die?)")
            if isinstance(msg, kind) and msg.stage == stage:
                if not msg.ok:
                    raise Refused(f"destination refused: {msg.reason}")
                return msg

    def on_peer_message(self, identity: bytes, msg) -> None:
        if isinstance(msg, wire.MigStage):
            inc = self.incoming.get(msg.mig_id)
            if inc is None:
                if msg.stage != 0 or msg.request is None:
                    self._answer(identity, wire.MigReady(msg.mig_id, msg.stage, False, "unknown migration (released?)"))
                    return
                refusal = self._refusal(msg)
                if refusal:
                    self._answer(identity, wire.MigReady(msg.mig_id, msg.stage, False, refusal))
                    return
                inc = self.incoming[msg.mig_id] = Incoming(msg.mig_id, msg.request.request_id, identity, msg.src, msg.request)
                M_IN_FLIGHT.labels("destination").inc()
                self.spawn(self._watch(inc))
            inc.last_heard = loop_time()
            self.spawn(self._stage_in(inc, msg))
        elif isinstance(msg, wire.MigAbort):
            inc = self.incoming.get(msg.mig_id)
            if inc is not None:
                inc.aborted = True  # a commit waiting for its step boundary will not happen
                log.info("migration of %s from %s aborted by the source: %s", inc.request_id, inc.src, msg.reason)
                self.spawn(self._end_in(inc))
        elif isinstance(msg, wire.PrefixQuery):
            self.spawn(self._answer_prefix(identity, msg))
        elif isinstance(msg, wire.KvRendezvous):
            self._relayed(msg)

    # ---------------------------------------------------------------- what a move would not need to send

    async def prefix_hits(self, dst_address: str, prompts: list[list[int]]) -> list[int]:
        """Of each prompt, the leading full blocks the destination's prefix cache holds: blocks a migration
        there would not send. Zeros where the destination does not answer within PREFIX_QUERY_TIMEOUT_S."""
        self._prefix_queries += 1
        qid = self._prefix_queries
        waiting = self._prefix_waits[qid] = asyncio.get_running_loop().create_future()
        try:
            runtime.send_now(self._peer(dst_address), wire.encode(wire.PrefixQuery(qid, prompts)))
            blocks = await asyncio.wait_for(waiting, PREFIX_QUERY_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.info("%s did not say within %gs what of %d prompt(s) it holds; choosing as if nothing",
                     dst_address, PREFIX_QUERY_TIMEOUT_S, len(prompts))
            return [0] * len(prompts)
        finally:
            self._prefix_waits.pop(qid, None)
        if len(blocks) != len(prompts):
            log.warning("%s answered a prefix query about %d prompts with %d counts; ignored",
                        dst_address, len(prompts), len(blocks))
            return [0] * len(prompts)
        return [max(0, int(b)) for b in blocks]

    async def _answer_prefix(self, identity: bytes, msg: wire.PrefixQuery) -> None:
        try:
            blocks = await self.boundary(lambda: self.engine.prefix_hits(msg.prompts))
        except EngineError as exc:  # a prompt this engine cannot hash (out of its vocabulary)
            log.info("prefix query: %s", exc)
            blocks = [0] * len(msg.prompts)
        self._answer(identity, wire.PrefixHits(msg.query_id, blocks))
