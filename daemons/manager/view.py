"""The cluster view: the one owner of the manager's instance records (``ClusterView``), each instance's
scheduling state (cached between reports), the view that status and the proxies' snapshots carry, the
per-instance gauges; what the rescheduler's parts may see of it (``Cluster``); the proxies' ranks."""

from __future__ import annotations

import logging
from types import MappingProxyType
from typing import Callable, Collection, Mapping, Protocol

import msgspec

from daemons import metrics, policy, wire
from daemons.clock import Clock
from daemons.config import SchedulingConfig
from daemons.policy import slo
from daemons.policy.disagg import ROLES
from daemons.manager.records import (M_CORDONED, M_DRAINING, M_FREENESS, M_INSTANCES, M_ROLE, M_USAGE, PER_INSTANCE_GAUGES,
                                     InstanceRecord)

log = logging.getLogger("llumnix.manager")


class Cluster(Protocol):
    """What the rescheduler's parts (orders.py, lifecycle.py, scaling.py) see of the cluster view: the records
    and their states to read, and the few things they change through verbs: an instance's drain and cordon
    flags, its role as told, its count of orders in flight, forgetting it."""

    instances: Mapping[str, InstanceRecord]

    def get(self, instance_id: str) -> InstanceRecord | None: ...
    def records(self) -> Collection[InstanceRecord]: ...
    def state(self, r: InstanceRecord, now: float, excluded: bool = False) -> policy.InstanceState: ...
    def states(self, now: float) -> list[policy.InstanceState]: ...
    def view(self, now: float) -> list[wire.InstanceView]: ...
    def set_flags(self, r: InstanceRecord, drain_reason: str | None = None, cordoned: bool | None = None) -> None: ...
    def count_orders(self, instance_id: str, count: int) -> None: ...
    def set_role(self, r: InstanceRecord, role: str) -> None: ...
    def forget(self, r: InstanceRecord, why: str) -> None: ...


