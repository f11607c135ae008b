"""Auto-scaling: the cluster's average freeness, sustained past a threshold, launches an instance or retires
the freest one (policy.Scaler decides; the launcher starts)."""

from __future__ import annotations

import logging
import math
from typing import Awaitable, Callable

from daemons import metrics, policy
from daemons.manager.launcher import Launcher, LaunchError
from daemons.manager.shared import Shared

log = logging.getLogger("llumnix.manager")

M_SCALING = metrics.counter("manager", "llumnix_manager_scaling_total", "Auto-scaling actions, by direction",
                            ["direction"], preset=[("out",), ("in",)])
M_CLUSTER_FREENESS = metrics.gauge("manager", "llumnix_cluster_freeness",
                                   "Average freeness of the normal-priority load (the auto-scaling signal)")


Retire = Callable[..., Awaitable[object]]


class Scaling:
    """Owns ``scaler`` (policy.Scaler: the sustained signal and the cooldown), ``scale_outs`` and ``scale_ins``."""

    def __init__(self, shared: Shared, launcher: Launcher, retire: Retire, period_s: float, started: float):
        """``retire(instance_id, reason, timeout_s, undrain_on_timeout=)``: drain and stop one (lifecycle.py).
        ``period_s``: how often it looks. ``started``: when the manager started (no decision before a launch
        could have registered)."""
        self.scfg = scfg = shared.cfg.scaling
        self.cluster, self.policies, self.clock, self.spawn = shared.cluster, shared.policies, shared.clock, shared.spawn
        self.launcher = launcher
        self.retire = retire
        self.period_s = period_s
        self.scale_outs = 0
        self.scale_ins = 0
        self.scaler = policy.Scaler(scfg.scale_up_threshold, scfg.scale_down_threshold, scfg.sustain_s,
                                    scfg.cooldown_s, scfg.min_instances, scfg.max_instances,
                                    not_before=started + scfg.launch_timeout_s)

    async def scaling_loop(self) -> None:
        while True:
            await self.clock.sleep(self.period_s)
            self.scale_once(self.clock.monotonic())

    def scaling_decision(self, now: float, launching: int) -> tuple[str | None, float | None, int, list]:
        """(decision "up"/"down"/None, the average freeness, instances serving, the states) from the
        current view; the virtual-time simulator (llumnixctl/experiments/sim/simulate.py) runs this too."""
        states = self.cluster.states(now)
        avg = policy.average_freeness(states)
        M_CLUSTER_FREENESS.set(math.nan if avg is None else avg)
        serving = len(policy.scaling.serving(states))
        if not policy.SCALING.get(self.policies.scaling_policy).scales:
            self.scaler.reset()
            return None, avg, serving, states
        return self.scaler.observe(now, avg, serving, launching), avg, serving, states

    def scale_once(self, now: float) -> str | None:
        decision, avg, serving, states = self.scaling_decision(now, len(self.launcher.launches))
        if decision == "up":
            if not self.scfg.launcher.strip():
                log.warning("auto-scaling wants another instance, but scaling.launcher is empty")
                return None
            log.info("auto-scaling out: average freeness %s, %d serving", "n/a" if avg is None else f"{avg:.2f}", serving)
            self.spawn(self._scale_out())
        elif decision == "down":
            victim = policy.scale_in_victim(states)
            if victim is None:
                return None
            log.info("auto-scaling in: average freeness %.2f, %d serving; retiring %s", avg, serving, victim)
            self.spawn(self.scale_in(victim))
        return decision

    async def scale_in(self, instance_id: str) -> None:
        outcome = await self.retire(instance_id, "scale-in", self.scfg.launch_timeout_s, undrain_on_timeout=True)
        if isinstance(outcome, str):
            log.warning("auto-scaling in: %s", outcome)
            return
        self.scale_ins += 1
        M_SCALING.labels("in").inc()

    async def _scale_out(self) -> None:
        try:
            await self.launcher.launch()
        except LaunchError as exc:
            log.warning("auto-scaling out failed: %s", exc)
            return
        self.scale_outs += 1
        M_SCALING.labels("out").inc()
