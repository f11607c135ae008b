"""Re-homing idle sessions: every sessions.rehome_interval_s the manager pairs hot instances holding idle sessions'
KV with cooler ones that have a host tier (daemons/policy/rehome.py) and orders each hot one to move up to
sessions.rehome_sessions of them there (wire.Rehome; the instances do it, daemons/migration/rehome.py). An order
is said once: the instances count what moved (llumnix_sessions_rehomed_total), and the next round sees the result
in their load reports."""

from __future__ import annotations

import logging

from daemons import wire
from daemons.manager.shared import Shared
from daemons.policy.rehome import RehomePair, rehome_pairs

log = logging.getLogger("llumnix.manager")


class Rehomer:
    """Owns the count of re-homing orders sent (``ordered``)."""

    def __init__(self, shared: Shared):
        self.cfg, self.cluster, self.clock, self.send = shared.cfg, shared.cluster, shared.clock, shared.send
        self.ordered = 0

    @property
    def on(self) -> bool:
        return self.cfg.sessions.rehome_sessions > 0

    async def loop(self) -> None:
        """A round every sessions.rehome_interval_s, for as long as the manager runs. Started only where re-homing
        is on (``on``): a manager task that ends is a failure the manager exits on."""
        ss = self.cfg.sessions
        while True:
            await self.clock.sleep(ss.rehome_interval_s)
            self.once()

    def plan(self) -> list[RehomePair]:
        sc, now = self.cfg.scheduling, self.clock.monotonic()
        states = [self.cluster.state(r, now) for r in self.cluster.records() if r.state != "dead"]
        return rehome_pairs(states, sc.high_priority_headroom, sc.migrate_out_threshold, sc.migrate_in_threshold,
                            self.cfg.sessions.rehome_sessions)

    def once(self) -> list[RehomePair]:
        pairs = self.plan()
        for p in pairs:
            src, dst = self.cluster.get(p.src), self.cluster.get(p.dst)
            if src is None or dst is None:
                continue
            log.debug("re-home up to %d idle session(s) %s -> %s", p.count, p.src, p.dst)
            self.send(src, wire.Rehome(p.dst, dst.info.request_address, p.count))
            self.ordered += 1
        return pairs
