"""The simulator's migrations (llumnixctl/experiments/sim/simulate.py): each simulated instance runs the daemons'
own ``Migrator`` (daemons/migration/: the source's ``Move`` state machine, the destination's side, their
messages and timeouts) on the simulation's virtual time. The orders come from the manager to the instance's
own ``Orders`` (sim/llumlet.py), which selects the requests and runs them. What the simulator provides is what a migrator needs of its instance and
of the network:

- ``SimHost``: the migrator's ``Host`` (daemons/migration/records.py): its request socket (a ROUTER on
  ZeroMQ's in-process transport) through which peers' messages arrive ``Network.message_s`` after they were
  sent, and answers leave as late; the step boundary (its engine calls run between two simulated steps);
  its request table (daemons/requests.py), through whose verbs a migration hands a request over.
- ``SimKv``: the KV transport (``source_pair``, ``dest_pair``, ``forget``, ``close``, ``address``): a pair's
  ``send`` and ``recv`` meet in the order they were posted and complete when a copy of that many bytes at
  ``Network.kv_gbps`` (under the migrator's own rate limit) would. No bytes move: the sim engines keep no
  KV tensors, ``SimLayout`` stands for their layout.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Protocol

import zmq

from daemons import runtime, security, wire
from daemons.clock import LoopClock

if TYPE_CHECKING:
    from llumnixctl.experiments.sim.parts import SimulatedInstance


@dataclass
class SimLayout:
    """A sim engine's KV layout without tensors: what a migration reads of ``engine.kv_blocks()``."""

    block_nbytes: int
    bytes_per_token: int
    spec: str = "engine=sim"
    token_slots: bool = True  # the last stage sends only the written slots of its partial block


class SimPair:
    """One end of a pair (daemons/migration/transport.py ``KvPair``): its copies take the link's time."""

    def __init__(self, kv: SimKv, key: str, src: str) -> None:
        self.kv, self.key, self.src = kv, key, src
        self.broken = False
        self.relay = None  # no rendezvous: the hub matches the two ends by key

    def _nbytes(self, layout: SimLayout, block_ids: list[int], tail_tokens: int) -> int:
        whole = len(block_ids) - (1 if tail_tokens else 0)
        return whole * layout.block_nbytes + tail_tokens * layout.bytes_per_token

    def send(self, kv: SimLayout, block_ids: list[int], chunk_blocks: int, limit_bytes_s: float = 0.0,
             tail_tokens: int = 0, duty=None, one_message: bool = False) -> Future:
        fut: Future = Future()
        rate = limit_bytes_s if 0 < limit_bytes_s < self.kv.bytes_per_s else self.kv.bytes_per_s
        if duty is not None:
            rate *= max(duty(), 1e-3)  # a paced pre-copy sends that share of the time
        self.kv.hub.post(self.key, "send", (self._nbytes(kv, block_ids, tail_tokens), rate, self.src, fut))
        return fut

    def recv(self, kv: SimLayout, block_ids: list[int], chunk_blocks: int, tail_tokens: int = 0,
             one_message: bool = False) -> Future:
        fut: Future = Future()
        self.kv.hub.post(self.key, "recv", (self._nbytes(kv, block_ids, tail_tokens), fut))
        return fut


class SimKvHub:
    """The pairs of every simulated instance, by key; ``on_copy(start, seconds, bytes, source)`` for each copy."""

    def __init__(self, loop: asyncio.AbstractEventLoop, bytes_per_s: float, on_copy: Callable) -> None:
        self.loop, self.bytes_per_s, self.on_copy = loop, bytes_per_s, on_copy
        self.sends: dict[str, deque] = {}
        self.recvs: dict[str, deque] = {}
        self.ids = itertools.count(1)

    def post(self, key: str, side: str, item) -> None:
        (self.sends if side == "send" else self.recvs).setdefault(key, deque()).append(item)
        sends, recvs = self.sends.get(key), self.recvs.get(key)
        while sends and recvs:
            (nbytes, rate, src, done_send), (want, done_recv) = sends.popleft(), recvs.popleft()
            if nbytes != want:
                err = RuntimeError(f"a pair's send of {nbytes} bytes met a receive of {want}")
                done_send.set_exception(err)
                done_recv.set_exception(err)
                continue
            dt = nbytes / rate if rate > 0 else 0.0
            self.on_copy(self.loop.time(), dt, nbytes, src)
            self.loop.call_later(dt, self._done, nbytes, done_send, done_recv)

    @staticmethod
    def _done(nbytes: int, *futs: Future) -> None:
        for fut in futs:
            if not fut.done():
                fut.set_result(nbytes)

    def drop(self, key: str) -> None:
        for side in (self.sends, self.recvs):
            for item in side.pop(key, ()):
                fut = item[-1]
                if not fut.done():
                    fut.set_exception(RuntimeError("the pair was closed"))


