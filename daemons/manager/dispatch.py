"""Dispatch: each new request to the freest instance by the policy in force, and the pending-dispatch ledger
(dispatches the instances' reports do not show yet count as usage), also for the proxies' own dispatches."""

from __future__ import annotations

import logging

from daemons import policy, wire
from daemons.clock import Clock
from daemons.config import DisaggConfig, ManagerConfig, SchedulingConfig
from daemons.manager.records import (M_CACHE_DISPATCHES, M_DISAGG, M_DISPATCHES, M_NO_INSTANCE, InstanceRecord,
                                     Policies)
from daemons.manager.view import ClusterView
from daemons.prefix import PrefixIndex

log = logging.getLogger("llumnix.manager")


class Dispatcher:
    """Owns the dispatch turn and count, and writes each record's ledger (``pending``, ``dispatched_n``)."""

    def __init__(self, cluster: ClusterView, policies: Policies, index: PrefixIndex, clock: Clock,
                 mc: ManagerConfig, sc: SchedulingConfig, tpot_targets: dict[int, float] | None = None,
                 dc: DisaggConfig | None = None, ttft_targets: dict[int, float] | None = None):
        """``index``: which instance caches which prompt blocks (read, for llumnix-cache). ``tpot_targets``,
        ``ttft_targets``: per priority class, for the slo policy and the disaggregation decision (``dc``)."""
        self.tpot_targets = tpot_targets or {}
        self.ttft_targets = ttft_targets or {}
        self.dc = dc or DisaggConfig()
        self.cluster = cluster
        self.policies = policies
        self.index = index
        self.clock = clock
        self.mc = mc
        self.sc = sc
        self.turn = 0
        self.dispatched_total = 0
        cluster.on_forget(lambda r: M_DISPATCHES.remove(r.instance_id))

    def on_dispatch_batch(self, msgs: list[wire.Dispatch]) -> list[wire.DispatchReply]:
        """Dispatch queries that arrived together: higher scheduling priority first, each to the freest
        instance with the ones before it counted there."""
        now = self.clock.monotonic()
        for r in self.cluster.records():
            r.retire_pending(now, self.mc.pending_dispatch_ttl_s)
        headroom = self.sc.high_priority_headroom
        chosen: list[str | None] = [None] * len(msgs)
        states = self.cluster.states(now)
        if policy.disagg.active(states):
            decisions: list[str] = [""] * len(msgs)
            return self._replies(msgs, self._disaggregated(msgs, now, decisions), decisions)
        cached = self._cache_hits(msgs)
        plain = [i for i, m in enumerate(msgs) if not m.exclude and i not in cached]
        if plain:
            picks = policy.dispatch_batch(self.policies.dispatch_policy, states,
                                          [(msgs[i].priority, msgs[i].prompt_tokens + 1) for i in plain],
                                          self.turn, headroom, self.tpot_targets)
            for i, iid in zip(plain, picks):
                chosen[i] = iid
                if iid is not None:
                    self._count_dispatch(self.cluster.instances[iid], msgs[i], now)
        # Re-dispatches that must avoid the instances they failed on, and requests whose prompt some instance
        # caches (llumnix-cache): one at a time, in priority order.
        sc = self.sc
        for i in sorted((i for i, m in enumerate(msgs) if m.exclude or i in cached), key=lambda i: -msgs[i].priority):
            excluded = set(msgs[i].exclude)
            states = [self.cluster.state(r, now, excluded=r.instance_id in excluded) for r in self.cluster.records()]
            chosen[i] = policy.dispatch(self.policies.dispatch_policy, states, self.turn + i, headroom, msgs[i].priority,
                                        hits=cached.get(i), cache_band=sc.cache_band, cache_floor=sc.cache_min_freeness,
                                        tpot_target_s=self.tpot_targets.get(1 if msgs[i].priority > 0 else 0, 0.0))
            if i in cached:
                blind = chosen[i] if chosen[i] not in cached[i] else policy.dispatch(
                    self.policies.dispatch_policy, states, self.turn + i, headroom, msgs[i].priority)
                M_CACHE_DISPATCHES.labels("load" if blind == chosen[i] else "cache").inc()
            if chosen[i] is not None:
                self._count_dispatch(self.cluster.instances[chosen[i]], msgs[i], now)
        self.turn += len(msgs)
        return self._replies(msgs, chosen)

    def _disaggregated(self, msgs: list[wire.Dispatch], now: float, decisions: list[str]) -> list[str | None]:
        """With roles: each request (higher priority first) to the pool ``disagg.decide`` picks (prefill remotely,
        or where it will decode), then by the dispatch policy within it, the ones before it counted."""
        chosen: list[str | None] = [None] * len(msgs)
        hits = self._cache_hits(msgs, any_policy=True)
        for i in sorted(range(len(msgs)), key=lambda i: -msgs[i].priority):
            m = msgs[i]
            excluded = set(m.exclude)
            states = [self.cluster.state(r, now, excluded=r.instance_id in excluded) for r in self.cluster.records()]
            rules = policy.disagg.rules_of(self.dc, self.ttft_targets.get(1 if m.priority > 0 else 0, 0.0))
            decision = policy.disagg.decide(states, m.prompt_tokens, hits.get(i), rules, m.priority)
            M_DISAGG.labels(decision.decision).inc()
            decisions[i] = decision.decision
            chosen[i] = policy.dispatch(self.policies.dispatch_policy, decision.pool, self.turn + i,
                                        self.sc.high_priority_headroom, m.priority, hits=hits.get(i),
                                        cache_band=self.sc.cache_band, cache_floor=self.sc.cache_min_freeness,
                                        tpot_target_s=self.tpot_targets.get(1 if m.priority > 0 else 0, 0.0))
            if chosen[i] is not None:
                self._count_dispatch(self.cluster.instances[chosen[i]], m, now)
        self.turn += len(msgs)
        return chosen

    def _replies(self, msgs: list[wire.Dispatch], chosen: list[str | None],
                 decisions: list[str] | None = None) -> list[wire.DispatchReply]:
        replies = []
        for k, (msg, iid) in enumerate(zip(msgs, chosen)):
            if iid is None:
                M_NO_INSTANCE.inc()
                replies.append(wire.DispatchReply(msg.query_id, reason="no live instance can take requests"))
                continue
            rec = self.cluster.instances[iid]
            log.debug("request %s -> %s", msg.request_id, iid)
            replies.append(wire.DispatchReply(msg.query_id, instance_id=iid, request_address=rec.info.request_address,
                                              disagg=decisions[k] if decisions else ""))
        return replies

    def _cache_hits(self, msgs: list[wire.Dispatch], any_policy: bool = False) -> dict[int, dict[str, int]]:
        """llumnix-cache: for each query whose prompt some instance caches, the cached leading blocks of it on
        each instance that holds some (from our prefix index). ``any_policy``: whatever the policy (the
        disaggregation decision weighs what the decode instances cache)."""
        if (not any_policy and self.policies.dispatch_policy not in ("llumnix-cache", "slo")) or not len(self.index):
            return {}
        out = {}
        for i, m in enumerate(msgs):
            if m.prefix_keys:
                hits = {iid: n for iid, n in self.index.match(m.prefix_keys).items() if n}
                if hits:
                    out[i] = hits
        return out

    def on_dispatched(self, msg: wire.Dispatched) -> None:
        """A proxy placed a request from its own view: count it as if we had chosen it (an instance we do
        not know, or that died meanwhile, is left to the proxy's failover)."""
        rec = self.cluster.get(msg.instance_id)
        if rec is not None and rec.state != "dead":
            now = self.clock.monotonic()
            rec.retire_pending(now, self.mc.pending_dispatch_ttl_s)
            self._count_dispatch(rec, msg, now)

    def _count_dispatch(self, rec: InstanceRecord, msg: wire.Dispatch | wire.Dispatched, now: float) -> None:
        rec.dispatched_n += 1
        rec.pending.append((rec.dispatched_n, policy.blocks_for(msg.prompt_tokens + 1, rec.load.block_size), now))
        self.dispatched_total += 1
        M_DISPATCHES.labels(rec.instance_id).inc()
