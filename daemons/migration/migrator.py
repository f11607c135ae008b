"""The Migrator: the facade the instance holds over both roles of one instance (``Source``, ``Destination``),
the sockets between instances (``Peers``), the KV transport it is given, and the pacing baseline."""

from __future__ import annotations

import asyncio
import logging
from types import MappingProxyType
from typing import Callable, Mapping

import zmq

from daemons import runtime, wire
from daemons.clock import Clock
from daemons.config import MigrationConfig
from daemons.engine.base import Engine
from daemons.migration.destination import Destination
from daemons.migration.move import Move
from daemons.migration.peers import Peers
from daemons.migration.pulls import PULL_PEER, PULL_TIMEOUT_S, Pulls
from daemons.migration.records import Host, Incoming, Outgoing
from daemons.migration.rehome import Rehome
from daemons.migration.side import Parts
from daemons.migration.source import Source
from daemons.migration.transport import KvTransport
from daemons.migration.warmup import Warmup
from daemons.pacing import Baseline
from daemons.requests import RequestTable
from daemons.watchdog import Faults

log = logging.getLogger("llumnix.migration")


class Migrator:
    """Both roles of this instance. Built by the instance, which gives it ``boundary`` (run a function between
    engine steps), its request table, through whose verbs a migration hands requests over, and its KV
    transport (daemons/migration/transport.py; the daemon's: daemons/kv/ranks.py ``gloo_transport``).

    What the instance calls: ``migrate_out`` (one request to a destination; returns its outcome),
    ``prefix_hits`` (what a destination holds already), ``pulls`` (prefix pulls, pulls.py), ``rehome`` (idle
    sessions' KV to a cooler instance, rehome.py), ``peer_dead`` (the manager's word that a peer died),
    ``link`` (make the links to a peer ahead of its moves),
    ``on_peer_message`` (a message from a source, on the
    instance's ROUTER), ``receiving`` / ``cancel_incoming`` / ``forward_abort`` (a request arriving, placed
    anew, aborted after it moved), ``stepped`` (after every engine step), ``spawn``, ``busy``, ``outgoing`` / ``incoming`` / ``committed`` /
    ``aborted`` (for the load report) and ``close``."""

    def __init__(self, host: Host, cfg: MigrationConfig, engine: Engine, requests: RequestTable, boundary: Callable,
                 faults: Faults | None, kv: KvTransport, clock: Clock | None = None,
                 pull_timeout_s: float = PULL_TIMEOUT_S):
        self.cfg = cfg
        self.kv = kv
        self.clock = clock or Clock()
        self._tasks: set[asyncio.Task] = set()
        self.step_baseline = Baseline()  # engine steps while no migration runs here

        def dealer() -> zmq.asyncio.Socket:
            return host.sec.client(runtime.tune(host.ctx.socket(zmq.DEALER)), "instance")

        def in_use() -> tuple[set[str], set[str]]:
            return self.source.addresses(), self.source.pair_names() | self.destination.pair_names()

        self.peers = Peers(dealer, kv, self.clock, self.spawn, in_use, self._reply, self._gone)
        parts = Parts(host, cfg, engine, requests, boundary, kv, self.peers, self.clock)
        self.source = Source(parts)
        self.destination = Destination(parts, faults or Faults("", ""), self.spawn, lambda: self.busy)
        self.warmup = Warmup(parts, self.source.lock, self.spawn)
        self.pulls = Pulls(parts, self.spawn, pull_timeout_s)  # (kv_tier.pull_timeout_s)
        self.rehome = Rehome(parts, self.pulls, self.spawn)

    def _reply(self, msg: wire.Message) -> None:
        if isinstance(msg, wire.LinkReady):
            self.warmup.on_ready(msg)
        elif isinstance(msg, wire.PullOffer):
            self.pulls.on_offer(msg)
        else:
            self.source.deliver(msg)

    def _gone(self, address: str) -> None:
        self.source.peer_gone(address)

    # ---------------------------------------------------------------- what the instance calls

    async def migrate_out(self, request_id: str, dst: str, dst_address: str, blocking: bool = False,
                          paced: bool = True) -> wire.MigrationOutcome:
        """Move one request to ``dst`` (its instance id, at request address ``dst_address``); never raises: the
        outcome says what happened. ``blocking`` skips pre-copy (suspend, then copy everything): the
        stop-and-copy baseline that benchmarks compare with. ``paced`` False: its pre-copy runs at full speed
        (a handover: the request must reach its decode instance soon)."""
        return await Move(self.source, request_id, dst, dst_address, blocking, paced).run()

    async def prefix_hits(self, dst_address: str, prompts: list[list[int]]) -> list[int]:
        """Of each prompt, the leading full blocks the destination holds (zeros where it does not answer)."""
        return await self.peers.prefix_hits(dst_address, prompts)

    def on_peer_message(self, identity: bytes, msg) -> None:
        """A message from a source (or a prefix query) that reached the instance's ROUTER."""
        if isinstance(msg, wire.MigStage):
            self.destination.on_stage(identity, msg)
        elif isinstance(msg, wire.MigAbort):
            self.destination.on_abort(msg)
        elif isinstance(msg, wire.PrefixQuery):
            self.spawn(self.destination.answer_prefix(identity, msg))
        elif isinstance(msg, wire.KvRendezvous):
            self.peers.relayed(msg)
        elif isinstance(msg, wire.LinkOpen):
            self.warmup.on_open(identity, msg)
        elif isinstance(msg, wire.PullAsk):
            self.pulls.on_ask(identity, msg)
        elif isinstance(msg, wire.RehomePull):
            self.rehome.on_pull(msg)

    def peer_dead(self, instance_id: str, address: str) -> None:
        """The manager says ``instance_id`` (at request address ``address``) is dead (wire.PeerDead). Nothing
        waits for it any longer: the moves out to it abort at once (a request suspended for it resumes decoding
        here), the reservations of moves in from it are released as soon as no transfer can still write them
        (their KV pairs are closed here, which ends those transfers), and our socket and pairs to it close."""
        out = self.source.peer_dead(instance_id, address)
        ending = self.destination.peer_dead(instance_id)
        self.warmup.forget(instance_id)
        self.pulls.peer_dead(address)
        self.peers.peer_dead(instance_id, address, [inc.pair.key for inc in ending if inc.pair is not None])
        self.kv.forget(instance_id + PULL_PEER)
        log.info("instance %s (%s) is dead: %d move(s) out to it aborted, %d move(s) in from it released",
                 instance_id, address or "no address", out, len(ending))

    def link(self, instance_id: str, address: str) -> None:
        """(wire.PeerLink) Make the links a move to ``instance_id`` needs now, in the background (warmup.py)."""
        self.warmup.link(instance_id, address)

    def receiving(self, request_id: str) -> bool:
        return self.destination.receiving(request_id)

    async def cancel_incoming(self, request_id: str) -> None:
        """Give up receiving ``request_id`` (it was placed here anew): never commit, release its blocks."""
        await self.destination.cancel(request_id)

    def forward_abort(self, request_id: str, epoch: int = 0) -> bool:
        """An abort for a request that moved away goes after it. False if it never moved from here."""
        return self.source.forward_abort(request_id, epoch)

    @property
    def busy(self) -> int:
        """Migrations in flight here, out and in."""
        return len(self.source.outgoing) + len(self.destination.incoming)

    @property
    def outgoing(self) -> Mapping[str, Outgoing]:
        """The moves out, by migration id (read-only)."""
        return MappingProxyType(self.source.outgoing)

    @property
    def incoming(self) -> Mapping[str, Incoming]:
        """The moves in, by migration id (read-only)."""
        return MappingProxyType(self.destination.incoming)

    @property
    def committed(self) -> int:
        return self.source.committed

    @property
    def aborted(self) -> int:
        return self.source.aborted

    @property
    def faults(self) -> Faults:
        return self.destination.faults

    @faults.setter
    def faults(self, faults: Faults) -> None:  # tests: an instance that refused migrations takes them now
        self.destination.faults = faults

    def stepped(self, step_s: float) -> None:
        """(Instance, after each engine step) A step with no migration here joins the baseline; one during a
        paced pre-copy adjusts that copy's duty."""
        if self.source.pacers:
            self.source.step_pacers(step_s, self.step_baseline.value())
        elif not self.busy:
            self.step_baseline.add(step_s)

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        self.destination.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.kv.close()
