"""The manager's rescheduling, one object per decision: migration orders (orders.py: the pairing loop,
operators' migrations), instances leaving and joining (lifecycle.py: drain, cordon, remove, add), roles and
handovers (roles.py: prefill/decode disaggregation) and auto-scaling (scaling.py), which launches instances through the launcher (launcher.py). A removed or
scaled-in instance is drained, then told to stop once nothing is left on it.

``Rescheduler`` builds the three and wires them together. It is given what they need (``Shared``, shared.py: the
cluster as the ``Cluster`` protocol of view.py, an order port to send to an instance, a way to spawn tasks; and a
way to look a request up), not the manager.
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

from daemons import policy, wire
from daemons.manager.launcher import Launcher
from daemons.manager.lifecycle import Lifecycle
from daemons.manager.orders import Lookup, Orders
from daemons.manager.rehome import Rehomer
from daemons.manager.records import InstanceRecord
from daemons.manager.roles import Roles
from daemons.manager.scaling import Scaling
from daemons.manager.shared import Shared

log = logging.getLogger("llumnix.manager")


class Rescheduler:
    """Holds ``orders``, ``lifecycle``, ``scaling`` and their ``launcher``, and ``roles``; decides what a registration means
    for them (flags said again, a retirement resumed, a launch done)."""

    def __init__(self, shared: Shared, next_id: Callable[[], int], lookup: Lookup, lookup_timeout_s: float,
                 started: float):
        cfg, cluster = shared.cfg, shared.cluster
        self.spawn = shared.spawn
        self.scfg = cfg.scaling
        self.launcher = Launcher(cfg.scaling, cfg.manager.address, lambda: set(cluster.instances), shared.clock)
        self.orders = Orders(shared, next_id, lookup, lookup_timeout_s)
        self.lifecycle = Lifecycle(shared, self.launcher, self.orders.new_drain)
        self.scaling = Scaling(shared, self.launcher, self.lifecycle.retire, min(1.0, cfg.manager.heartbeat_interval_s),
                               started)
        self.roles = Roles(shared, self.orders)
        self.rehomer = Rehomer(shared)  # idle sessions' KV from hot instances to cooler ones

    def joined(self, r: InstanceRecord, new: bool) -> None:
        """An instance registered (``new``: one we did not know)."""
        if new and self.launcher.registered(r.instance_id) and r.instance_id not in self.roles.assigned:
            self.roles.launched(r)
        self.roles.joined(r)
        if r.drain_reason or r.cordoned:  # it forgot (restarted) or we did: say it again
            self.lifecycle.tell(r)
        if new and r.drain_reason in ("remove", "scale-in"):  # we restarted in the middle of it
            self.resume_retirement(r)

    def resume_retirement(self, r: InstanceRecord) -> None:
        """An instance that was being removed or scaled in when the manager restarted: finish the job."""
        log.info("instance %s was being retired (%s) before we restarted; going on", r.instance_id, r.drain_reason)
        if r.drain_reason == "scale-in":
            self.spawn(self.scaling.scale_in(r.instance_id))
        else:
            self.spawn(self.lifecycle.retire(r.instance_id, r.drain_reason, self.scfg.launch_timeout_s))

    def loops(self) -> list[Awaitable]:
        """The coroutines that run as long as the manager: pairing, scaling, roles, re-homing (where it is on:
        sessions.rehome_sessions = 0 once ended its loop at once, and the manager took that for a failure and exited)."""
        rehome = [self.rehomer.loop()] if self.rehomer.on else []
        return [self.orders.pairing_loop(), self.scaling.scaling_loop(), self.roles.loop(), *rehome]

    def counters(self) -> dict:
        """What status shows of the rescheduling (the Snapshot's fields)."""
        return {"ordered_migrations": dict(self.orders.outcomes), "scale_outs": self.scaling.scale_outs,
                "scale_ins": self.scaling.scale_ins, "launching": len(self.launcher.launches)}

    # The virtual-time simulator (llumnixctl/experiments/sim*.py) and bench/manager.py drive these directly.

    def plan(self, now: float, drains_only: bool = False) -> list[tuple[policy.Pair, wire.MigrateStart]]:
        return self.orders.plan(now, drains_only)

    def pair_once(self, drains_only: bool = False) -> list[policy.Pair]:
        return self.orders.pair_once(drains_only)

    def count_orders(self, src_id: str, dst_id: str, count: int) -> None:
        self.orders.count_orders(src_id, dst_id, count)

    def scaling_decision(self, now: float, launching: int) -> tuple[str | None, float | None, int, list]:
        return self.scaling.scaling_decision(now, launching)
