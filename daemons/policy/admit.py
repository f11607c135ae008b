"""The SLO's admission rule (daemons/policy/slo.py predicts, this decides): a request is admitted where some
instance is predicted to give it its first token within its class's TTFT target (times ``admit_at``) and keep its
TPOT target, a higher class is never refused while a lower one is admitted (unless the lower holds less than its
share), and where nothing can be predicted, nothing is promised. A refusal carries its reason and when to retry.
Pure functions over InstanceState: the proxies' admission (daemons/proxy/cluster/admission.py) and the simulator
call them alike."""

from __future__ import annotations

import math
from dataclasses import dataclass

from daemons.policy.slo import (HIGH, NORMAL, Targets, class_of, fitted, pooled, predict_tpot, predict_ttft)
from daemons.policy.usage import InstanceState

# Why the SLO's admission refuses a request: no instance is predicted to give it its first token in time ("ttft"),
# those that would are too busy to keep its time per output token ("tpot"), or a higher class is refused now.
REFUSALS = ("ttft", "tpot", "higher_class", "unknown")
UNKNOWN_RETRY_S = 1.0  # refused as "unknown": an instance's first steps give it a model within about this


@dataclass(frozen=True)
class Verdict:
    admitted: bool
    ttft_s: float  # the best predicted TTFT found for the request (inf: no instance)
    retry_after_s: float = 0.0  # refused: when its class is predicted to fit again
    reason: str = ""  # refused: one of REFUSALS
    fits: tuple[str, ...] = ()  # admitted: the instances predicted to meet its target (where it may be placed)


def best_ttft(states: list[InstanceState], prompt_tokens: int, high: bool, tpot_s: float = 0.0,
              max_tokens: int = 0) -> float:
    """The best predicted TTFT over the instances that take requests (with ``tpot_s``: over those whose predicted
    TPOT with the request joining stays within it; inf: none)."""
    return min((predict_ttft(s, prompt_tokens, high, max_tokens) for s in states
                if s.dispatchable and not (tpot_s > 0 and predict_tpot(s, prompt_tokens) > tpot_s)),
               default=math.inf)


def kept_ttft(states: list[InstanceState], prompt_tokens: int, high: bool, t: Targets, admit_at: float,
              max_tokens: int = 0) -> float:
    """The best predicted TTFT of a request of targets ``t`` among the instances where it would also keep its TPOT
    target (within ``admit_at`` of it; every instance when it has none)."""
    return best_ttft(states, prompt_tokens, high, t.tpot_s * admit_at if t.tpot_s > 0 else 0.0, max_tokens)


def class_share(states: list[InstanceState], high: bool) -> float:
    """The share of the cluster's requests (running and queued) of a class (by the load reports)."""
    total = sum(s.running + s.waiting for s in states)
    if total <= 0:
        return 0.0
    highs = sum(s.high_priority + s.waiting_high for s in states)
    return (highs if high else total - highs) / total


def admit(states: list[InstanceState], prompt_tokens: int, priority: int, targets: dict[int, Targets],
          shares: dict[int, float], admit_at: float = 1.0, max_tokens: int = 0,
          cached: dict[str, int] | None = None) -> Verdict:
    """Admit a request of ``priority`` (its class's TTFT target in ``targets``; a class without a TTFT target is
    always admitted) or refuse it. ``shares``: the fraction of the cluster's requests reserved for a class; a class
    under it is admitted on its own target alone, even while a higher class is refused. ``admit_at``: the fraction
    of a target a prediction must be within (headroom for the prediction's error and for what arrives meanwhile).
    ``cached``: per instance, the prompt tokens it holds cached (engine or host tier): no prefill there."""
    cached = cached or {}
    mine = targets.get(priority, Targets())
    high = class_of(priority) == HIGH
    states = pooled(states)
    live = [s for s in states if s.dispatchable]
    limit = mine.ttft_s * admit_at
    tpot = mine.tpot_s * admit_at if mine.tpot_s > 0 else 0.0
    # Each instance's predicted TTFT (inf where nothing can say: unknown), and whether its TPOT with the request
    # joining stays within the target.
    preds = [(s.instance_id, math.inf if unknown(s) else
              predict_ttft(s, max(prompt_tokens - cached.get(s.instance_id, 0), 0), high, max_tokens),
              not (tpot > 0 and predict_tpot(s, prompt_tokens) > tpot)) for s in live]
    ttft = min((t for _, t, _ in preds), default=math.inf)
    if mine.ttft_s > 0 and ttft > limit:
        if live and all(unknown(s) for s in live):
            return Verdict(False, ttft, UNKNOWN_RETRY_S, "unknown")
        return Verdict(False, ttft, retry_after(ttft, limit), "ttft")
    fits = tuple(iid for iid, t, kept in preds if t <= limit and kept)
    if mine.ttft_s > 0 and not fits:
        return Verdict(False, ttft, decode_drain_s(states), "tpot")  # every instance fast enough is too busy
    under_share = class_share(states, high) < shares.get(priority, 0.0)
    if not under_share:
        for cls, t in targets.items():
            if cls > priority and t.ttft_s > 0:
                theirs = kept_ttft(states, 0, cls > NORMAL, t, admit_at)
                if theirs > t.ttft_s * admit_at:
                    return Verdict(False, ttft, retry_after(best_ttft(states, 0, cls > NORMAL), t.ttft_s * admit_at),
                                   "higher_class")
    return Verdict(True, ttft, fits=fits if mine.ttft_s > 0 else ())


def unknown(s: InstanceState) -> bool:
    """Whether nothing can say when a new request would start on ``s``: it has no step-time model yet (it has run
    fewer than its first few steps) and work is there already (running, queued, or dispatched to it). Admission by
    SLO places nothing on such an instance; an idle one takes a request, which starts at once. Conservative where
    the model cannot know (a fresh cluster's first burst), and only for an instance's first steps."""
    return not fitted(s.latency) and s.running + s.waiting + s.pending_requests > 0


def decode_drain_s(states: list[InstanceState]) -> float:
    """Refused for its TPOT target: when the first instance is predicted to have a request fewer (at its finish
    rate; 1 to 60 seconds)."""
    rates = [s.latency.finish_rate for s in states if s.dispatchable and fitted(s.latency) and s.latency.finish_rate > 0]
    return min(max(1.0 / max(rates), 1.0), 60.0) if rates else 60.0


def retry_after(predicted_s: float, target_s: float) -> float:
    """When a refused class is predicted to fit again: the excess of its predicted TTFT over the target is queued
    work that drains in about as long (at least a second; at most a minute, as nothing is sure that far)."""
    if math.isinf(predicted_s):
        return 60.0
    return min(max(predicted_s - target_s, 1.0), 60.0)
