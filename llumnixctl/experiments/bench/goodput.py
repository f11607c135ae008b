"""Goodput and SLO attainment of a benchmark's requests, as the client measured them (``bench overload``,
``bench serve``): per priority class, how many were answered, refused at admission (429/503), gave up queued (429), met both targets (TTFT from
sending to the first chunk, TPOT from the first chunk to the last per token after the first: vLLM's
definitions), missed TTFT or TPOT; attainment = met / answered ("admitted"); goodput = met per second of the run. And the
moments a high-priority request was refused while a normal one was admitted (what admission by class must never
do)."""

from __future__ import annotations

import bisect

MOMENT_S = 0.1  # two requests sent this close are decided "in the same moment"


def tpot_of(r: dict) -> float | None:
    times = r["times"]
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


GAVE_UP = "waited past its time-to-first-token target"  # the proxy's 429 for a request that queued too long


def gave_up(r: dict) -> bool:
    """Admitted, then answered 429 after waiting past slo.give_up_factor times its TTFT target."""
    return r.get("status") == 429 and GAVE_UP in (r["error"] or "")


def outcome(r: dict, ttft_s: float, tpot_s: float) -> str:
    """met, missed_ttft, missed_tpot, missed_both (an answered request), refused (429/503 at admission), gave_up
    (429 after queueing) or failed."""
    if r["error"] is not None:
        return "gave_up" if gave_up(r) else "refused" if r.get("status") in (429, 503) else "failed"
    missed_ttft = ttft_s > 0 and r["times"][0] > ttft_s
    tpot = tpot_of(r)
    missed_tpot = tpot_s > 0 and tpot is not None and tpot > tpot_s
    return ("missed_both" if missed_ttft and missed_tpot else "missed_ttft" if missed_ttft
            else "missed_tpot" if missed_tpot else "met")


def high_refused_while_normal_admitted(results: list[dict], moment_s: float = MOMENT_S) -> int:
    """High-priority refusals with a normal request admitted within ``moment_s`` of it (by sending time)."""
    admitted = sorted(r["sent"] for r in results if not r.get("high") and r["error"] is None)
    count = 0
    for r in results:
        if r.get("high") and r.get("status") in (429, 503) and not gave_up(r):
            i = bisect.bisect_left(admitted, r["sent"] - moment_s)  # the first normal admission from a moment before
            count += i < len(admitted) and admitted[i] <= r["sent"] + moment_s
    return count


def slo_figures(results: list[dict], ttft_s: float, tpot_s: float, seconds: float) -> dict:
    """The SLO figures of ``results`` (each ``stream_completion``'s dict, with ``high`` for a high-priority one)
    against targets ``ttft_s``, ``tpot_s`` (0: none of that kind) over a run of ``seconds``."""
    classes: dict[str, dict] = {}
    for cls, high in (("normal", False), ("high", True)):
        mine = [r for r in results if bool(r.get("high")) == high]
        if not mine:
            continue
        counts = {k: 0 for k in ("met", "missed_ttft", "missed_tpot", "missed_both", "refused", "gave_up", "failed")}
        for r in mine:
            counts[outcome(r, ttft_s, tpot_s)] += 1
        admitted = sum(counts[k] for k in ("met", "missed_ttft", "missed_tpot", "missed_both"))
        classes[cls] = {"requests": len(mine), "admitted": admitted, **counts,
                        "attainment": round(counts["met"] / admitted, 4) if admitted else None,
                        "goodput_rps": round(counts["met"] / seconds, 3) if seconds > 0 else None}
    met = sum(c["met"] for c in classes.values())
    admitted = sum(c["admitted"] for c in classes.values())
    return {"slo_ttft_ms": ttft_s * 1000, "slo_tpot_ms": tpot_s * 1000,
            "goodput_rps": round(met / seconds, 3) if seconds > 0 else None,
            "attainment": round(met / admitted, 4) if admitted else None, "classes": classes}
