"""The simulated instances' load reports (llumnixctl/experiments/simulate.py): to the manager on change (at most
every ``instance.load_report_min_interval_s``) and at least every heartbeat, a report lag later; with the same
load in a heartbeat to the proxy (proxy.dispatch = local). The cache's changes go first (simcache.py).

This is the instance's report timing, re-stated: the instance's reporter is one with its daemon (the llumlet's
report loop); once it can be built alone, a simulated instance should run it instead."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

from daemons import wire

if TYPE_CHECKING:
    from daemons.manager import Manager
    from llumnixctl.experiments.simparts import SimulatedInstance
    from llumnixctl.experiments.simproxy import SimProxy


class Site(Protocol):
    now: float

    def at(self, t: float, fn: Callable, *args) -> None: ...


class SimReports:
    """Owns each instance's report sequence, when it last reported and whether a report is due."""

    def __init__(self, cfg, report_lag_s: float, mgr: Manager, proxy: SimProxy | None,
                 cache_batch: Callable[[SimulatedInstance], tuple], site: Site) -> None:
        self.min_interval_s = cfg.instance.load_report_min_interval_s
        self.heartbeat_s = cfg.manager.heartbeat_interval_s
        self.lag_s, self.mgr, self.proxy, self.cache_batch, self.site = report_lag_s, mgr, proxy, cache_batch, site
        self.seq: dict[str, int] = {}
        self.last: dict[str, float] = {}
        self.due: set[str] = set()

    def start(self, inst: SimulatedInstance, first_s: float) -> None:
        """A new instance: its heartbeats, the first ``first_s`` from now."""
        self.site.at(self.site.now + first_s, self.heartbeat, inst)

    def changed(self, inst: SimulatedInstance) -> None:
        """Its load changed: report now, or as soon as the minimum interval allows."""
        if inst.iid in self.due:
            return
        due = self.last.get(inst.iid, -1e9) + self.min_interval_s
        if due <= self.site.now:
            self.report(inst)
        else:
            self.due.add(inst.iid)
            self.site.at(due, self.report, inst)

    def heartbeat(self, inst: SimulatedInstance) -> None:
        if inst.gone is not None:
            return
        now = self.site.now
        if now - self.last.get(inst.iid, -1e9) >= self.heartbeat_s * 0.99:
            self.report(inst)
        self.site.at(now + self.heartbeat_s, self.heartbeat, inst)

    def report(self, inst: SimulatedInstance) -> None:
        self.due.discard(inst.iid)
        if inst.gone is not None:
            return
        site, iid = self.site, inst.iid
        self.last[iid] = site.now
        self.seq[iid] = seq = self.seq.get(iid, 0) + 1
        load = inst.engine.load()
        site.at(site.now + self.lag_s, self.mgr.on_report, inst.ident,
                wire.LoadReport(iid, seq, load, *self.cache_batch(inst)))
        if self.proxy is not None:  # the same load in its heartbeat to the proxy
            beat = wire.Heartbeat(iid, inst.host.request_address, True, load, not inst.retiring, inst.taken)
            site.at(site.now + self.lag_s, self.proxy.on_heartbeat, beat)
