"""Goodput: what happened to each request with an SLO ([slo] targets, or its API key's), counted per priority
class (met both targets, missed TTFT, missed TPOT, missed both, refused at admission, gave up in the queue), and
how far the predictions the request was placed by were off (actual over predicted)."""

from __future__ import annotations

from daemons.policy import admit as slo_admit, slo
from daemons.proxy.cluster.telemetry import M_SLO, M_TPOT_RATIO, M_TTFT_RATIO, SLO_CLASSES


class Goodput:
    """Owns nothing but the counters it writes. Receives the [slo] settings. Each request comes with its SLO class
    and targets (slo.RequestSlo, computed once where the proxy parsed it)."""

    def __init__(self, slo_cfg):
        self.give_up_factor = slo_cfg.give_up_factor

    @staticmethod
    def key_targets(principal) -> slo.Targets | None:
        """An API key's own, tighter SLO (None: none)."""
        if principal is None or not (principal.slo_ttft_ms or principal.slo_tpot_ms):
            return None
        return slo.Targets(principal.slo_ttft_ms / 1000.0, principal.slo_tpot_ms / 1000.0)

    def give_up_s(self, targets: slo.Targets) -> float:
        """How long a request may wait for its first token before it gives up (0: forever)."""
        return targets.ttft_s * self.give_up_factor if targets.ttft_s > 0 and self.give_up_factor > 0 else 0.0

    def refused(self, r: slo.RequestSlo, reason: str) -> None:
        """A request turned away at admission, for ``reason`` (an Overloaded's): counted as refused when the SLO's
        admission refused it (slo_admit.REFUSALS), not when the queue bounds did ([admission])."""
        if r.own.on and reason in slo_admit.REFUSALS:
            M_SLO.labels(SLO_CLASSES[r.cls], "refused").inc()

    def gave_up(self, r: slo.RequestSlo) -> None:
        if r.own.on:
            M_SLO.labels(SLO_CLASSES[r.cls], "gave_up").inc()

    def finished(self, r: slo.RequestSlo, ttft_s: float, tpot_s: float | None,
                 predicted: tuple[float, float] | None) -> str:
        """A request that got its answer: its outcome (also counted when it has targets)."""
        targets = r.own
        missed_ttft = targets.ttft_s > 0 and ttft_s > targets.ttft_s
        missed_tpot = targets.tpot_s > 0 and tpot_s is not None and tpot_s > targets.tpot_s
        outcome = ("missed_both" if missed_ttft and missed_tpot else "missed_ttft" if missed_ttft
                   else "missed_tpot" if missed_tpot else "met")
        if targets.on:
            M_SLO.labels(SLO_CLASSES[r.cls], outcome).inc()
        if predicted is not None:
            ttft_p, tpot_p = predicted
            if ttft_p > 0:
                M_TTFT_RATIO.observe(ttft_s / ttft_p)
            if tpot_p > 0 and tpot_s is not None:
                M_TPOT_RATIO.observe(tpot_s / tpot_p)
        return outcome
