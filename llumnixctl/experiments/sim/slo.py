"""Serving to an SLO in the simulator (llumnixctl/experiments/sim/simulate.py): with [slo] TTFT targets the simulated
proxy admits each new request with the proxy's own ``Admission`` (sim/proxy.py; daemons.policy.admit.admit):
a refused request is counted and ends there; an admitted one that has no token ``slo.give_up_factor`` times its
class's TTFT target after it arrived is aborted where it queues and counted as given up (as the proxy's failover
check does: daemons/proxy/cluster/failover.py). At each request's first dispatch the proxy's prediction of its TTFT and
TPOT there is kept, for the prediction error (sim/result.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

from daemons.config import Config
from daemons.policy import slo

if TYPE_CHECKING:
    from llumnixctl.experiments.sim.parts import SimulatedInstance, SimulatedRequest
    from llumnixctl.experiments.sim.proxy import SimProxy


class Site(Protocol):
    now: float
    requests: dict
    instances: dict

    def at(self, t: float, fn: Callable, *args) -> None: ...

    def end(self, req: SimulatedRequest) -> None: ...


class SimSlo:
    """Owns the class targets and whether admission by them is on. Receives the [slo] settings, whether to admit
    by them (False: they only measure), and the simulation (``Site``); the proxy comes once it is built."""

    def __init__(self, cfg: Config, admission: bool, site: Site) -> None:
        self.targets = slo.class_targets(cfg.slo)
        self.by_slo = admission and any(t.ttft_s > 0 for t in self.targets.values())
        self.give_up_factor = cfg.slo.give_up_factor if self.by_slo else 0.0
        self.site = site
        self.proxy: SimProxy | None = None

    def admitted(self, req: SimulatedRequest) -> bool:
        """Judge a new request (once; always admitted while admission is off)."""
        if req.slo or not self.by_slo:
            return True
        tr = req.trace
        prio = 1 if tr.priority == "high" else 0
        verdict = self.proxy.admit(prio, tr.prompt_tokens, max(1, tr.output_tokens), req.rid)
        if verdict is not None and not verdict.admitted:
            req.slo = "refused"
            self.site.end(req)
            return False
        req.slo = "admitted"
        req.fits = verdict.fits if verdict is not None else ()
        give_up_s = self.targets[prio].ttft_s * self.give_up_factor
        if give_up_s > 0:
            self.site.at(self.site.now + give_up_s, self.give_up, req.rid)
        return True

    @staticmethod
    def among_fits(req: SimulatedRequest, exclude: tuple, instances) -> tuple:
        """``exclude`` for a dispatch of ``req``: on its first placement, also the instances admission did not find
        fit for it (as the proxy's dispatch: daemons/proxy/cluster/dispatch.py ``_excluded``)."""
        if not req.fits or req.dispatches:
            return exclude
        others = tuple(iid for iid in instances if iid not in req.fits)
        return (*exclude, *others) if len(others) < len(instances) else exclude

    def give_up(self, rid: str) -> None:
        """No token yet, give_up_factor times its TTFT target after it arrived: it ends, aborted where it queues."""
        req = self.site.requests[rid]
        if req.tokens or req.finish or req.error or req.slo != "admitted":
            return
        req.slo = "gave_up"
        self.site.end(req)
        inst = self.site.instances.get(req.owner)
        if inst is not None:
            self.abort(inst, rid)

    def abort(self, inst: SimulatedInstance, rid: str) -> None:
        """Abort ``rid`` on ``inst`` at its next step boundary (a given-up request it holds)."""

        inst.mailbox.call(lambda: inst.intake.abort_local(rid))

    def sent(self, req: SimulatedRequest, iid: str) -> None:
        """The proxy sent ``req`` to ``iid``: its pending dispatch there, and (the first time) what it predicted."""
        if self.proxy is None:
            return
        tr = req.trace
        prio = 1 if tr.priority == "high" else 0
        if req.predicted is None:
            req.predicted = self.proxy.predict(iid, tr.prompt_tokens, prio, max(1, tr.output_tokens))
        self.proxy.sent(iid, tr.prompt_tokens, max(1, tr.output_tokens), req.rid)
