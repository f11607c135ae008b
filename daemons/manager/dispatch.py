"""Dispatch: each new request to the freest instance by the policy in force, and the pending-dispatch ledger
(dispatches the instances' reports do not show yet count as usage), also for the proxies' own dispatches."""

from __future__ import annotations

import logging

from daemons import policy, wire
from daemons.manager.records import M_DISPATCHES, M_NO_INSTANCE, InstanceRecord

log = logging.getLogger("llumnix.manager")


class DispatchMixin:
    """Of the Manager: writes each record's ``pending`` and ``dispatched_n``, and ``turn`` and ``dispatched_total``."""

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
