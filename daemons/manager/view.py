"""The cluster view: each instance's scheduling state (cached between reports), the view that status and the
proxies' snapshots carry, the proxies' ranks, and the per-instance gauges."""

from __future__ import annotations

from daemons import policy, wire
from daemons.manager.records import M_CORDONED, M_DRAINING, M_FREENESS, M_INSTANCES, M_USAGE, InstanceRecord


class ViewMixin:
    """Of the Manager: reads ``instances``, the policies in force and the rescheduler's counters."""

    @property
    def migrating(self) -> bool:
        """Whether balancing migrations run: the llumnix dispatch policy with pairing on (drains always run)."""
        return self.dispatch_policy in policy.MIGRATING_POLICIES and self.pairing_policy != "off"
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
            credit=credit, migrations=r.orders, scale_in_protected=r.info.scale_in_protected)
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
                migrations_ordered=r.orders, credit=round(s.credit, 2), key=r.principal,
                scale_in_protected=r.info.scale_in_protected,
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
