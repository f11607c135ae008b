"""Dispatch: each new request to the freest instance by the policy in force, and the pending-dispatch ledger
(dispatches the instances' reports do not show yet count as usage), also for the proxies' own dispatches; and the
sessions whose turns were placed, by us or by the proxies (daemons/sessions.py: ``llumnixctl sessions``)."""

from __future__ import annotations

import logging

from daemons import policy, wire
from daemons.clock import Clock
from daemons.config import ManagerConfig
from daemons.manager.records import (M_CACHE_DISPATCHES, M_DISAGG, M_DISPATCHES, M_NO_INSTANCE, InstanceRecord,
                                     Policies)
from daemons.manager.view import ClusterView
from daemons.policy import slo
from daemons.prefix import Follower
from daemons.sessions import SessionTable

log = logging.getLogger("llumnix.manager")


class Dispatcher:
    """Owns the dispatch turn and count and the session table, and writes each record's ledger (``pending``,
    ``dispatched_n``)."""

    def __init__(self, cluster: ClusterView, policies: Policies, index: Follower, clock: Clock,
                 mc: ManagerConfig, rules: policy.Rules, classes: slo.Classes, max_sessions: int = 65536):
        """``index``: which instance caches which prompt blocks, by tier (read by the prefix-aware policies, a
        session's turn and the disaggregation decision). ``rules``: what dispatch reads of the settings;
        ``classes``: the [slo] targets per class, which each dispatch query's request gets once, where it comes in;
        ``max_sessions``: sessions.max_sessions."""
        self.rules = rules
        self.classes = classes
        self.cluster = cluster
        self.policies = policies
        self.index = index
        self.clock = clock
        self.mc = mc
        self.turn = 0
        self.dispatched_total = 0
        self.sessions = SessionTable(max_sessions, clock.monotonic)
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
        plain = [i for i, m in enumerate(msgs) if not m.exclude and i not in cached and not m.adapter and not m.session]
        placed: dict[int, policy.Placement] = {}
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
        # (prefix-aware policies), sessions' turns and LoRA requests (residency): one at a time, in priority order.
        for i in sorted((i for i, m in enumerate(msgs) if m.exclude or i in cached or m.adapter or m.session),
                        key=lambda i: -msgs[i].priority):
            states = self._states(msgs[i], now)
            tiers = cached.get(i)
            ask = policy.Ask(asks[i].prompt_tokens, asks[i].priority, asks[i].slo, _hits(tiers), msgs[i].adapter,
                             tiers, msgs[i].session, self.sessions.home(msgs[i].session))
            placed[i] = policy.place(p, states, ask, self.turn + i, self.rules)
            chosen[i] = placed[i].instance_id
            if i in cached:
                blind = chosen[i] if chosen[i] not in cached[i] else policy.place(
                    p, states, asks[i], self.turn + i, self.rules).instance_id
                M_CACHE_DISPATCHES.labels("load" if blind == chosen[i] else "cache").inc()
            if chosen[i] is not None:
                self._count_dispatch(self.cluster.instances[chosen[i]], msgs[i], now)
        self.turn += len(msgs)
        return self._replies(msgs, chosen, placed=placed)

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
            ask = policy.Ask(asks[i].prompt_tokens, asks[i].priority, asks[i].slo, _hits(hits.get(i)), msgs[i].adapter,
                             hits.get(i), msgs[i].session, self.sessions.home(msgs[i].session))
            placed = policy.place(self.policies.dispatch, self._states(msgs[i], now), ask, self.turn + i, self.rules)
            M_DISAGG.labels(placed.decision).inc()
            decisions[i], chosen[i] = placed.decision, placed.instance_id
            if chosen[i] is not None:
                self._count_dispatch(self.cluster.instances[chosen[i]], msgs[i], now)
        self.turn += len(msgs)
        return chosen

    def _replies(self, msgs: list[wire.Dispatch], chosen: list[str | None],
                 decisions: list[str] | None = None, placed: dict[int, policy.Placement] | None = None
                 ) -> list[wire.DispatchReply]:
        replies = []
        for k, (msg, iid) in enumerate(zip(msgs, chosen)):
            if iid is None:
                M_NO_INSTANCE.inc()
                replies.append(wire.DispatchReply(msg.query_id, reason="no live instance can take requests"))
                continue
            rec = self.cluster.instances[iid]
            log.debug("request %s -> %s", msg.request_id, iid)
            p = (placed or {}).get(k) or policy.Placement(iid)
            replies.append(wire.DispatchReply(msg.query_id, instance_id=iid, request_address=rec.info.request_address,
                                              disagg=decisions[k] if decisions else "", pull_from=p.pull_from,
                                              pull_blocks=p.pull_blocks, how=p.how))
        return replies

    def _cache_hits(self, msgs: list[wire.Dispatch], any_policy: bool = False) -> dict[int, policy.sessions.Tiers]:
        """The prefix-aware policies and sessions' turns: for each query whose prompt some instance caches, its cached
        leading blocks on each instance that holds some, by tier (our prefix index: prefix.match_tiers).
        ``any_policy``: whatever the policy (the disaggregation decision weighs what the decode instances cache)."""
        p = self.policies.dispatch
        if not len(self.index.index) and not len(self.index.host):
            return {}
        out = {}
        for i, m in enumerate(msgs):
            if m.prefix_keys and (any_policy or p.prefix_aware or (m.session and p.follows_sessions)):
                tiers = {iid: t for iid, t in self.index.match_tiers(m.prefix_keys).items() if t[1]}
                if tiers:
                    out[i] = tiers
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
        if msg.session:
            self.sessions.placed(msg.session, rec.instance_id, msg.prefix_keys, msg.prompt_tokens)
        rec.dispatched_n += 1
        rec.pending.append((rec.dispatched_n, policy.blocks_for(msg.prompt_tokens + 1, rec.load.block_size), now))
        self.dispatched_total += 1
        M_DISPATCHES.labels(rec.instance_id).inc()


def _hits(tiers: policy.sessions.Tiers | None) -> dict[str, int] | None:
    """A request's cached leading blocks per instance in any tier (policy.Ask.hits), from its ``tiers``."""
    return {iid: both for iid, (_, both) in tiers.items()} if tiers else None
