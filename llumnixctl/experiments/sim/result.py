"""The figures of a finished simulation (llumnixctl/experiments/sim/simulate.py): vLLM's ``bench serve`` statistics
and the cluster's own."""

from __future__ import annotations

import math
from collections import Counter

from llumnixctl.stats import percentile


def result_of(sim, wall_s: float) -> dict:
    """The figures of a finished simulation (its ``result``)."""
    done = [r for r in sim.requests.values() if r.finish]
    mig = sim.migrations
    end = max((r.last for r in done), default=0.0)
    start = min((r.sent for r in sim.requests.values() if r.sent >= 0), default=0.0)
    duration = max(end - start, 1e-9)
    ttfts = [r.first - r.sent for r in done]
    e2el = [r.last - r.sent for r in done]
    tpots = [(r.last - r.first) / (r.tokens - 1) for r in done if r.tokens > 1]
    inputs = [r.trace.prompt_tokens for r in done]
    outputs = [r.tokens for r in done]
    out = {
        "completed": len(done), "failed": sum(1 for r in sim.requests.values() if r.error),
        "duration": duration, "total_input_tokens": sum(inputs), "total_output_tokens": sum(outputs),
        "request_throughput": len(done) / duration, "output_throughput": sum(outputs) / duration,
        "total_token_throughput": (sum(inputs) + sum(outputs)) / duration,
    }
    for name, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", list(sim.itls)), ("e2el", e2el)):
        out.update(stats_of(name, xs))
    loads = [i.engine.load() for i in sim.instances.values()]
    seconds = sum(max(0.0, (i.gone if i.gone is not None else end) - max(i.born, start))
                  for i in sim.instances.values())
    out.update({
        "instances": sim.n_instances, "instance_seconds": seconds,
        "instances_at_end": sum(1 for i in sim.instances.values() if i.gone is None),
        "scaling": {"out": sum(e["what"] == "out" for e in sim.scaler.events),
                    "in": sum(e["what"] == "in" for e in sim.scaler.events), "events": sim.scaler.events},
        "fragmentation": dict(sim.fragmentation.counts),
        "preemptions": sum(ld.preemptions for ld in loads),
        "migrations": dict(sorted(mig.outcomes.items())),
        "migration_downtime_ms": stats_of("downtime", mig.downtimes)["mean_downtime_ms"] if mig.downtimes else None,
        "dispatch_policy": sim.mgr.dispatch_policy, "events": sim.events, "wall_s": wall_s,
        "leaked_blocks": sum(ld.blocks_used for ld in loads),
        # LoRA (the sim engine's adapter slots): adapters loaded, and of those unloaded to make room
        "adapter_loads": sum(i.engine.adapters.table.loads for i in sim.instances.values() if i.engine.adapters is not None),
        "adapter_evictions": sum(i.engine.adapters.table.evictions for i in sim.instances.values()
                                 if i.engine.adapters is not None),
        **sim.cache.figures(),
    })
    out["slo"] = slo_of(sim, duration)
    roles = sim.roles.figures()
    if roles:  # prefill/decode disaggregation (sim/disagg.py)
        out["disagg"] = roles
    return out


def slo_of(sim, duration: float) -> dict:
    """Serving to an SLO, per priority class (normal, high) and in all: requests admitted, refused, given up;
    of those that finished, met (both targets), missed_ttft, missed_tpot, missed_both (each request in one,
    as the proxy's goodput counter: daemons/proxy/cluster/goodput.py); attainment (met / admitted: a request that
    gave up or failed missed), goodput (met per second of the run), P99 TTFT and TPOT of the admitted
    requests that finished; and the prediction error: the median of |predicted - actual| / actual of TTFT
    and TPOT, predicted at each request's first dispatch. Without targets every finished request meets."""
    targets = sim.slo.targets
    classes = {"normal": [], "high": []}
    for r in sim.requests.values():
        classes["high" if r.trace.priority == "high" else "normal"].append(r)
    out = {"targets_ms": {name: {"ttft": targets[k].ttft_s * 1e3, "tpot": targets[k].tpot_s * 1e3}
                          for k, name in enumerate(("normal", "high"))},
           "admission": sim.slo.by_slo, "give_up_factor": sim.slo.give_up_factor}
    everything = []
    for k, (name, reqs) in enumerate(classes.items()):
        out[name] = _slo_class(reqs, targets[k], duration)
        everything += [(r, targets[k]) for r in reqs]
    out["all"] = _slo_class([r for r, _ in everything], None, duration, {r.rid: t for r, t in everything})
    return out


def _tpot(r) -> float | None:
    return (r.last - r.first) / (r.tokens - 1) if r.tokens > 1 else None


