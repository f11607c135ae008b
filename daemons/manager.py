"""llumnix-manager: the global scheduler.

Holds the cluster view (instances and their latest load reports, draining and cordoned flags), answers
dispatch queries by virtual usage, marks an instance dead when its connection says its process is gone
(daemons/links.py: a late report alone only makes it late), and serves admin queries. The rescheduler (daemons/rescheduler.py) pairs instances for migration, drains, removes and
scales them. The manager keeps no durable state: after a restart, instances re-register on their next
report (the manager answers an unknown reporter with a RegisterAck that asks for it), repeating the
flags they were given.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Annotated, Optional

import typer
import zmq
import zmq.asyncio

from daemons import metrics, policy, runtime, security, wire
from daemons.clock import Clock
from daemons.cli import load_or_exit
from daemons.config import Config
from daemons.links import DOWN, UP, LinkWatch
from daemons.rescheduler import Rescheduler

log = logging.getLogger("llumnix.manager")

M_INSTANCES = metrics.gauge("manager", "llumnix_manager_instances", "Instances in the cluster view, by state", ["state"],
                            preset=[("alive",), ("stopping",), ("dead",)])
M_DISPATCHES = metrics.counter("manager", "llumnix_manager_dispatches_total", "Dispatch decisions, by instance",
                               ["instance_id"])
M_NO_INSTANCE = metrics.counter("manager", "llumnix_manager_dispatch_failures_total",
                                "Dispatch queries with no eligible instance")
M_DEATHS = metrics.counter("manager", "llumnix_manager_instance_deaths_total",
                           "Instances marked dead: their connection went down, or (connection not watched, or up "
                           "but silent past manager.silent_dead_s) they stopped reporting")
M_LATE = metrics.counter("manager", "llumnix_manager_late_instances_total",
                         "Times an instance missed manager.dead_after_missed heartbeats while its connection was "
                         "up: late, kept in dispatch, not marked dead")
M_LINKS_HEALED = metrics.counter("manager", "llumnix_manager_instance_links_healed_total",
                                 "Connections to instances dropped (no keepalive answered within "
                                 "manager.link_timeout_s) that a reconnection healed: not marked dead")
# Per instance, what only the manager knows. What an instance knows of itself (blocks used, running and waiting
# requests) is exported by the instance alone: llumnix_instance_kv_blocks_used, _running_requests, _waiting_requests.
M_FREENESS = metrics.gauge("manager", "llumnix_instance_freeness",
                           "Freeness (M - sum V) / B as the manager computes it (-Inf while draining)", ["instance_id"])
M_USAGE = metrics.gauge("manager", "llumnix_instance_virtual_usage_blocks",
                        "Virtual usage sum V in blocks (+Inf while draining)", ["instance_id"])
M_DRAINING = metrics.gauge("manager", "llumnix_instance_draining",
                           "1 while the instance drains (drain, remove, scale-in, stopping)", ["instance_id"])
M_CORDONED = metrics.gauge("manager", "llumnix_instance_cordoned", "1 while the instance takes no new requests",
                           ["instance_id"])
M_BAD_FRAMES = metrics.counter("manager", "llumnix_manager_malformed_frames_total",
                               "Frames dropped because they did not decode")
M_REFUSED = metrics.counter("manager", "llumnix_manager_refused_messages_total",
                            "Messages refused because the sender's key (role) may not send them")
_PER_INSTANCE = (M_FREENESS, M_USAGE, M_DRAINING, M_CORDONED)


@dataclass
class InstanceRecord:
    info: wire.Register
    identity: bytes
    load: wire.InstanceLoad
    last_seen: float
    state: str = "alive"  # alive | stopping (said goodbye, still serves what it has) | dead (connection lost)
    drain_reason: str = ""  # non-empty while draining: operator, remove, scale-in (stopping drains too)
    cordoned: bool = False
    registered_at: float = 0.0
    credit0: float = 0.0  # blocks of negative usage it started with (a new instance joining a loaded cluster)
    credit_age0: float = 0.0  # its age when it registered
    orders: int = 0  # manager-ordered migrations in flight with it as source or destination
    # Dispatches not yet visible in the instance's reports: (dispatch number, blocks, time). They count as
    # usage so that a burst between two reports does not all land on the same "freest" instance.
    dispatched_n: int = 0
    pending: deque = field(default_factory=deque)
    principal: str = ""  # role:name of the key it registered with (CURVE); another key cannot take its id
    gauge_state: str = ""  # its state as llumnix_manager_instances last counted it
    reports: int = 0  # load reports taken (the cached policy state below is of one of them)
    state_key: tuple = ()
    cached_state: object = None
    late: bool = False  # missed heartbeats with its connection up (logged once per episode)
    probe: object = None  # a DEALER to its request socket that only carries keepalives (daemons/links.py)

    @property
    def instance_id(self) -> str:
        return self.info.instance_id

    @property
    def draining(self) -> bool:
        return bool(self.drain_reason) or self.state == "stopping"

    def credit(self, now: float, window_s: float) -> float:
        return policy.fading_credit(self.credit0, self.credit_age0 + now - self.registered_at, window_s)

    def retire_pending(self, now: float, ttl: float) -> None:
        received = self.load.requests_received
        while self.pending and (self.pending[0][0] <= received or now - self.pending[0][2] > ttl):
            self.pending.popleft()


LOOKUP_TIMEOUT_S = 10.0  # how long a lookup of one request waits for busy instances (it ends once one holds it)


@dataclass
class _Fanout:
    """A ListRequests query out to instances."""

    done: asyncio.Future
    missing: set[str]  # instances that have not answered yet
    results: dict[str, wire.RequestList]  # answers by instance id
    want: str = ""  # one request id: done as soon as an instance holds it


# Who may send what to the manager when cluster sockets use CURVE keys (the role comes from the key).
_VERBS: dict[str, tuple[type, ...]] = {
    "instance": (wire.Register, wire.LoadReport, wire.Goodbye, wire.RequestList, wire.MigrateResult),
    "proxy": (wire.Dispatch, wire.Dispatched, wire.SnapshotQuery, wire.StatusQuery),
    "reader": (wire.StatusQuery, wire.SnapshotQuery, wire.RequestsQuery, wire.PolicyQuery),  # policy: read only
    "operator": (wire.StatusQuery, wire.SnapshotQuery, wire.RequestsQuery, wire.PolicyQuery, wire.MigrateQuery,
                 wire.DrainQuery, wire.RemoveQuery, wire.AddQuery),
}


class Manager:
    def __init__(self, cfg: Config, clock: Clock | None = None):
        metrics.bind("manager", cfg.model.name)
        self.cfg = cfg
        self.clock = clock or Clock()  # the simulator passes its virtual clock
        self.mc = cfg.manager
        self.sc = cfg.scheduling
        # The policies in force: from the config, changed at run time by `llumnixctl policy`.
        self.dispatch_policy = self.mc.dispatch_policy
        self.pairing_policy = self.sc.pairing_policy
        self.request_selection = self.sc.request_selection
        self.scaling_policy = cfg.scaling.policy
        self.instances: dict[str, InstanceRecord] = {}
        self.turn = 0
        self.dispatched_total = 0
        self.started = self.clock.monotonic()
        self.ctx = zmq.asyncio.Context()
        self.sec = security.Security(cfg.security, "manager", self.ctx)
        self.sock = self.sec.server(runtime.tune(self.ctx.socket(zmq.ROUTER)), "manager")
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.bound = ""
        self.query_ids = itertools.count(1)
        self._fanouts: dict[int, _Fanout] = {}
        self._tasks: set[asyncio.Task] = set()
        self.resched = Rescheduler(self)
        self._refused_logged: dict[tuple[str, str], float] = {}
        self.sender = ""  # role:name of the message being handled (CURVE keys), for handlers that need it
        self._asked_to_register: dict[str, float] = {}  # instance id -> when we last asked it to register
        self.proxies: dict[str, float] = {}  # proxy token address -> when it last asked for a snapshot
        self.links = LinkWatch(self.mc.link_timeout_s, self._link_changed, lambda _: M_LINKS_HEALED.inc())

    # ------------------------------------------------------------------ view

    @property
    def migrating(self) -> bool:
        """Whether balancing migrations run: the llumnix dispatch policy with pairing on (drains always run)."""
        return self.dispatch_policy in policy.MIGRATING_POLICIES and self.pairing_policy != "off"

    def dead_after(self) -> float:
        return self.mc.heartbeat_interval_s * self.mc.dead_after_missed

    def state(self, r: InstanceRecord, now: float, excluded: bool = False) -> policy.InstanceState:
        # Every dispatch batch and pairing round reads every instance's state: build it again only when
        # something it is made of changed (a report, a dispatch or its retirement, a flag, an order, the
        # credit while it fades).
        credit = r.credit(now, self.sc.new_instance_credit_s) if r.credit0 else 0.0
        key = (r.reports, r.dispatched_n, len(r.pending), r.state, r.drain_reason, r.cordoned, r.orders, credit)
        if not excluded and r.state_key == key:
            return r.cached_state
        s = policy.state_of(
            r.instance_id, r.load, pending_blocks=sum(b for _, b, _ in r.pending), pending_requests=len(r.pending),
            alive=r.state != "dead" and not r.load.stalled and not excluded, draining=r.draining, cordoned=r.cordoned,
            credit=credit, migrations=r.orders)
        if not excluded:
            r.state_key, r.cached_state = key, s
        return s

    def states(self, now: float) -> list[policy.InstanceState]:
        return [self.state(r, now) for r in self.instances.values()]

    def view(self, now: float) -> list[wire.InstanceView]:
        out = []
        for r in sorted(self.instances.values(), key=lambda r: r.instance_id):
            s = self.state(r, now)
            out.append(wire.InstanceView(
                instance_id=r.instance_id, host=r.info.host, pid=r.info.pid, state=r.state,
                request_address=r.info.request_address, backend=r.info.backend, model=r.info.model,
                load=r.load, freeness=round(policy.instance_freeness(s, self.sc.high_priority_headroom), 4),
                last_report_age_s=round(now - r.last_seen, 3), metrics_address=r.info.metrics_address,
                draining=r.draining, pending_dispatches=len(r.pending), max_model_len=r.info.max_model_len,
                virtual_usage=round(policy.virtual_usage(s, self.sc.high_priority_headroom), 2),
                cordoned=r.cordoned, drain_reason=r.drain_reason or ("stopping" if r.state == "stopping" else ""),
                migrations_ordered=r.orders, credit=round(s.credit, 2),
            ))
        return out

    def proxy_rank(self, proxy: str, now: float) -> tuple[int, int]:
        """(rank, count) of ``proxy`` among the proxies whose snapshot queries we heard lately. Proxies that
        dispatch from their own views offset their tie rotations by it, so that a burst over equally free
        instances spreads instead of every proxy picking the same first one."""
        if proxy:
            self.proxies[proxy] = now
        horizon = now - max(10 * self.mc.heartbeat_interval_s, 5.0)
        if any(t < horizon for t in self.proxies.values()):
            self.proxies = {p: t for p, t in self.proxies.items() if t >= horizon}
        ranked = sorted(self.proxies)
        return (ranked.index(proxy) if proxy in self.proxies else 0), len(ranked)

    def snapshot(self, query_id: int, proxy: str = "") -> wire.Snapshot:
        now = self.clock.monotonic()
        rank, proxies = self.proxy_rank(proxy, now)
        return wire.Snapshot(query_id=query_id, instances=self.view(now), dispatch_policy=self.dispatch_policy,
                             uptime_s=round(now - self.started, 3), dispatched_total=self.dispatched_total,
                             pairing_policy=self.pairing_policy, request_selection=self.request_selection,
                             scaling_policy=self.scaling_policy, migrating=self.migrating,
                             ordered_migrations=dict(self.resched.outcomes), scale_outs=self.resched.scale_outs,
                             scale_ins=self.resched.scale_ins, launching=len(self.resched.launcher.launches),
                             proxies=proxies, proxy_rank=rank)

    def update_gauges(self, r: InstanceRecord, now: float | None = None) -> None:
        iid = r.instance_id
        s = self.state(r, self.clock.monotonic() if now is None else now)
        M_FREENESS.labels(iid).set(policy.instance_freeness(s, self.sc.high_priority_headroom))
        M_USAGE.labels(iid).set(policy.virtual_usage(s, self.sc.high_priority_headroom))
        M_DRAINING.labels(iid).set(1 if r.draining else 0)
        M_CORDONED.labels(iid).set(1 if r.cordoned else 0)
        if r.gauge_state != r.state:  # counting every instance on every report is O(N) per report
            r.gauge_state = r.state
            self._update_gauges_states()

    def _update_gauges_states(self) -> None:
        for state in ("alive", "stopping", "dead"):
            M_INSTANCES.labels(state).set(sum(1 for x in self.instances.values() if x.state == state))

    # ------------------------------------------------------------------ instances

    def send(self, r: InstanceRecord, msg: wire.Message) -> None:
        """To an instance; never waits (a full queue means it is gone, and heartbeats will say so)."""
        if not runtime.send_now(self.sock, [r.identity, wire.encode(msg)]):
            log.warning("could not send a %s to instance %s", type(msg).__name__, r.instance_id)

    def on_register(self, ident: bytes, msg: wire.Register) -> wire.Message:
        if msg.wire_version != wire.WIRE_VERSION:
            log.warning("instance %s speaks wire version %d, we speak %d: refused", msg.instance_id, msg.wire_version, wire.WIRE_VERSION)
            return wire.RegisterAck(msg.instance_id, accepted=False, final=True,
                                    reason=f"wire version {msg.wire_version} != {wire.WIRE_VERSION}")
        now = self.clock.monotonic()
        old = self.instances.get(msg.instance_id)
        principal = self.sender
        if old is not None and old.state != "dead" and old.principal != principal:
            log.warning("refused a registration of instance %s by key %s: it is registered by key %s and alive",
                        msg.instance_id, principal or "(none)", old.principal or "(none)")
            return wire.RegisterAck(msg.instance_id, accepted=False, final=True,
                                    reason=f"instance id {msg.instance_id} is taken by another key's live instance")
        rec = InstanceRecord(info=msg, identity=ident, load=msg.load, last_seen=now, registered_at=now,
                             credit_age0=msg.uptime_s)
        rec.dispatched_n = msg.load.requests_received
        rec.principal = principal
        rec.cordoned = msg.cordoned
        rec.drain_reason = "" if msg.drain_reason == "stopping" else msg.drain_reason
        if msg.drain_reason == "stopping":
            rec.state = "stopping"
        if old is not None:
            rec.drain_reason = rec.drain_reason or old.drain_reason
            rec.cordoned = rec.cordoned or old.cordoned
            rec.orders, rec.credit0, rec.credit_age0, rec.registered_at = old.orders, old.credit0, old.credit_age0, old.registered_at
            log.info("instance %s re-registered (pid %d, was %s)", msg.instance_id, msg.pid, old.state)
        else:
            # A new instance joining a cluster that has work is filled first (negative usage for a while).
            if any(r.state == "alive" and (r.load.running or r.load.waiting) for r in self.instances.values()):
                rec.credit0 = self.sc.new_instance_credit * msg.load.blocks_total
            log.info("instance %s registered: %s pid %d at %s, %d blocks%s", msg.instance_id, msg.host, msg.pid,
                     msg.request_address, msg.load.blocks_total,
                     f", credit {rec.credit(now, self.sc.new_instance_credit_s):.0f} blocks" if rec.credit0 else "")
            self.resched.launcher.registered(msg.instance_id)
        self.instances[msg.instance_id] = rec
        self._probe(rec, old)
        self.update_gauges(rec, now)
        if rec.drain_reason or rec.cordoned:  # it forgot (restarted) or we did: say it again
            self.resched.tell(rec)
        if old is None and rec.drain_reason in ("remove", "scale-in"):  # we restarted in the middle of it
            self.resched.resume_retirement(rec)
        return wire.RegisterAck(msg.instance_id)

    def on_report(self, ident: bytes, msg: wire.LoadReport) -> wire.Message | None:
        rec = self.instances.get(msg.instance_id)
        if rec is None or (rec.state == "dead" and ident != rec.identity):
            # We restarted, or it was removed, or a new process took a dead one's id (its address and pid
            # differ): ask it to register again, once per heartbeat at most, so that reports it queued while
            # we were away do not each cost a registration.
            now = self.clock.monotonic()
            if now - self._asked_to_register.get(msg.instance_id, -1e9) < self.mc.heartbeat_interval_s:
                return None
            self._asked_to_register[msg.instance_id] = now
            if len(self._asked_to_register) > 10_000:
                self._asked_to_register.clear()
            return wire.RegisterAck(msg.instance_id, accepted=False, reason="unknown instance: register again")
        now = self.clock.monotonic()
        rec.identity, rec.load, rec.last_seen = ident, msg.load, now
        rec.reports += 1
        # Dispatches we never heard of (a proxy's notice lost while we were away) must not make the ones we
        # hear of later look reported already.
        rec.dispatched_n = max(rec.dispatched_n, msg.load.requests_received)
        if rec.state == "dead":
            log.info("instance %s is reporting again: alive", msg.instance_id)
            rec.state = "alive"
        rec.retire_pending(now, self.mc.pending_dispatch_ttl_s)
        self.update_gauges(rec, now)
        return None

    def on_goodbye(self, msg: wire.Goodbye) -> None:
        """The instance is stopping: no more dispatches; its requests migrate out while it finishes."""
        rec = self.instances.get(msg.instance_id)
        if rec is not None and rec.state != "stopping":
            rec.state = "stopping"
            rec.pending.clear()
            log.info("instance %s is stopping (%s); no more dispatches, its requests move out", msg.instance_id,
                     msg.reason or "shutdown")
            self.update_gauges(rec)

    def _probe(self, rec: InstanceRecord, old: InstanceRecord | None) -> None:
        """Watch the connection to ``rec``'s request socket (daemons/links.py): kept from ``old`` when the
        address is the same, else made anew. An address we cannot connect to is left unwatched (UNKNOWN)."""
        address = rec.info.request_address
        if old is not None and old.probe is not None:
            if old.info.request_address == address and not old.probe.closed:
                rec.probe = old.probe
                return
            self._unprobe(old)
        if not address.startswith(("tcp://", "ipc://")):  # the simulator's instances have no socket
            return
        sock = self.links.prepare(runtime.tune(self.ctx.socket(zmq.DEALER)))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        try:
            self.sec.client(sock, "instance")
            self.links.watch(rec.instance_id, sock)  # before the connect: its handshake must not go unseen
            sock.connect(address)
        except (zmq.ZMQError, runtime.StartupError, RuntimeError) as exc:  # RuntimeError: no event loop
            log.warning("cannot watch the connection to instance %s at %r (%s): it is marked dead after "
                        "manager.dead_after_missed missed heartbeats", rec.instance_id, address, exc)
            self.links.forget(rec.instance_id)
            sock.close(0)
            return
        rec.probe = sock

    def _unprobe(self, rec: InstanceRecord) -> None:
        if rec.probe is not None:
            self.links.forget(rec.instance_id)
            rec.probe.close(0)
            rec.probe = None

    def _link_changed(self, instance_id: str, state: str) -> None:
        rec = self.instances.get(instance_id)
        if rec is None or state != DOWN:
            return
        if rec.state == "alive":
            self.mark_dead(rec, "its connection went down (process gone or host unreachable)")
        elif rec.state == "stopping":
            self.forget(rec, "it stopped (connection closed)")

    def mark_dead(self, rec: InstanceRecord, why: str) -> None:
        rec.state = "dead"
        rec.pending.clear()
        self.resched.fail_migrations_from(rec.instance_id)
        M_DEATHS.inc()
        log.warning("instance %s marked dead: %s", rec.instance_id, why)
        self.update_gauges(rec)

    def forget(self, rec: InstanceRecord, why: str) -> None:
        self._unprobe(rec)
        del self.instances[rec.instance_id]
        log.info("instance %s forgotten: %s", rec.instance_id, why)
        for gauge in _PER_INSTANCE:
            gauge.remove(rec.instance_id)  # (nothing to remove if it never reported)
        M_DISPATCHES.remove(rec.instance_id)
        self._update_gauges_states()

    # ------------------------------------------------------------------ dispatch

    def on_dispatch_batch(self, msgs: list[wire.Dispatch]) -> list[wire.DispatchReply]:
        """Dispatch queries that arrived together: higher scheduling priority first, each to the freest
        instance with the ones before it counted there."""
        now = self.clock.monotonic()
        for r in self.instances.values():
            r.retire_pending(now, self.mc.pending_dispatch_ttl_s)
        headroom = self.sc.high_priority_headroom
        chosen: list[str | None] = [None] * len(msgs)
        plain = [i for i, m in enumerate(msgs) if not m.exclude]
        if plain:
            picks = policy.dispatch_batch(self.dispatch_policy, self.states(now),
                                          [(msgs[i].priority, msgs[i].prompt_tokens + 1) for i in plain],
                                          self.turn, headroom)
            for i, iid in zip(plain, picks):
                chosen[i] = iid
                if iid is not None:
                    self._count_dispatch(self.instances[iid], msgs[i], now)
        # Re-dispatches that must avoid the instances they failed on: one at a time, in priority order.
        for i in sorted((i for i, m in enumerate(msgs) if m.exclude), key=lambda i: -msgs[i].priority):
            excluded = set(msgs[i].exclude)
            states = [self.state(r, now, excluded=r.instance_id in excluded) for r in self.instances.values()]
            chosen[i] = policy.dispatch(self.dispatch_policy, states, self.turn + i, headroom, msgs[i].priority)
            if chosen[i] is not None:
                self._count_dispatch(self.instances[chosen[i]], msgs[i], now)
        self.turn += len(msgs)
        replies = []
        for msg, iid in zip(msgs, chosen):
            if iid is None:
                M_NO_INSTANCE.inc()
                replies.append(wire.DispatchReply(msg.query_id, reason="no live instance can take requests"))
                continue
            rec = self.instances[iid]
            log.debug("request %s -> %s", msg.request_id, iid)
            replies.append(wire.DispatchReply(msg.query_id, instance_id=iid, request_address=rec.info.request_address))
        return replies

    def on_dispatched(self, msg: wire.Dispatched) -> None:
        """A proxy placed a request from its own view: count it as if we had chosen it (an instance we do
        not know, or that died meanwhile, is left to the proxy's failover)."""
        rec = self.instances.get(msg.instance_id)
        if rec is not None and rec.state != "dead":
            rec.retire_pending(self.clock.monotonic(), self.mc.pending_dispatch_ttl_s)
            self._count_dispatch(rec, msg, self.clock.monotonic())

    def _count_dispatch(self, rec: InstanceRecord, msg: wire.Dispatch | wire.Dispatched, now: float) -> None:
        rec.dispatched_n += 1
        rec.pending.append((rec.dispatched_n, policy.blocks_for(msg.prompt_tokens + 1, rec.load.block_size), now))
        self.dispatched_total += 1
        M_DISPATCHES.labels(rec.instance_id).inc()

    # ------------------------------------------------------------------ admin queries

    async def on_requests(self, msg: wire.RequestsQuery, want: str = "") -> wire.RequestsReply:
        """Every request on every live instance. A request that migrated while the query was out can be in
        neither answer (the destination answered before its commit, the source after it): the source names
        it among its recent moves, and the destination is asked again. ``want``: one request id; the answer
        may stop at the first instance that holds it, and busy instances are given longer (a lookup before
        an operator's migration must not miss a request on an instance in the middle of a long step)."""
        alive = {r.instance_id: r for r in self.instances.values() if r.state != "dead"}  # stopping ones still serve
        timeout = self.lookup_timeout() if want else self.mc.query_timeout_s
        results, missing = await self._list(alive, timeout, want)
        listed = {q.request_id for rl in results.values() for q in rl.requests}
        if not (want and want in listed):
            by_address = {r.info.request_address: r for r in alive.values()}
            again = {}
            for rl in list(results.values()):
                for rid, address in rl.moved.items():
                    dst = by_address.get(address)
                    if rid not in listed and (not want or rid == want) and dst is not None:
                        again[dst.instance_id] = dst
            if again:
                more, _ = await self._list(again, timeout, want)
                results.update(more)
        rows: dict[str, wire.RequestInfo] = {}
        for rl in results.values():
            for q in rl.requests:
                seen = rows.get(q.request_id)
                if seen is not None and seen.state != "migrating":
                    continue  # listed by both ends of a migration that committed meanwhile: the new owner's row
                rows[q.request_id] = wire.RequestInfo(
                    request_id=q.request_id, instance_id=rl.instance_id, state=q.state, output_tokens=q.output_tokens,
                    prompt_tokens=q.prompt_tokens, blocks=q.blocks, priority=q.priority)
        return wire.RequestsReply(msg.query_id, requests=list(rows.values()), unreachable=sorted(missing))

    def lookup_timeout(self) -> float:
        return max(self.mc.query_timeout_s, LOOKUP_TIMEOUT_S)

    async def _list(self, instances: dict[str, InstanceRecord], timeout: float,
                    want: str = "") -> tuple[dict[str, wire.RequestList], set[str]]:
        """Ask ``instances`` for their requests; (answers by instance, those that did not answer in time)."""
        qid = next(self.query_ids)
        fan = _Fanout(asyncio.get_running_loop().create_future(), set(instances), {}, want)
        self._fanouts[qid] = fan
        for r in instances.values():
            self.send(r, wire.ListRequests(qid))
        try:
            if instances:
                await asyncio.wait_for(asyncio.shield(fan.done), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            self._fanouts.pop(qid, None)
        return fan.results, fan.missing

    def on_request_list(self, msg: wire.RequestList) -> None:
        fan = self._fanouts.get(msg.query_id)
        if fan is None:
            return  # late answer to a finished query
        if msg.instance_id in fan.missing:
            fan.missing.discard(msg.instance_id)
            fan.results[msg.instance_id] = msg
        found = fan.want and any(q.request_id == fan.want and q.state != "migrating" for q in msg.requests)
        if (not fan.missing or found) and not fan.done.done():
            fan.done.set_result(None)

    def on_policy(self, msg: wire.PolicyQuery) -> wire.Message:
        changes = {"dispatch_policy": (msg.dispatch_policy, policy.DISPATCH_POLICIES),
                   "pairing_policy": (msg.pairing_policy, policy.PAIRING_POLICIES),
                   "request_selection": (msg.request_selection, policy.SELECTION_POLICIES),
                   "scaling_policy": (msg.scaling_policy, policy.SCALING_POLICIES)}
        for name, (value, known) in changes.items():
            if value and value not in known:
                return wire.ErrorReply(msg.query_id, f"unknown {name.replace('_', ' ')} {value!r} (known: {', '.join(known)})")
        for name, (value, _) in changes.items():
            if value and value != getattr(self, name):
                log.info("%s: %s -> %s (llumnixctl policy)", name.replace("_", " "), getattr(self, name), value)
                setattr(self, name, value)
        return wire.PolicyReply(msg.query_id, self.dispatch_policy, self.pairing_policy, self.request_selection,
                                self.scaling_policy, self.migrating)

    # ------------------------------------------------------------------ loops

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _impostor(self, msg) -> bool:
        """With keys: a message about a live instance from a key other than the one it registered with."""
        rec = self.instances.get(msg.instance_id)
        if rec is None or rec.state == "dead" or rec.principal == self.sender:
            return False
        M_REFUSED.inc()
        now = self.clock.monotonic()
        if now - self._refused_logged.get((self.sender, msg.instance_id), -60.0) >= 60.0:
            self._refused_logged[(self.sender, msg.instance_id)] = now
            log.warning("refused %s about instance %s from key %s: it registered with key %s",
                        type(msg).__name__, msg.instance_id, self.sender or "(none)", rec.principal or "(none)")
        return True

    async def handle(self, ident: bytes, msg: wire.Message) -> None:
        reply: wire.Message | None = None
        if (self.sec.enabled and isinstance(msg, (wire.LoadReport, wire.Goodbye, wire.RequestList, wire.MigrateResult))
                and self._impostor(msg)):
            if isinstance(msg, wire.LoadReport):  # it would wait forever to be asked to register: tell it why not
                reply = wire.RegisterAck(msg.instance_id, accepted=False, final=True,
                                         reason=f"instance id {msg.instance_id} is taken by another key's live instance")
                await self.sock.send_multipart([ident, wire.encode(reply)])
            return
        if isinstance(msg, wire.LoadReport):
            reply = self.on_report(ident, msg)
        elif isinstance(msg, wire.Register):
            reply = self.on_register(ident, msg)
        elif isinstance(msg, wire.Dispatched):
            self.on_dispatched(msg)
        elif isinstance(msg, wire.SnapshotQuery):
            reply = self.snapshot(msg.query_id, msg.proxy)
        elif isinstance(msg, wire.StatusQuery):
            reply = self.snapshot(msg.query_id)
        elif isinstance(msg, wire.RequestsQuery):
            self.spawn(self._reply_later(ident, self.on_requests(msg)))
        elif isinstance(msg, wire.RequestList):
            self.on_request_list(msg)
        elif isinstance(msg, wire.MigrateQuery):
            self.spawn(self._reply_later(ident, self.resched.on_migrate(msg)))
        elif isinstance(msg, wire.MigrateResult):
            self.resched.on_migrate_result(msg)
        elif isinstance(msg, wire.Goodbye):
            self.on_goodbye(msg)
        elif isinstance(msg, wire.PolicyQuery):
            reply = self.on_policy(msg)
        elif isinstance(msg, wire.DrainQuery):
            reply = self.resched.on_drain(msg)
        elif isinstance(msg, wire.RemoveQuery):
            self.spawn(self._reply_later(ident, self.resched.on_remove(msg)))
        elif isinstance(msg, wire.AddQuery):
            self.spawn(self._reply_later(ident, self.resched.on_add(msg)))
        else:
            log.warning("dropped unexpected %s from a peer", type(msg).__name__)
            M_BAD_FRAMES.inc()
        if reply is not None:
            await self.sock.send_multipart([ident, wire.encode(reply)])

    async def _reply_later(self, ident: bytes, coro) -> None:
        reply = await coro
        await self.sock.send_multipart([ident, wire.encode(reply)])

    def permitted(self, principal: str, msg: wire.Message) -> bool:
        """With CURVE keys, may the sender (``role:name`` from its key) send ``msg``? A refused query is
        answered with an error; anything refused is logged (once a minute per sender and verb)."""
        role = principal.split(":", 1)[0]
        ok = isinstance(msg, _VERBS.get(role, ()))
        if ok and role == "reader" and isinstance(msg, wire.PolicyQuery):
            ok = not any((msg.dispatch_policy, msg.pairing_policy, msg.request_selection, msg.scaling_policy))
        if not ok:
            M_REFUSED.inc()
            verb = type(msg).__name__
            now = self.clock.monotonic()
            if now - self._refused_logged.get((principal, verb), -60.0) >= 60.0:
                self._refused_logged[(principal, verb)] = now
                log.warning("refused %s from %s: role %r may not send it", verb, principal or "an unknown key", role)
        return ok

    async def serve(self, stop: asyncio.Event) -> None:
        secured = self.sec.enabled
        async for batch in runtime.receive(self.sock, multipart=True, copy=not secured):
            dispatches: list[tuple[bytes, wire.Dispatch]] = []
            for frames in batch:
                if len(frames) != 2:
                    M_BAD_FRAMES.inc()
                    log.warning("dropped a message of %d frames (expected 2)", len(frames))
                    continue
                principal = ""
                if secured:
                    principal = self.sec.principal(frames[1])
                    frames = [f.bytes for f in frames]
                msg = wire.decode(frames[1])
                if msg is None:
                    M_BAD_FRAMES.inc()
                elif secured and not self.permitted(principal, msg):
                    if hasattr(msg, "query_id"):
                        reply = wire.ErrorReply(msg.query_id, f"permission denied: key {principal.split(':')[-1]!r} "
                                                              f"may not send {type(msg).__name__} (needs an operator key)")
                        await self.sock.send_multipart([frames[0], wire.encode(reply)])
                elif isinstance(msg, wire.Dispatch):
                    dispatches.append((frames[0], msg))  # after the batch's reports: with the freshest loads
                else:
                    self.sender = principal
                    await self.handle(frames[0], msg)
            if dispatches:
                replies = self.on_dispatch_batch([m for _, m in dispatches])
                for (ident, _), reply in zip(dispatches, replies):
                    await self.sock.send_multipart([ident, wire.encode(reply)])
            await asyncio.sleep(0)  # under a backlog, let the pairing loop and the heartbeat watch run too

    async def watch_heartbeats(self, stop: asyncio.Event) -> None:
        period = self.mc.heartbeat_interval_s / 2
        while not stop.is_set():
            before = self.clock.monotonic()
            await asyncio.sleep(period)
            now = self.clock.monotonic()
            if now - before > 2 * period:
                # We were stalled (no CPU, swapped out): reports may be waiting unread in the socket. Judge
                # nobody on a stale view; read them first.
                log.warning("manager stalled for %.2fs; re-checking heartbeats after reading reports", now - before)
                continue
            for r in list(self.instances.values()):
                silent = now - r.last_seen
                if r.state == "stopping" and silent > self.dead_after() and self.links.state(r.instance_id) != UP:
                    self.forget(r, "it stopped")
                elif r.state == "dead" and silent > self.mc.dead_instance_ttl_s:
                    self.forget(r, f"dead for over {self.mc.dead_instance_ttl_s:g}s")
                elif r.state == "alive" and silent > self.dead_after():
                    self._silent(r, silent)
                elif r.late and silent <= self.dead_after():
                    r.late = False
                    log.info("instance %s reports again (it was late)", r.instance_id)
                if r.state == "alive" and r.credit0 and not math.isclose(r.credit(now, self.sc.new_instance_credit_s), 0.0):
                    self.update_gauges(r, now)  # the credit fades between reports too

    def _silent(self, r: InstanceRecord, silent: float) -> None:
        """No report for over dead_after_missed heartbeats. Slow is not dead: with its connection up (its
        process is there; a busy host delays reports, not keepalives) it is only late, and stays in dispatch
        until manager.silent_dead_s; with a connection we cannot watch, silence is all we have."""
        link = self.links.state(r.instance_id)
        if link == UP and silent <= self.mc.silent_dead_s:
            if not r.late:
                r.late = True
                M_LATE.inc()
                log.info("instance %s has not reported for %.2fs, but its connection is up: late, not dead",
                         r.instance_id, silent)
            return
        why = (f"connection up, but no report for {silent:.1f}s (manager.silent_dead_s)" if link == UP else
               f"no report for {silent:.2f}s ({self.mc.dead_after_missed} heartbeats) and its connection is "
               f"{'down' if link == DOWN else 'not watched'}")
        self.mark_dead(r, why)

    async def run(self) -> None:
        self.sec.check_bind("manager.bind" if self.mc.bind else "manager.address", self.mc.bind or self.mc.address)
        self.bound = runtime.bind(self.sock, self.mc.bind or self.mc.address)
        metrics = runtime.start_metrics_server(self.mc.metrics_port, self.mc.metrics_host, security.metrics_token(self.cfg))
        log.info("serving on %s (dispatch %s, pairing %s, selection %s, scaling %s, heartbeat %.2fs, metrics %s)",
                 self.bound, self.dispatch_policy, self.pairing_policy if self.migrating else "drains only",
                 self.request_selection, self.scaling_policy, self.mc.heartbeat_interval_s, metrics or "off")
        stop = asyncio.Event()
        runtime.install_stop_signals(asyncio.get_running_loop(), stop)
        runtime.sd_notify("READY=1")
        tasks = [asyncio.create_task(c) for c in (self.serve(stop), self.watch_heartbeats(stop),
                                                  self.resched.pairing_loop(), self.resched.scaling_loop())]
        failure = await runtime.first_failure(stop, tasks)
        runtime.sd_notify("STOPPING=1")
        if failure is not None:
            log.error("an essential task failed: %r; exiting so that the service manager restarts us", failure)
        log.info("stopping")
        for t in [*tasks, *self._tasks]:
            t.cancel()
        await asyncio.gather(*tasks, *self._tasks, return_exceptions=True)
        self.links.close()
        self.sec.close()
        self.ctx.destroy(linger=0)
        if failure is not None:
            raise SystemExit(1)


app = typer.Typer(add_completion=False, help="llumnix-manager: the Llumnix global scheduler.")


@app.command()
def main(
    config: Annotated[Optional[str], typer.Option("--config", "-c", help="llumnix.toml (default: $LLUMNIX_CONFIG)")] = None,
    address: Annotated[Optional[str], typer.Option(help="ZeroMQ address to serve on (manager.address)")] = None,
    bind: Annotated[Optional[str], typer.Option(help="address to bind if it differs from --address (manager.bind)")] = None,
    dispatch_policy: Annotated[Optional[str], typer.Option(help="llumnix, infaas++, rr or flood (manager.dispatch_policy)")] = None,
    metrics_port: Annotated[Optional[int], typer.Option(help="Prometheus port; 0 any, -1 off (manager.metrics_port)")] = None,
    log_level: Annotated[Optional[str], typer.Option(help="debug, info, warning, error (manager.log_level)")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override any setting: section.key=value")] = None,
) -> None:
    """Run the global scheduler until SIGTERM."""
    cfg = load_or_exit("llumnix-manager", config, set_, {
        "manager.address": address, "manager.bind": bind, "manager.dispatch_policy": dispatch_policy,
        "manager.metrics_port": metrics_port, "manager.log_level": log_level,
    })
    runtime.setup_logging(cfg.manager.log_level, "llumnix-manager")
    runtime.exit_on_startup_error("llumnix-manager", lambda: Manager(cfg).run())


def entry() -> None:
    app()


if __name__ == "__main__":
    entry()