class SimKv:
    """One simulated instance's end of the KV transport (daemons/migration/transport.py ``KvTransport``)."""

    def __init__(self, hub: SimKvHub, name: str) -> None:
        self.hub, self.name = hub, name
        self.address = f"sim:{name}"
        self.bytes_per_s = hub.bytes_per_s
        self.pairs: dict[str, SimPair] = {}

    def source_pair(self, me: str, peer: str, peer_address: str = "") -> SimPair:
        pair = self.pairs.get(peer)
        if pair is None:
            pair = self.pairs[peer] = SimPair(self, f"{me}>{peer}/{next(self.hub.ids)}", me)
        return pair

    def dest_pair(self, key: str, store_address: str) -> SimPair:
        pair = self.pairs.get(key)
        if pair is None:
            pair = self.pairs[key] = SimPair(self, key, "")
        return pair

    def relayed(self, pair_key: str, key: str, value: bytes) -> None:
        pass  # (no pair here needs a rendezvous)

    def forget(self, name: str) -> None:
        pair = self.pairs.pop(name, None)
        if pair is not None:
            self.hub.drop(pair.key)

    def close(self) -> None:
        for name in list(self.pairs):
            self.forget(name)


class _Proxies:
    def seen(self, address: str) -> None:  # (no proxies to watch in the simulation)
        pass


class SimHost:
    """What a migrator needs of its simulated instance (daemons/migration/records.py's ``Host``). Owns the
    instance's request socket; ``deliver(identity, msg)`` gets its peers' messages (the migrator's
    ``on_peer_message``), ``moved(request_id, instance_id)`` the moves it announces, ``wake()`` and
    ``abort_local(request_id)`` what the migrator tells the instance."""

    def __init__(self, instance_id: str, ctx: zmq.asyncio.Context, sec_cfg, message_s: float,
                 loop: asyncio.AbstractEventLoop, moved: Callable[[str, str], None], wake: asyncio.Event,
                 abort_local: Callable[[str], bool]) -> None:
        self.ctx = ctx
        self.sec = security.Security(sec_cfg, "instance", ctx)
        self.instance_id = instance_id
        self.request_address = f"inproc://sim-{instance_id}"
        self.accepting = True
        self.draining = ""
        self.wake = wake  # the instance's mailbox's: the migrator sets it when the engine has news
        self.proxies = _Proxies()
        self.tracer = None  # no spans in a simulation
        self.message_s = message_s
        self.loop = loop
        self._moved, self._abort = moved, abort_local
        self.deliver: Callable[[bytes, wire.Message], None] | None = None
        self.router = self.sec.server(runtime.tune(ctx.socket(zmq.ROUTER)), "instance")
        self.router.bind(self.request_address)
        self.reader = loop.create_task(self._read())

    async def _read(self) -> None:
        """Peers' messages, delivered one message latency after they arrived."""
        try:
            while True:
                identity, frame = await self.router.recv_multipart()
                self.loop.call_later(self.message_s, self.deliver, identity, wire.decode(frame))
        except (asyncio.CancelledError, zmq.ZMQError):
            pass

    def reply_peer(self, identity: bytes, msg: wire.Message) -> None:
        self.loop.call_later(self.message_s, self._send, identity, wire.encode(msg))

    def _send(self, identity: bytes, frame: bytes) -> None:
        if not self.router.closed:
            runtime.send_now(self.router, [identity, frame])

    def announce_move(self, request_id: str, address: str, instance_id: str, request_address: str, epoch: int,
                      from_index: int) -> None:
        self._moved(request_id, instance_id)

    def abort_local(self, request_id: str) -> bool:
        return self._abort(request_id)

    def close(self) -> None:
        self.reader.cancel()
        self.router.close(0)
        self.sec.close()


_ENGINE = None


def sim_engine_class():
    """The sim engine with a layout instead of KV tensors, telling the simulation when it suspends a request
    for its last stage (the start of the migration's downtime); each step's model time includes the daemon's
    own cost per step (``Network.step_overhead_s``)."""
    global _ENGINE
    if _ENGINE is None:
        from daemons.engine.sim import SimEngine  # (torch: only once a simulation runs)

        class Engine(SimEngine):
            layout: SimLayout
            on_suspend: Callable[[str], None]
            overhead_s = 0.0  # the daemon's own cost per step (Network.step_overhead_s), on top of model time

            def step(self):
                result = super().step()
                result.model_time_s += self.overhead_s
                return result

            def kv_blocks(self) -> SimLayout:
                return self.layout

            def suspend(self, request_id: str) -> wire.RequestState:
                state = super().suspend(request_id)
                self.on_suspend(request_id)
                return state

        _ENGINE = Engine
    return _ENGINE


class Site(Protocol):
    """What migrations need of the simulation (simulate.py's ``Simulation``)."""

    requests: Mapping  # request id -> SimulatedRequest (its ``owner``)
    instances: Mapping  # instance id -> SimulatedInstance

    def notify(self, kind: str, **data) -> None: ...

    def maybe_gone(self, inst: SimulatedInstance) -> None: ...


