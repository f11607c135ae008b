"""The sockets between instances: one DEALER per destination (its replies handed to the source role, its drop
watched), the KV pairs' rendezvous over them, and prefix queries (which leading blocks a destination holds
already, so they stay out of the copy)."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import zmq
import zmq.asyncio
import zmq.utils.monitor

from daemons import runtime, wire
from daemons.clock import Clock
from daemons.migration.records import PREFIX_QUERY_TIMEOUT_S
from daemons.migration.transport import KvPair, KvTransport

log = logging.getLogger("llumnix.migration")


PEER_IDLE_S = 300.0  # a peer socket or KV pair unused this long (and in no migration) is closed
DEAD_KEPT = 1024  # addresses of dead peers remembered (a fleet that replaces instances must not grow it)


class Peers:
    """Owns the sockets to destinations (``sockets``, by request address), their reader and watcher tasks,
    when each socket and KV pair was last used, and the prefix queries in flight. Closes what peers no longer
    use: a fleet that replaces instances (new ids, new ports) must not grow every instance's sockets, tasks
    and KV pairs (with their staging buffers) for ever."""

    def __init__(self, dealer: Callable[[], zmq.asyncio.Socket], kv: KvTransport, clock: Clock,
                 spawn: Callable, in_use: Callable[[], tuple[set[str], set[str]]],
                 on_reply: Callable[[wire.Message], None], on_gone: Callable[[str], None]):
        """``dealer``: a new DEALER socket (secured, tuned); ``kv``: the KV transport whose idle pairs are
        forgotten; ``spawn``: run a task the migrator cancels at close; ``in_use``: the peer addresses and
        KV pair names some migration holds now (never pruned); ``on_reply``: a destination's MigReady, MigDone,
        LinkReady or PullOffer; ``on_gone``: the connection to that request address dropped."""
        self.dealer = dealer
        self.kv = kv
        self.clock = clock
        self.spawn = spawn
        self.in_use = in_use
        self.on_reply = on_reply
        self.on_gone = on_gone
        self.sockets: dict[str, zmq.asyncio.Socket] = {}  # destination request address -> our DEALER
        self.tasks: dict[str, tuple] = {}  # by address: its reader and watcher
        self.used: dict[str, float] = {}  # by address: when it was last used
        self.pairs_used: dict[str, float] = {}  # by KV pair name (a destination id, or a source's key)
        self.next_prune = 0.0
        self.queries = 0
        self.waits: dict[int, asyncio.Future] = {}  # prefix queries by id
        self.asked: dict[int, str] = {}  # ... and whom each asked
        # Addresses of peers declared dead (the latest DEAD_KEPT): nothing is sent there until revived.
        self.dead: dict[str, None] = {}
        self.kept: set[str] = set()  # addresses and KV pair names made ahead (warmup.py): never pruned

    def socket(self, address: str) -> zmq.asyncio.Socket:
        """Our socket to the destination at ``address`` (connected on first use)."""
        self.prune()
        self.used[address] = self.clock.monotonic()
        sock = self.sockets.get(address)
        if sock is None:
            sock = self.sockets[address] = self.dealer()
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sock.connect(address)
            self.tasks[address] = (self.spawn(self._read(sock)), self.spawn(self._watch(address, monitor)))
        return sock

    def send(self, address: str, msg: wire.Message) -> bool:
        """False where it could not go: the socket's queue is full, or the peer was declared dead (no socket
        is made to a dead peer for a move's last word to it)."""
        if address in self.dead:
            return False
        return runtime.send_now(self.socket(address), wire.encode(msg))

    def keep(self, pair_name: str, address: str = "") -> None:
        """Links made ahead of the moves that will use them (daemons/migration/warmup.py): kept however long
        they lie unused, until their peer is declared dead."""
        self.kept.add(pair_name)
        if address:
            self.kept.add(address)

    def unkeep(self, pair_name: str, address: str = "") -> None:
        self.kept.discard(pair_name)
        self.kept.discard(address)

    def revive(self, address: str) -> None:
        """A peer declared dead is there again (an order names it): it may be sent to."""
        self.dead.pop(address, None)

    def peer_dead(self, instance_id: str, address: str, held: list[str] = ()) -> None:
        """The manager declared ``instance_id`` (at ``address``) dead: close our socket to it, answer our prefix
        queries to it (nothing held), and close its KV pairs (the source pair named by its id, those it started
        with us named by its key): their transfers in flight end, their staging buffers go. ``held``: pairs
        that moves in from it hold, closed too."""
        if address:
            self.dead[address] = None
            while len(self.dead) > DEAD_KEPT:
                del self.dead[next(iter(self.dead))]
            self._close(address)
            for qid in [q for q, a in self.asked.items() if a == address]:
                waiting = self.waits.get(qid)
                if waiting is not None and not waiting.done():
                    waiting.set_result([])
        family = f"{instance_id}>"
        self.kept -= {address, instance_id, *(k for k in self.kept if k.startswith(family))}
        for name in {*held, *(n for n in self.pairs_used if n == instance_id or n.startswith(family))}:
            self.pairs_used.pop(name, None)
            self.kv.forget(name)

    def _close(self, address: str) -> None:
        self.used.pop(address, None)
        for task in self.tasks.pop(address, ()):
            task.cancel()
        sock = self.sockets.pop(address, None)
        if sock is not None:
            sock.close(0)

    def pair_used(self, name: str) -> None:
        """A KV pair (by the name the transport's ``forget`` takes) is in use now."""
        self.pairs_used[name] = self.clock.monotonic()

    def prune(self) -> None:
        """Close the peer sockets and forget the KV pairs not used for PEER_IDLE_S that no migration holds
        (looked at no more than every PEER_IDLE_S / 4)."""
        now = self.clock.monotonic()
        if now < self.next_prune:
            return
        self.next_prune = now + PEER_IDLE_S / 4
        cut = now - PEER_IDLE_S
        busy, held = self.in_use()
        for address in [a for a, at in self.used.items() if at < cut and a not in busy and a not in self.kept]:
            self._close(address)
        for name in [n for n, at in self.pairs_used.items() if at < cut and n not in held and n not in self.kept]:
            del self.pairs_used[name]
            self.kv.forget(name)

    async def _watch(self, address: str, monitor) -> None:
        """A destination that dies drops its connection (the kernel closes it): end the waits of our
        migrations to it at once rather than after migration.timeout_s, while the request is suspended."""
        try:
            while True:
                event = await zmq.utils.monitor.recv_monitor_message(monitor)
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    self.on_gone(address)
        finally:
            monitor.close(0)

    async def _read(self, sock) -> None:
        while True:
            msg = wire.decode(await sock.recv())
            if isinstance(msg, (wire.MigReady, wire.MigDone, wire.LinkReady, wire.PullOffer)):
                self.on_reply(msg)
            elif isinstance(msg, wire.PrefixHits):
                waiting = self.waits.get(msg.query_id)
                if waiting is not None and not waiting.done():
                    waiting.set_result(msg.blocks)
            elif isinstance(msg, wire.KvRendezvous):
                self.relayed(msg)
            else:
                log.warning("dropped an unexpected message from a migration peer")

    # ---------------------------------------------------------------- KV pair rendezvous (daemons/kv/transfer.py RelayStore)

    def relay_rendezvous(self, pair: KvPair, send: Callable[[wire.Message], None]) -> None:
        """The pair's rendezvous writes go to its peer as wire.KvRendezvous through ``send`` (on the event
        loop: the writes come from the pair's thread). A transport without a relay (a tensor-parallel
        engine's TCPStore, the tests' in-memory pairs) needs nothing."""
        relay = pair.relay
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

    def relayed(self, msg: wire.KvRendezvous) -> None:
        self.kv.relayed(msg.pair_key, msg.key, msg.value)

    # ---------------------------------------------------------------- what a move would not need to send

    async def prefix_hits(self, dst_address: str, prompts: list[list[int]]) -> list[int]:
        """Of each prompt, the leading full blocks the destination's prefix cache holds: blocks a migration
        there would not send. Zeros where the destination does not answer within PREFIX_QUERY_TIMEOUT_S."""
        self.queries += 1
        qid = self.queries
        waiting = self.waits[qid] = asyncio.get_running_loop().create_future()
        self.asked[qid] = dst_address
        try:
            if not self.send(dst_address, wire.PrefixQuery(qid, prompts)):
                return [0] * len(prompts)
            blocks = await asyncio.wait_for(waiting, PREFIX_QUERY_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.info("%s did not say within %gs what of %d prompt(s) it holds; choosing as if nothing",
                     dst_address, PREFIX_QUERY_TIMEOUT_S, len(prompts))
            return [0] * len(prompts)
        finally:
            self.waits.pop(qid, None)
            self.asked.pop(qid, None)
        if not blocks and prompts:  # its peer was declared dead meanwhile
            return [0] * len(prompts)
        if len(blocks) != len(prompts):
            log.warning("%s answered a prefix query about %d prompts with %d counts; ignored",
                        dst_address, len(prompts), len(blocks))
            return [0] * len(prompts)
        return [max(0, int(b)) for b in blocks]
