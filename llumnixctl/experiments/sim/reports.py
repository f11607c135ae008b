"""The simulated instances' load reports and heartbeats (llumnixctl/experiments/sim/simulate.py): each instance runs
the instance's own ``Reporter`` and ``Heartbeats`` (daemons/instance/reports.py) on the simulation's virtual
time, so its reports go out as a daemon's do (on change, at most every ``instance.load_report_min_interval_s``,
at least every heartbeat) and carry its ``current_load`` (the engine's load with its migrator's migrating out
and in). What the simulator provides is where they go: a report reaches the manager a report lag later (its
line, sim/llumlet.py), and a heartbeat (each report's, and each heartbeat period's) the simulated proxy as late
(proxy.dispatch = local). The cache's changes go first (sim/cache.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Callable, Mapping, Protocol

import msgspec

from daemons import wire
from daemons.watchdog import Watchdog

if TYPE_CHECKING:
    from daemons.manager import Manager
    from llumnixctl.experiments.sim.parts import SimulatedInstance
    from llumnixctl.experiments.sim.proxy import SimProxy


class Site(Protocol):
    now: float

    def at(self, t: float, fn: Callable, *args) -> None: ...


class ProxyLine:
    """The simulated proxy, as an instance's heartbeats reach it (daemons/instance/reports.py's ``BeatLinks``):
    each one ``lag_s`` later, with the count of the Submits from it the instance took in. None: no proxy
    listens (proxy.dispatch = manager). It is never gone."""

    def __init__(self, address: str, proxy: SimProxy | None, lag_s: float, site: Site) -> None:
        self.address, self.proxy, self.lag_s, self.site = address, proxy, lag_s, site
        self.links: Mapping = {address: None} if proxy is not None else {}

    def heartbeat(self, msg: wire.Heartbeat, taken: Mapping[str, int] | None = None) -> None:
        if self.proxy is None:
            return
        n = (taken or {}).get(self.address, 0)
        self.site.at(self.site.now + self.lag_s, self.proxy.on_heartbeat,
                     msgspec.structs.replace(msg, taken=n) if n else msg)

    def gone(self, addresses: set[str]) -> list[tuple[str, str]]:
        return []


class SimReports:
    """Builds each instance's ``Reporter`` and ``Heartbeats`` (the instance's own) and owns their tasks:
    started with the instance, cancelled when it stops."""

    def __init__(self, cfg, report_lag_s: float, mgr: Manager, proxy: SimProxy | None, proxy_address: str,
                 cache_of: Callable[[SimulatedInstance], object], site: Site, clock) -> None:
        from daemons.instance.outlook import OutputLengths
        from daemons.instance.predictor import StepFit
        from daemons.instance.reports import Heartbeats, Reporter  # (torch: only once a simulation runs)

        self.reporter_class, self.heartbeats_class, self.fit_class = Reporter, Heartbeats, StepFit
        self.lengths_class = OutputLengths
        self.cfg, self.lag_s, self.mgr, self.cache_of, self.site, self.clock = cfg, report_lag_s, mgr, cache_of, site, clock
        self.proxy_line = ProxyLine(proxy_address, proxy, report_lag_s, site)
        self.tasks: dict[str, list[asyncio.Task]] = {}

    def start(self, inst: SimulatedInstance) -> None:
        """A new instance (its standing, intake and line to the manager there): its reporter (``inst.reporter``,
        which its step loop refreshes) and its heartbeats, running."""
        ic, heartbeat_s = self.cfg.instance, self.cfg.manager.heartbeat_interval_s
        watchdog = Watchdog(ic.step_timeout_s, ic.hung_exit_s, self.clock)  # never stalled: sim steps end
        inst.fit = self.fit_class(inst.engine.prefill_budget, lengths=self.lengths_class())
        # (the reporter reads the migrator itself, not the tap its other parts reach it through)
        shared = dataclasses.replace(inst.shared, migrator=lambda: inst.migrator)
        inst.reporter = reporter = self.reporter_class(shared, self.cfg, watchdog, self.proxy_line, inst.taken,
                                                       self.cache_of(inst), inst.fit)
        beats = self.heartbeats_class(reporter, watchdog, self.proxy_line, inst.table, lambda address, why: None,
                                      min(heartbeat_s, ic.step_timeout_s / 4), self.clock)
        loop = asyncio.get_running_loop()
        self.tasks[inst.iid] = [loop.create_task(reporter.run()), loop.create_task(beats.run())]

    def drain(self, inst: SimulatedInstance, reason: str) -> None:
        """The manager drains it (scale-in): it takes no new requests, and says so soon."""
        inst.standing.drain(wire.SetDraining(True, reason))
        inst.reporter.changed()

    def stop(self, inst: SimulatedInstance) -> None:
        """It stopped: no more reports or heartbeats."""
        for task in self.tasks.pop(inst.iid, ()):
            task.cancel()
