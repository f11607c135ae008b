"""The proxy's side of ZeroMQ: dispatch through the manager, requests to instances, tokens back.

Each request gets a ``Stream`` that puts token outputs in index order and emits each index exactly once,
whichever instance produced it. If the manager does not answer in time (or is known to be down), the
proxy picks an instance from its last snapshot itself, by the dispatch policy the manager's snapshots name
(from load reports alone: no headroom, credit or unreported dispatches of other proxies). A request that
migrates is followed: the destination says so (``Moved``), and aborts go there from then on. A queued
request that a draining instance gives back (``Redispatch``) is dispatched again; that is not a failed attempt.

Ownership: every placement of a request (dispatch, migration commit, failover) has an epoch, and the
stream takes tokens only from its current owner (instance, epoch), or from an older placement for the
indices before the current one began. A copy that lost a race is aborted by epoch (daemons/requests.py).

Failover: the proxy keeps its own view of instance liveness: its connection to each instance (daemons/links.py:
a killed instance closes it at once, a frozen or unreachable one stops answering keepalives), the
instances' heartbeats, and the manager's snapshots while it answers. Slow is not dead: a late heartbeat
alone fails nothing over. When the instance that holds a stream dies, stalls, stops or says it is
unhealthy, the request is submitted to another instance with its prompt plus every token already
streamed, under a new epoch; it continues at the next index, so the client sees nothing but a pause.

Admission: a new request is refused at once (429, Retry-After) while the cluster's queued work is past the
``[admission]`` bounds, counted from the instances' heartbeats and our own dispatches they do not show yet;
high priority has larger bounds. A request that finds no instance that can take it right now waits for
one (admission.queue_timeout_s); with no live instance at all it is refused at once (503).

The objects (each owns its state and receives only what it needs; ``ClusterClient`` builds them, owns the
sockets and tasks, and routes each message to them):

- ``KnownInstances`` (known.py): what we know of the instances: the manager's snapshot, the heartbeats, when
  each was heard from, addresses, CURVE keys; judges liveness (``alive``, ``dead``, ``manager_ok``).
- ``DispatchView`` (view.py): the instances' scores for a local dispatch, and our dispatches their
  heartbeats do not show yet.
- ``InstancePort`` (tokens.py): the sockets to the instances, their link watches, our token address.
- ``ManagerLink`` (managerlink.py): queries to the manager and their answers, the snapshot poll, batched news.
- ``Streams`` (streams.py): the streams by request id and which copy (instance, epoch) may feed each.
- ``Dispatcher`` (dispatch.py): places a stream (asks the manager or chooses here, waits for an instance)
  and submits it under a new epoch.
- ``Failover`` (failover.py): deadlines, dead, stalled or refusing owners, lost Submits, redispatch. It and
  the ``Dispatcher`` are built with one ``Shared`` (shared.py): the settings, the clock, ``KnownInstances``,
  the ``DispatchView`` and the ``InstancePort``.
- ``FairGate`` (fairgate.py) with ``Placing`` and ``Admission`` (admission.py): the fair queue between API
  keys, the requests waiting here, and the bounds a new request is refused past.
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from daemons import metrics, policy, prefix, runtime, security, wire
from daemons.config import parse_adapters
from daemons.clock import Clock
from daemons.links import DOWN, UP, LinkWatch
from daemons.policy import slo
from daemons.proxy.cluster import tokens
from daemons.proxy.cluster.admission import Admission, Placing
from daemons.proxy.cluster.dispatch import Changes, Dispatcher
from daemons.proxy.cluster.failover import FORGET_AFTER_S, Failover
from daemons.proxy.cluster.fairgate import FairGate
from daemons.proxy.cluster.fairness import FairQueue
from daemons.proxy.cluster.known import KnownInstances
from daemons.proxy.cluster.managerlink import ManagerLink
from daemons.proxy.cluster.shared import Shared
from daemons.proxy.cluster.stream import NoInstance, Overloaded, Stream
from daemons.proxy.cluster.streams import Streams
from daemons.proxy.cluster.telemetry import (M_BAD_FRAMES, M_LINKS_DOWN, M_LINKS_HEALED, M_PEERS, M_PREFIX_INDEX,
                                     M_REFUSAL, M_REJECTED, REJECT_REASONS)
from daemons.proxy.cluster.tokens import InstancePort
from daemons.proxy.cluster.traces import StreamTrace
from daemons.proxy.cluster.view import DispatchView
from daemons.sessions import SessionTable
from daemons.tracing import now_ns

log = logging.getLogger("llumnix.proxy")
LORA_TIMEOUT_S = 65.0  # the manager waits up to 60 s for its instances to load an adapter

__all__ = ["M_REFUSAL", "M_REJECTED", "REJECT_REASONS", "ClusterClient", "NoInstance", "Overloaded", "Stream"]


class ClusterClient:
    """The proxy's side of the cluster: a facade over the objects above; it owns the sockets and the tasks,
    and routes what comes in to the object it concerns."""

    def __init__(self, cfg, ctx: zmq.asyncio.Context | None = None, clock: Clock | None = None, tracer=None):
        """``ctx``: the ZeroMQ context its sockets are made in (default: its own). ``clock``: the time its
        liveness, dispatch and stream checks read (default: the monotonic clock; tests/support passes the
        virtual loop's). ``tracer``: daemons/tracing.py's Tracer, with tracing on."""
        self.clock = clock = clock or Clock()
        metrics.bind("proxy", cfg.model.name)
        self.cfg = cfg
        self.pc = pc = cfg.proxy
        self.ctx = ctx if ctx is not None else zmq.asyncio.Context()
        self.sec = security.Security(cfg.security, "proxy", self.ctx)
        self.pull = self.sec.server(runtime.tune(self.ctx.socket(zmq.PULL)), "proxy")  # only instances' keys
        self.pull.setsockopt(zmq.RCVHWM, 0)
        self.manager = self.sec.client(runtime.tune(self.ctx.socket(zmq.DEALER)), "manager")
        self.manager.setsockopt(zmq.IMMEDIATE, 1)  # while the manager is away, fail fast and dispatch locally
        self.tracer = tracer
        self._tasks: list[asyncio.Task] = []
        self.essential: list[asyncio.Task] = []  # if one of these ends, the proxy exits (it would be deaf)
        links = LinkWatch(pc.instance_timeout_s, self._link_changed, lambda _: M_LINKS_HEALED.inc(), clock)  # by address
        self.port = port = InstancePort(self.ctx, self.sec, links)
        self.known = known = KnownInstances(clock, pc.instance_timeout_s, pc.snapshot_interval_s, links.state)
        known.adapters = parse_adapters(cfg.lora.adapters)
        self.view = DispatchView(cfg.manager.pending_dispatch_ttl_s, policy.rules_of(cfg), clock.monotonic)
        self.classes = slo.Classes(cfg.slo)  # each request's class and targets, once (``submit``)
        # Which instance caches which prompt blocks, from their CacheEvents (daemons/prefix.py): learnt again
        # from the instances themselves after a restart, within a heartbeat.
        self.cache_index = prefix.Follower(lambda iid: port.ask_cache(known.address(iid)), clock.monotonic,
                                           cfg.manager.heartbeat_interval_s)
        self.link = ManagerLink(self.manager, clock, pc.snapshot_interval_s, lambda: port.token_address,
                                self._on_snapshot)
        self.ownership = Streams(self.port, self.known.address, self.known.set_address)
        self.placing = Placing(self.clock.monotonic)
        self.changes = Changes()
        # Between API keys (daemons/proxy/cluster/fairgate.py); submits without a key never wait there.
        self.gate = FairGate(FairQueue(clock.monotonic, pc.fair_burst_tokens) if pc.fair_queuing else None, clock,
                             pc.fair_reserve, self.known, self.view, self.placing)
        # The sessions this proxy placed turns of (daemons/sessions.py): admission and dispatch read them.
        self.sessions = SessionTable(cfg.sessions.max_sessions, clock.monotonic)
        self.admission = Admission(cfg.admission, clock, self.known, self.view, self.placing, self.gate.under_share,
                                   cfg.slo, self.classes, self.sessions, self.cache_index.match_tiers)
        shared = Shared(cfg, clock, self.known, self.view, self.port)
        self.failover = Failover(shared, self.ownership, self._dispatch, self._spawn)
        self.dispatcher = Dispatcher(shared, self.cache_index, self.link, self.placing, self.changes,
                                     self.failover.instance_failed, self.sessions)

    # ------------------------------------------------------------------ read-only views for callers and tests

    @property
    def streams(self) -> dict[str, Stream]:
        return self.ownership.by_id

    @property
    def token_address(self) -> str:
        return self.port.token_address

    @token_address.setter
    def token_address(self, address: str) -> None:
        """What ``start`` binds; a test that does not start the client sets it."""
        self.port.token_address = address

    @property
    def instances(self) -> dict[str, zmq.Socket]:
        """The sockets to the instances, by request address."""
        return self.port.sockets

    @property
    def heard(self) -> dict[str, float]:
        return self.known.heard

    @property
    def fair(self) -> FairQueue | None:
        return self.gate.fair

    def alive(self) -> list[wire.InstanceView]:
        return self.known.alive()

    def manager_ok(self) -> bool:
        return self.known.manager_ok()

    def adapters(self) -> dict[str, str]:
        """The LoRA adapters the cluster serves: name -> path (the manager's last snapshot)."""
        return self.known.adapters

    async def lora(self, op: str, name: str, path: str = "") -> wire.Message | None:
        """Ask the manager to load or unload an adapter (daemons/manager/adapters.py): its LoraReply or
        ErrorReply, None if it did not answer. A load it answers is served here at once."""
        reply = await self.link.ask(wire.LoraQuery(self.link.next_id(), op, name, path), LORA_TIMEOUT_S)
        if isinstance(reply, wire.LoraReply):
            if op == "load":
                self.known.adapters[name] = path
            elif op == "unload":
                self.known.adapters.pop(name, None)
        return reply

    def admit(self, request: slo.RequestSlo | int, tenant: str = "", prompt_tokens: int = 0, max_tokens: int = 0,
              request_id: str = "", session: str = ""):
        """Raises Overloaded (daemons/proxy/cluster/admission.py); with an SLO, returns the verdict. ``request``: its
        SLO class and targets (``classes.of``, where the proxy parsed it), or its priority (its class's). Every
        proxy the manager hears from admits into the same instances: each counts the others' admissions too.
        ``request_id``: admitted, it counts at once as placing here, until its dispatch. ``session``: its session
        (its cached prompt is not counted as work)."""
        return self.admission.admit(request if isinstance(request, slo.RequestSlo) else self.classes.of(request),
                                    tenant, prompt_tokens, max_tokens, self.known.proxies, request_id, session)

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        self.sec.check_bind("proxy.token_address", self.pc.token_address)
        bound = runtime.bind(self.pull, self.pc.token_address)
        self.port.token_address = self.pc.advertise_address or bound
        runtime.connect(self.manager, self.cfg.manager.address)
        self._tasks = [asyncio.create_task(c) for c in
                       (tokens.receive(self.pull, self.sec.enabled, self.on_instance_message), self.link.receive(),
                        self.link.poll(), self._watch())]
        self.essential = list(self._tasks)
        log.info("token path on %s, manager %s", self.token_address, self.cfg.manager.address)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.ownership.abort_all()
        self.port.close()
        self.sec.close()
        self.ctx.destroy(linger=0)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    # ------------------------------------------------------------------ requests

    async def submit(self, submit: wire.Submit, tenant: str = "", weight: float = 1.0, give_up_s: float = 0.0,
                     slo_: slo.RequestSlo | None = None, fits: tuple[str, ...] = ()) -> Stream:
        """Dispatch and send a request; the returned stream yields its tokens. Raises NoInstance. ``tenant``:
        the name of its API key, for the fair queue between keys (daemons/proxy/cluster/fairgate.py); ``weight``: that
        key's share. ``give_up_s``: with no token that long after now, it ends with 429 (0: never). ``slo_``: its
        SLO class and targets as the proxy parsed them (None: its priority's class's). ``fits``: the instances
        admission by SLO predicted to meet its target (its first placement is among them; empty: any)."""
        now = self.clock.monotonic()
        stream = Stream(submit.request_id, submit, self.pc.request_timeout_s, now,
                        slo_ if slo_ is not None else self.classes.of(submit.priority))
        if give_up_s > 0:
            stream.first_by = now + give_up_s
        if fits:
            stream.fits = frozenset(fits)
        if self.tracer is not None and submit.traceparent:
            stream.trace = StreamTrace(self.tracer, submit.traceparent)
        self.ownership.add(stream)
        try:
            if self.gate.queues(tenant, submit.priority):  # high priority does not queue here
                since = now_ns() if stream.trace is not None else 0
                turn = await self.gate.take_turn(stream, tenant, weight)
                if stream.trace is not None:
                    stream.trace.queued(since, tenant, turn)
                if turn:
                    try:
                        if not stream.done:
                            await self._dispatch(stream)
                    finally:
                        self.gate.turn_taken()
            else:
                await self._dispatch(stream)
        except BaseException:
            self.ownership.drop(submit.request_id)
            self.gate.turn_ended(stream)
            raise
        return stream

    async def _dispatch(self, stream: Stream) -> None:
        await self.dispatcher.dispatch(stream)

    def finish(self, stream: Stream) -> None:
        """Forget a stream; abort it on its instance if it is still running there (client went away, stop string)."""
        self.gate.turn_ended(stream)
        self.ownership.finish(stream)

    # ------------------------------------------------------------------ what comes in

    def on_instance_message(self, msg: wire.Message | None, key: str | None = None) -> None:
        """One message on the token path (tokens, heartbeats, ownership claims, give-backs, refusals);
        ``key``: its sender's CURVE key, "role:name" (None: not checked, no CURVE)."""
        known = self.known
        if key is not None and getattr(msg, "instance_id", "") and not known.from_owner(msg.instance_id, key):
            return
        if isinstance(msg, wire.TokenBatch):
            self.ownership.tokens(msg.instance_id, msg.outputs, known.heard_tokens(msg.instance_id))
        elif isinstance(msg, wire.Heartbeat):
            self.view.heard(msg, known.heard_beat(msg))
            self.cache_index.on_beat(msg.instance_id, msg.cache_epoch, msg.cache_seq)
            self.failover.check_taken(msg)
            if self.changes or self.gate.waiting():
                self._wake_waiting()
        elif isinstance(msg, wire.CacheEvents):
            self.cache_index.on_events(msg)
            M_PREFIX_INDEX.set(self.cache_index.index.entries())
        elif isinstance(msg, wire.Moved):  # a migration committed: follow the request to its new owner
            stream = self.ownership.get(msg.request_id)
            if stream is not None and not stream.done:
                self.ownership.moved(stream, msg, self.clock.monotonic())
        elif isinstance(msg, wire.Redispatch):
            stream = self.ownership.get(msg.request_id)
            if stream is not None and not stream.done and stream.instance_id == msg.instance_id:
                self.failover.give_back(stream, msg)
        elif isinstance(msg, wire.RequestFailed):
            stream = self.ownership.get(msg.request_id)
            if stream is not None and stream.instance_id == msg.instance_id:
                self.failover.refused(stream, msg)
        else:
            M_BAD_FRAMES.inc()

    def _on_snapshot(self, msg: wire.Snapshot) -> None:
        self.known.took_snapshot(msg)
        self._wake_waiting()
        self.view.invalidate()
        M_PEERS.set(msg.proxies)
        for v in msg.instances:
            if v.state != "dead" and v.request_address:
                self.port.greet(v.request_address)  # an instance streams its load to the proxies it knows
        self.failover.check_gone(msg.uptime_s, self.link.asked_at)

    def _link_changed(self, address: str, state: str) -> None:
        if state == DOWN:
            M_LINKS_DOWN.inc()
            ids = [iid for iid, a in self.known.addresses.items() if a == address]
            log.warning("lost the connection to instance %s at %s (its process is gone, or it answered no keepalive "
                        "for %gs)", "/".join(ids) or "?", address, self.pc.instance_timeout_s)
            self.view.invalidate()
            self.failover.check_streams(self.clock.monotonic())
        elif state == UP:
            self.view.invalidate()
            self._wake_waiting()

    def _wake_waiting(self) -> None:
        """What instances can take may have changed: dispatches waiting for one look again, and the fair
        queue's head may go."""
        self.changes.wake()
        self.gate.pump()

    async def _watch(self) -> None:
        """Each heartbeat: tell the instances we are here; fail over streams whose instance is silent,
        unhealthy or stalled; end requests past their deadline."""
        period = min(self.cfg.manager.heartbeat_interval_s, self.pc.instance_timeout_s / 4)
        while True:
            await self.clock.sleep(period)
            self.port.greet_all()
            now = self.clock.monotonic()
            self.failover.check_streams(now)
            self.forget_departed(now)
            self.gate.forget_idle()
            self.gate.pump()  # our own dispatches age out of the room count

    def forget_departed(self, now: float) -> None:
        """Instances gone for good: not live in the manager's view, holding none of our streams and not heard
        from for ``FORGET_AFTER_S``. Their sockets (and link watches) close and their records go, or a fleet
        that restarts instances on new ports would grow the proxy, and its heartbeats, for ever."""
        if not self.known.manager_ok():  # without a current view, absence from it says nothing
            return
        for iid in self.known.departed(now, FORGET_AFTER_S):
            self.known.forget(iid)
            self.failover.forget(iid)
            self.cache_index.forget(iid)
        self.port.close_unless(self.known.live_addresses() | {s.address for s in self.ownership if s.address})
