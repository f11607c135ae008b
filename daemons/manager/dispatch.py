"""Dispatch: each new request to the freest instance by the policy in force, and the pending-dispatch ledger
(dispatches the instances' reports do not show yet count as usage), also for the proxies' own dispatches."""

from __future__ import annotations

import logging

from daemons import policy, wire
from daemons.clock import Clock
from daemons.config import ManagerConfig
from daemons.manager.records import (M_CACHE_DISPATCHES, M_DISAGG, M_DISPATCHES, M_NO_INSTANCE, InstanceRecord,
                                     Policies)
from daemons.manager.view import ClusterView
from daemons.policy import slo
from daemons.prefix import PrefixIndex

log = logging.getLogger("llumnix.manager")


class Dispatcher:
    """Owns the dispatch turn and count, and writes each record's ledger (``pending``, ``dispatched_n``)."""

    def __init__(self, cluster: ClusterView, policies: Policies, index: PrefixIndex, clock: Clock,
                 mc: ManagerConfig, rules: policy.Rules, classes: slo.Classes):
        """``index``: which instance caches which prompt blocks (read by the prefix-aware policies and the
        disaggregation decision). ``rules``: what dispatch reads of the settings; ``classes``: the [slo] targets
        per class, which each dispatch query's request gets once, where it comes in."""
        self.rules = rules
        self.classes = classes
        self.cluster = cluster
        self.policies = policies
        self.index = index
        self.clock = clock
        self.mc = mc
        self.turn = 0
        self.dispatched_total = 0
        cluster.on_forget(lambda r: M_DISPATCHES.remove(r.instance_id))

    def on_dispatch_batch(self, msgs: list[wire.Dispatch]) -> list[wire.DispatchReply]:
        """Dispatch queries that arrived together: higher scheduling priority first, each to the freest
        instance with the ones before it counted there."""
        now = self.clock.monotonic()
        for r in self.cluster.records():
            r.retire_pending(now, self.mc.pending_dispatch_ttl_s)
        chosen: list[str | None] = [None] * len(msgs)
        states = self.cluster.states(now)
        asks = [policy.Ask(m.prompt_tokens, m.priority, self.classes.of(m.priority), adapter=m.adapter) for m in msgs]
        if policy.disagg.active(states):
            decisions: list[str] = [""] * len(msgs)
            return self._replies(msgs, self._disaggregated(msgs, asks, now, decisions), decisions)
        cached = self._cache_hits(msgs)
        plain = [i for i, m in enumerate(msgs) if not m.exclude and i not in cached and not m.adapter]
        p = self.policies.dispatch
        if plain:
            picks = policy.dispatch_batch(p, states, [(msgs[i].priority, msgs[i].prompt_tokens + 1) for i in plain],
                                          self.turn, self.rules.headroom,
                                          {c: t.tpot_s for c, t in self.classes.targets.items()})
            for i, iid in zip(plain, picks):
                chosen[i] = iid
                if iid is not None:
                    self._count_dispatch(self.cluster.instances[iid], msgs[i], now)
        # Re-dispatches that must avoid the instances they failed on, requests whose prompt some instance caches
        # (prefix-aware policies) and LoRA requests (residency): one at a time, in priority order.
        for i in sorted((i for i, m in enumerate(msgs) if m.exclude or i in cached or m.adapter),
                        key=lambda i: -msgs[i].priority):
            states = self._states(msgs[i], now)
            ask = policy.Ask(asks[i].prompt_tokens, asks[i].priority, asks[i].slo, cached.get(i), msgs[i].adapter)
            chosen[i] = policy.place(p, states, ask, self.turn + i, self.rules).instance_id
            if i in cached:
                blind = chosen[i] if chosen[i] not in cached[i] else policy.place(
                    p, states, asks[i], self.turn + i, self.rules).instance_id
                M_CACHE_DISPATCHES.labels("load" if blind == chosen[i] else "cache").inc()
            if chosen[i] is not None:
                self._count_dispatch(self.cluster.instances[chosen[i]], msgs[i], now)
        self.turn += len(msgs)
        return self._replies(msgs, chosen)

    def _states(self, msg: wire.Dispatch, now: float) -> list[policy.InstanceState]:
        """The instances' states for one query, those it failed on not taking requests."""
        excluded = set(msg.exclude)
        return [self.cluster.state(r, now, excluded=r.instance_id in excluded) for r in self.cluster.records()]

    def _disaggregated(self, msgs: list[wire.Dispatch], asks: list[policy.Ask], now: float,
                       decisions: list[str]) -> list[str | None]:
        """With roles: each request (higher priority first) placed by ``policy.place`` (the pool the
        disaggregation decision picks, then the dispatch policy within it), the ones before it counted."""
        chosen: list[str | None] = [None] * len(msgs)
        hits = self._cache_hits(msgs, any_policy=True)
        for i in sorted(range(len(msgs)), key=lambda i: -msgs[i].priority):
            ask = policy.Ask(asks[i].prompt_tokens, asks[i].priority, asks[i].slo, hits.get(i), msgs[i].adapter)
            placed = policy.place(self.policies.dispatch, self._states(msgs[i], now), ask, self.turn + i, self.rules)
            M_DISAGG.labels(placed.decision).inc()
            decisions[i], chosen[i] = placed.decision, placed.instance_id
            if chosen[i] is not None:
                self._count_dispatch(self.cluster.instances[chosen[i]], msgs[i], now)
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
        """The prefix-aware policies: for each query whose prompt some instance caches, the cached leading blocks of it on
        each instance that holds some (from our prefix index). ``any_policy``: whatever the policy (the
        disaggregation decision weighs what the decode instances cache)."""
        if (not any_policy and not self.policies.dispatch.prefix_aware) or not len(self.index):
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