class ClusterView:
    """The instance records by id (only this object adds and removes them) and what is derived from them:
    scheduling states, the status view, gauges. Others that keep something per instance (the connection
    watch, the prefix index, the dispatch counter) subscribe to ``on_forget``."""

    def __init__(self, sc: SchedulingConfig, clock: Clock, slo_tpot: Callable[[], float] = lambda: 0.0,
                 tpot_full: float = 0.95):
        """``slo_tpot``: the TPOT target that virtual usage counts now (0: none, or a policy other than slo)."""
        self.sc = sc
        self.clock = clock
        self.slo_tpot = slo_tpot
        self.tpot_full = tpot_full
        self._instances: dict[str, InstanceRecord] = {}
        self.instances: Mapping[str, InstanceRecord] = MappingProxyType(self._instances)  # read-only
        self._forgotten: list[Callable[[InstanceRecord], None]] = []

    # ------------------------------------------------------------------ records

    def get(self, instance_id: str) -> InstanceRecord | None:
        return self._instances.get(instance_id)

    def records(self) -> Collection[InstanceRecord]:
        return self._instances.values()

    def put(self, r: InstanceRecord, now: float) -> None:
        """A registration: ``r`` is the instance's record from now on (replacing an older one)."""
        self._instances[r.instance_id] = r
        self.update_gauges(r, now)

    def on_forget(self, fn: Callable[[InstanceRecord], None]) -> None:
        """Call ``fn(record)`` when an instance is forgotten."""
        self._forgotten.append(fn)

    def forget(self, r: InstanceRecord, why: str) -> None:
        for fn in self._forgotten:
            fn(r)
        del self._instances[r.instance_id]
        log.info("instance %s forgotten: %s", r.instance_id, why)
        for gauge in PER_INSTANCE_GAUGES:
            gauge.remove(r.instance_id)  # (nothing to remove if it never reported)
        for role in ROLES:
            M_ROLE.remove(r.instance_id, role)
        self._count_states()

    def set_flags(self, r: InstanceRecord, drain_reason: str | None = None, cordoned: bool | None = None) -> None:
        """An operator's (or the rescheduler's) drain reason ("": not draining) or cordon."""
        if drain_reason is not None:
            r.drain_reason = drain_reason
        if cordoned is not None:
            r.cordoned = cordoned
        self.update_gauges(r)

    def set_role(self, r: InstanceRecord, role: str) -> None:
        """The role we just told ``r`` (its next report confirms it): dispatch and pairing see it at once."""
        if r.load.role != role:
            r.load = msgspec.structs.replace(r.load, role=role)
            self.update_gauges(r)

    def count_orders(self, instance_id: str, count: int) -> None:
        """``count`` (negative: ended) more migrations in flight with the instance as source or destination."""
        r = self._instances.get(instance_id)
        if r is not None:
            r.orders = max(0, r.orders + count)

    # ------------------------------------------------------------------ states

    def state(self, r: InstanceRecord, now: float, excluded: bool = False) -> policy.InstanceState:
        # Every dispatch batch and pairing round reads every instance's state: build it again only when
        # something it is made of changed (a report, a dispatch or its retirement, a flag, an order, the
        # credit while it fades).
        credit = r.credit(now, self.sc.new_instance_credit_s) if r.credit0 else 0.0
        tpot = self.slo_tpot()
        key = (r.reports, r.dispatched_n, len(r.pending), r.state, r.drain_reason, r.cordoned, r.orders, credit, tpot,
               r.load.role)
        if not excluded and r.state_key == key:
            return r.cached_state
        s = policy.state_of(
            r.instance_id, r.load, pending_blocks=sum(b for _, b, _ in r.pending), pending_requests=len(r.pending),
            alive=r.state != "dead" and not r.load.stalled and not excluded, draining=r.draining, cordoned=r.cordoned,
            credit=credit, migrations=r.orders, scale_in_protected=r.info.scale_in_protected)
        if tpot > 0:
            s = slo.with_latency_usage(s, tpot, self.tpot_full)
        if not excluded:
            r.state_key, r.cached_state = key, s
        return s

    def states(self, now: float) -> list[policy.InstanceState]:
        return [self.state(r, now) for r in self._instances.values()]

    def view(self, now: float) -> list[wire.InstanceView]:
        out = []
        for r in sorted(self._instances.values(), key=lambda r: r.instance_id):
            s = self.state(r, now)
            out.append(wire.InstanceView(
                instance_id=r.instance_id, host=r.info.host, pid=r.info.pid, state=r.state,
                request_address=r.info.request_address, backend=r.info.backend, model=r.info.model,
                load=r.load, freeness=round(policy.instance_freeness(s, self.sc.high_priority_headroom), 4),
                last_report_age_s=round(now - r.last_seen, 3), metrics_address=r.info.metrics_address,
                draining=r.draining, pending_dispatches=len(r.pending), max_model_len=r.info.max_model_len,
                virtual_usage=round(policy.virtual_usage(s, self.sc.high_priority_headroom), 2),
                cordoned=r.cordoned, drain_reason=r.drain_reason or ("stopping" if r.state == "stopping" else ""),
                migrations_ordered=r.orders, credit=round(s.credit, 2), key=r.principal,
                scale_in_protected=r.info.scale_in_protected,
            ))
        return out

    # ------------------------------------------------------------------ gauges

    def update_gauges(self, r: InstanceRecord, now: float | None = None) -> None:
        if not metrics.counting():
            return
        iid = r.instance_id
        s = self.state(r, self.clock.monotonic() if now is None else now)
        M_FREENESS.labels(iid).set(policy.instance_freeness(s, self.sc.high_priority_headroom))
        M_USAGE.labels(iid).set(policy.virtual_usage(s, self.sc.high_priority_headroom))
        M_DRAINING.labels(iid).set(1 if r.draining else 0)
        M_CORDONED.labels(iid).set(1 if r.cordoned else 0)
        for role in ROLES:
            M_ROLE.labels(iid, role).set(1 if (r.load.role or "mixed") == role else 0)
        if r.gauge_state != r.state:  # counting every instance on every report is O(N) per report
            r.gauge_state = r.state
            self._count_states()

    def _count_states(self) -> None:
        for state in ("alive", "stopping", "dead"):
            M_INSTANCES.labels(state).set(sum(1 for x in self._instances.values() if x.state == state))


class ProxyRanks:
    """The proxies whose snapshot queries we heard lately, for each one's rank among them."""

    def __init__(self, heartbeat_interval_s: float):
        self.heartbeat_interval_s = heartbeat_interval_s
        self.last_heard: dict[str, float] = {}  # proxy token address -> when it last asked for a snapshot

    def rank(self, proxy: str, now: float) -> tuple[int, int]:
        """(rank, count) of ``proxy`` among the proxies heard lately. Proxies that dispatch from their own
        views offset their tie rotations by it, so that a burst over equally free instances spreads instead of
        every proxy picking the same first one."""
        if proxy:
            self.last_heard[proxy] = now
        horizon = now - max(10 * self.heartbeat_interval_s, 5.0)
        if any(t < horizon for t in self.last_heard.values()):
            self.last_heard = {p: t for p, t in self.last_heard.items() if t >= horizon}
        ranked = sorted(self.last_heard)
        return (ranked.index(proxy) if proxy in self.last_heard else 0), len(ranked)
