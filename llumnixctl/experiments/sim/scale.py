"""The simulator's auto-scaling (llumnixctl/experiments/sim/simulate.py): the manager's scaling decision on virtual
time, launches that register after ``Network.launch_s``, and scaled-in instances that stop once empty."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping, Protocol

from daemons import policy

if TYPE_CHECKING:
    from daemons.manager import Manager
    from llumnixctl.experiments.sim.parts import SimulatedInstance


class Site(Protocol):
    """What scaling needs of the simulation."""

    instances: Mapping[str, SimulatedInstance]
    now: float

    def at(self, t: float, fn: Callable, *args) -> None: ...

    def add_instance(self) -> SimulatedInstance: ...

    def notify(self, kind: str, **data) -> None: ...


class SimScaling:
    """Owns ``events`` (the actions taken, for the figures) and the launches under way. Asks the manager for
    its decision every ``period_s``; a launched instance registers ``launch_s`` later. A scaled-in instance
    is told it drains (``drain(inst, reason)``) and, once empty, stops (``stop(inst)``)."""

    def __init__(self, mgr: Manager, period_s: float, launch_s: float, site: Site,
                 drain: Callable[[SimulatedInstance, str], None], stop: Callable[[SimulatedInstance], None]) -> None:
        self.mgr, self.period_s, self.launch_s, self.site = mgr, period_s, launch_s, site
        self.drain, self.stop = drain, stop
        self.events: list[dict] = []
        self.launching = 0

    def start(self) -> None:
        self.site.at(self.period_s, self.tick)

    def tick(self) -> None:
        site = self.site
        now = site.now
        decision, avg, serving, states = self.mgr.resched.scaling_decision(now, self.launching)
        if decision == "up":
            self.launching += 1
            site.at(now + self.launch_s, self._launched)
            self._scaled("out", "", avg)
        elif decision == "down":
            victim = policy.scale_in_victim(states)
            if victim is not None:
                rec = self.mgr.instances[victim]
                rec.drain_reason = "scale-in"
                inst = site.instances[victim]
                inst.retiring = True
                inst.host.draining = "scale-in"  # it takes no migration in
                self.drain(inst, "scale-in")
                self._scaled("in", victim, avg)
                self.maybe_gone(inst)
        site.at(now + self.period_s, self.tick)

    def _launched(self) -> None:
        self.launching -= 1
        inst = self.site.add_instance()
        self.site.notify("scale", what="registered", instance=inst.iid)

    def _scaled(self, what: str, iid: str, avg) -> None:
        site = self.site
        self.events.append({"t": site.now, "what": what, "instance": iid,
                            "average_freeness": None if avg is None else round(avg, 3),
                            "serving": sum(1 for i in site.instances.values() if i.gone is None and not i.retiring)})
        site.notify("scale", what=what, instance=iid)

    def maybe_gone(self, inst: SimulatedInstance) -> None:
        """A scaled-in instance stops once nothing is left on it (its drain moved everything out)."""
        if inst.retiring and inst.gone is None and not inst.engine.has_work() and not inst.migrator.busy:
            inst.gone = self.site.now
            self.stop(inst)
            self.mgr.forget(self.mgr.instances[inst.iid], "scaled in (simulated)")