def _slo_class(reqs: list, targets, duration: float, per_request: dict | None = None) -> dict:
    c = Counter()
    ttfts, tpots, ttft_err, tpot_err = [], [], [], []
    for r in reqs:
        if r.slo == "refused":
            c["refused"] += 1
            continue
        c["admitted"] += 1
        if r.slo == "gave_up":
            c["gave_up"] += 1
            continue
        if not r.finish:
            c["failed"] += 1
            continue
        t = per_request[r.rid] if per_request is not None else targets
        ttft, tpot = r.first - r.sent, _tpot(r)
        ttfts.append(ttft)
        missed_ttft = t.ttft_s > 0 and ttft > t.ttft_s
        missed_tpot = t.tpot_s > 0 and tpot is not None and tpot > t.tpot_s
        c["missed_both" if missed_ttft and missed_tpot else "missed_ttft" if missed_ttft
          else "missed_tpot" if missed_tpot else "met"] += 1
        if tpot is not None:
            tpots.append(tpot)
        if r.predicted is not None:
            ttft_p, tpot_p = r.predicted
            if ttft > 0:
                ttft_err.append(abs(ttft_p - ttft) / ttft)
            if tpot and tpot_p > 0:
                tpot_err.append(abs(tpot_p - tpot) / tpot)
    keys = ("admitted", "refused", "gave_up", "failed", "met", "missed_ttft", "missed_tpot", "missed_both")
    out = {k: c[k] for k in keys}
    out.update({
        "attainment": c["met"] / c["admitted"] if c["admitted"] else None,
        "goodput": c["met"] / duration,
        "p99_ttft_ms": percentile(sorted(ttfts), 99) * 1e3 if ttfts else None,
        "p99_tpot_ms": percentile(sorted(tpots), 99) * 1e3 if tpots else None,
        "prediction_error": {"ttft": _median(ttft_err), "tpot": _median(tpot_err), "ttft_samples": len(ttft_err),
                             "tpot_samples": len(tpot_err)},
    })
    return out


def _median(xs: list[float]) -> float | None:
    return percentile(sorted(xs), 50) if xs else None


def stats_of(name: str, xs: list[float]) -> dict:
    """vLLM's ``bench serve`` statistics of one latency, in ms (numpy's percentiles: linear)."""
    if not xs:
        return {f"{k}_{name}_ms": 0.0 for k in ("mean", "median", "std", "p99")}
    ys = sorted(xs)

    def pct(q: float) -> float:
        return percentile(ys, q)

    mean = sum(ys) / len(ys)
    std = math.sqrt(sum((y - mean) ** 2 for y in ys) / len(ys))
    return {f"mean_{name}_ms": mean * 1e3, f"median_{name}_ms": pct(50) * 1e3, f"std_{name}_ms": std * 1e3,
            f"p99_{name}_ms": pct(99) * 1e3}


def result_block(res: dict) -> str:
    from llumnixctl.experiments.bench import serve_figures as bench_serve_figures

    rest = {k: v for k, v in res.items() if k != "slo"}  # (bench serve's "slo" has another shape; ours follows)
    block = bench_serve_figures.result_block({**rest, "prompt_token_mismatches": 0, "short_outputs": 0,
                                      "migrations": {"committed": sum(v for k, v in res["migrations"].items()
                                                                      if k.endswith("/committed")),
                                                     "aborted": sum(v for k, v in res["migrations"].items()
                                                                    if k.endswith("/aborted"))}})
    extra = [f"{'Instances:':<40} {res['instances']}", f"{'Instance-seconds:':<40} {res['instance_seconds']:.1f}",
             f"{'Simulated in (s, wall):':<40} {res['wall_s']:.2f}"]
    if "slo" in res:
        extra += slo_lines(res["slo"])
    return block.rstrip("=").rstrip() + "\n" + "\n".join(extra) + "\n" + "=" * 50


def slo_lines(s: dict) -> list[str]:
    """The SLO section of the text result: targets, then per class that has requests."""

    def num(v, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    t = s["targets_ms"]
    lines = ["{s:{c}^50}".format(s=" Serving to an SLO ", c="-"),
             f"{'Targets normal TTFT/TPOT (ms):':<40} {t['normal']['ttft']:g} / {t['normal']['tpot']:g}",
             f"{'Targets high TTFT/TPOT (ms):':<40} {t['high']['ttft']:g} / {t['high']['tpot']:g}",
             f"{'Admission by SLO:':<40} {'on' if s['admission'] else 'off'}"]
    for name in ("normal", "high", "all"):
        c = s[name]
        if not c["admitted"] + c["refused"] or (name == "all" and not (s["high"]["admitted"] + s["high"]["refused"])):
            continue
        err = c["prediction_error"]
        lines += [f"{name + ':':<40}",
                  f"{'  Admitted / refused / gave up:':<40} {c['admitted']} / {c['refused']} / {c['gave_up']}",
                  f"{'  Met / missed TTFT / TPOT / both:':<40} {c['met']} / {c['missed_ttft']} / {c['missed_tpot']} / "
                  f"{c['missed_both']}",
                  f"{'  Attainment (met / admitted):':<40} {num(c['attainment'], '.3f')}",
                  f"{'  Goodput (met req/s):':<40} {c['goodput']:.2f}",
                  f"{'  P99 TTFT / TPOT admitted (ms):':<40} {num(c['p99_ttft_ms'], '.1f')} / {num(c['p99_tpot_ms'], '.2f')}",
                  f"{'  Prediction error TTFT / TPOT (median):':<40} {num(err['ttft'], '.1%')} / {num(err['tpot'], '.1%')}"]
    return lines


class Fragmentation:
    """Samples of the cluster's queue heads: ``counts`` of samples, of those where some queue head was
    blocked for room, and of those where the cluster's free blocks together could hold one that no single
    instance's can (fragmentation)."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()

    def sample(self, loads: list) -> list:
        free = [ld.blocks_total - ld.blocks_used for ld in loads]
        total = sum(free)
        c = self.counts
        c["samples"] += 1
        blocked = [ld.hol_demand_blocks for ld, f in zip(loads, free) if ld.waiting and ld.hol_demand_blocks > f]
        if blocked:
            c["blocked"] += 1
            if any(d <= total and all(f < d for f in free) for d in blocked):
                c["fragmented"] += 1
        return loads
