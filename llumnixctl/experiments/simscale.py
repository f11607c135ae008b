"""The simulator's auto-scaling (llumnixctl/experiments/simulate.py): the manager's scaling decision on virtual
time, launches that register after ``Network.launch_s``, and scaled-in instances that stop once empty."""

from __future__ import annotations

from typing import TYPE_CHECKING

from daemons import policy

if TYPE_CHECKING:
    from llumnixctl.experiments.simulate import SimulatedInstance


class ScalingMixin:
    """Of the Simulation: owns ``scaling`` (the actions taken) and ``_launching``."""

    def _scale(self) -> None:
        now = self.now
        decision, avg, serving, states = self.mgr.resched.scaling_decision(now, self._launching)
        if decision == "up":
            self._launching += 1
            self.at(now + self.net.launch_s, self._launched)
            self._scaled("out", "", avg)
        elif decision == "down":
            victim = policy.scale_in_victim(states)
            if victim is not None:
                rec = self.mgr.instances[victim]
                rec.drain_reason = "scale-in"
                self.instances[victim].retiring = True
                self.instances[victim].host.draining = "scale-in"  # it takes no migration in
                self._scaled("in", victim, avg)
                self._maybe_gone(self.instances[victim])
        self.at(now + min(1.0, self.cfg.manager.heartbeat_interval_s), self._scale)

    def _launched(self) -> None:
        self._launching -= 1
        inst = self._add_instance()
        self._notify("scale", what="registered", instance=inst.iid)

    def _scaled(self, what: str, iid: str, avg) -> None:
        self.scaling.append({"t": self.now, "what": what, "instance": iid,
                             "average_freeness": None if avg is None else round(avg, 3),
                             "serving": sum(1 for i in self.instances.values() if i.gone is None and not i.retiring)})
        self._notify("scale", what=what, instance=iid)

    def _maybe_gone(self, inst: SimulatedInstance) -> None:
        """A scaled-in instance stops once nothing is left on it (its drain moved everything out)."""
        if inst.retiring and inst.gone is None and not inst.engine.has_work() and not inst.migrator.busy:
            inst.gone = self.now
            self.mgr.forget(self.mgr.instances[inst.iid], "scaled in (simulated)")