class SimMigrations:
    """Each instance's own migrator and what they share: the in-process ZeroMQ context their sockets meet in,
    the KV pairs' hub, and the figures: ``outcomes`` (orders by reason, migrations by reason and outcome, and
    abort reasons), ``downtimes`` (seconds, from the suspend at the source to the commit's answer there),
    ``copies`` (every KV copy: start, seconds, bytes, source). Orders come from the manager (its pairing, its
    handovers) to each instance's own ``Orders`` (sim/llumlet.py), which runs the migrations."""

    def __init__(self, cfg, net, loop: asyncio.AbstractEventLoop, kv_bytes_per_token: int, site: Site) -> None:
        import zmq.asyncio

        from daemons.migration import Migrator  # (torch: only once a simulation runs)

        self.cfg, self.net, self.loop, self.site = cfg, net, loop, site
        self.clock = LoopClock(loop)  # the migrators' time: the simulation's virtual loop
        self.kv_bytes_per_token = kv_bytes_per_token
        self.migrator_class = Migrator
        self.zmq = zmq.asyncio.Context()
        self.kv_hub = SimKvHub(loop, net.kv_gbps * 1e9 / 8, self._copied)
        self.outcomes: Counter = Counter()
        self.downtimes: list[float] = []
        self.copies: list[tuple[float, float, int, str]] = []
        self.suspended_at: dict[str, float] = {}  # request id -> when its source suspended it (its last stage)
        self.committed_at: dict[str, float] = {}  # request id -> when its destination committed it
        self.reasons: dict[tuple[str, str], str] = {}  # (source, request or destination) -> its order's reason
        self.hosts: list[SimHost] = []
        self.migrators: list = []

    def _copied(self, start: float, seconds: float, nbytes: int, src: str) -> None:
        if src:
            self.copies.append((start, seconds, nbytes, src))

    def engine(self):
        """A sim engine for a new instance: its KV layout without tensors; it tells us its suspends."""
        engine = sim_engine_class()(self.cfg.sim, self.cfg.model, kv=False, lora=self.cfg.lora, kv_tier=self.cfg.kv_tier,
                                    clock=self.loop.time)
        per_token = self.kv_bytes_per_token
        engine.layout = SimLayout(engine.block_size * per_token, per_token)
        engine.on_suspend = lambda rid: self.suspended_at.__setitem__(rid, self.loop.time())
        engine.overhead_s = self.net.step_overhead_s
        return engine

    def attach(self, inst: SimulatedInstance) -> None:
        """The instance's own migrator, with its host, its step boundary (its mailbox) and a KV transport."""
        site = self.site

        def moved(rid: str, iid: str) -> None:
            site.requests[rid].owner = iid
            if iid == inst.iid:  # the destination committed it (or an unanswered source resumed it)
                self.committed_at[rid] = self.loop.time()

        inst.host = SimHost(inst.iid, self.zmq, self.cfg.security, self.net.message_s, self.loop, moved,
                            inst.mailbox.wake, lambda rid: inst.intake.abort_local(rid))
        inst.migrator = self.migrator_class(inst.host, self.cfg.migration, inst.engine, inst.table, inst.mailbox.call,
                                            None, SimKv(self.kv_hub, inst.iid), self.clock)
        inst.host.deliver = inst.migrator.on_peer_message
        self.hosts.append(inst.host)
        self.migrators.append(inst.migrator)

    async def close(self) -> None:
        for migrator in self.migrators:
            await migrator.close()
        for host in self.hosts:
            host.close()
        self.zmq.destroy(linger=0)

    # ------------------------------------------------------------------ what the figures hear

    def ordered(self, src: str, start: wire.MigrateStart) -> None:
        """The manager sent ``src`` an order (sim/llumlet.py ManagerWire): its reason, for the migrations it runs."""
        reason = start.reason or "operator"
        self.outcomes[f"{reason}/ordered"] += 1
        for rid in start.request_ids:
            self.reasons[(src, rid)] = reason
        if not start.request_ids:
            self.reasons[(src, start.dst)] = reason

    def ended(self, src: SimulatedInstance, dst: str, rid: str, out: wire.MigrationOutcome, started: float) -> None:
        """A migration out of ``src`` ended (sim/llumlet.py MigratorTap)."""
        reason = self.reasons.pop((src.iid, rid), None) or self.reasons.get((src.iid, dst), "operator")
        suspended = self.suspended_at.pop(rid, None)
        committed = self.committed_at.pop(rid, None)
        why = "" if out.outcome == "committed" else out.reason
        if out.outcome == "committed" and suspended is not None and committed is not None:
            self.downtimes.append(committed + self.net.message_s - suspended)  # the commit's answer reached the source
        self.outcomes[f"{reason}/{out.outcome}"] += 1
        if why:
            self.outcomes[f"aborted: {why.split(':')[0]}"] += 1
        src.mailbox.wake.set()
        target = self.site.instances.get(dst)
        if target is not None:
            target.mailbox.wake.set()
        self.site.notify("migration", src=src.iid, dst=dst, request=rid, outcome=out.outcome, reason=reason,
                         started=started, why=why)
        self.site.maybe_gone(src)
