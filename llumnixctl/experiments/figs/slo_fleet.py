"""Serving to an SLO, the fleet check (issue #37): 16 simulated paper-like instances (figs.common.PAPER_LIKE: an
estimated LLaMA-7B-on-A10), the paper's L-L length mix with bursty Gamma arrivals (cv 2, Fig 11's bursty trace),
the load swept from 0.5x to 3x capacity, three systems measured against the same targets:

- ``slo``: manager.dispatch_policy = slo (best predicted TTFT among instances under the TPOT target) and
  admission by SLO at the proxy (refused requests are counted, not served; queued ones give up at
  slo.give_up_factor x the TTFT target);
- ``llumnix``: queue everything (dispatch_policy llumnix, no admission; the targets only measure);
- ``infaas++``: likewise with INFaaS++ dispatch.

    python -m llumnixctl.experiments.figs.slo_fleet [--out results] [--quick] [--requests N] [--loads 0.5,1,2]

-> results/slo-fleet.json and results/slo-fleet.png (goodput, attainment of admitted requests, P99 TTFT, refused
share; per load). Goals (the issue's): attainment of admitted >= 0.99 at every load for slo; slo's goodput past
its knee (the load of its highest goodput) >= 0.9x the goodput at the knee; slo's goodput >= 2x llumnix's and
infaas++'s at 2x capacity.

Capacity and targets are constants of this instance and trace, measured once (see CAPACITY_NOTE, TARGETS_NOTE)
rather than at every run: each 16-instance simulation of the L-L mix costs minutes of CPU.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from daemons.config import load_config
from llumnixctl.experiments.figs.common import (PAPER_LIKE, PAPER_NET, collected, keep_part, run_sweep, sweep_options,
                                                sweep_wall_s, target_sets, trace_summary, write)
from llumnixctl.experiments.sim.simulate import Network, simulate
from llumnixctl.experiments.traces.mix import paper_trace

MIX, ARRIVAL, CV, SEED = "L-L", "gamma", 2.0, 1
CAPACITY = 7.5  # requests/s for 16 instances: see CAPACITY_NOTE
CAPACITY_NOTE = (
    "capacity = 7.5 req/s for 16 instances (scaled by instances / 16): the knee of queue-everything llumnix's P99 "
    "TTFT on this trace (L-L, Gamma cv 2, seed 1) in results/fig11.json (2,000 requests per point): 1.18 s at 6 "
    "req/s, 2.5 s at 7.5, 44 s at 9, 99 s at 12; a check run here (1,000 requests at 7 req/s) gave 1.15 s, the "
    "unloaded P99 (1 req/s: 1.07 s, set by the prefill of the longest prompts). 7.5 is the highest rate where "
    "P99 TTFT stays within ~2x of the unloaded P99. The knee depends on the trace's length: long requests fill "
    "the KV caches over minutes, so a shorter burst is absorbed (1,000 requests at 3x: llumnix's P99 TTFT was "
    "still 1.17 s); the sweep runs 2,000 requests per point, as fig11 measured the knee with.")
UNLOADED = {"rate": 1.0, "requests": 300, "policy": "llumnix", "median_ttft_ms": 23.0, "median_tpot_ms": 20.7,
            "p99_ttft_ms": 1068.0}
TARGETS = {"ttft_ms": 230.0, "tpot_ms": 41.0}
TARGETS_NOTE = ("TTFT target 230 ms = 10x the unloaded P50 TTFT (23 ms); TPOT target 41 ms = 2x the unloaded P50 "
                "TPOT (20.7 ms); unloaded: llumnix at 1 req/s (0.13x capacity), 300 requests of the same mix. "
                "Prompts longer than about 1,000 tokens cannot meet 230 ms even alone (0.2 ms per prefill token): "
                "slo refuses them at every load, the others serve them late.")
LOADS = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0)
SYSTEMS = {
    "slo": {"sets": ["manager.dispatch_policy=slo"], "admission": True},
    "llumnix": {"sets": ["manager.dispatch_policy=llumnix"], "admission": False},
    "infaas++": {"sets": ["manager.dispatch_policy=infaas++"], "admission": False},
}
COMMON_SETS = [  # fig11's (the project's defaults, written out)
    "scheduling.migrate_out_threshold=6.0", "scheduling.migrate_in_threshold=8.0",
    "scheduling.migration_interval_s=0.5", "scheduling.max_migrations_per_instance=2",
]
QUICK_BOUNDS = (1, 1024)  # (fig11.QUICK_BOUNDS)


def run_job(job: dict) -> dict:
    import logging

    logging.getLogger("llumnix").setLevel(logging.WARNING)
    cfg = load_config(None, PAPER_LIKE + COMMON_SETS + job["sets"])
    t0 = time.perf_counter()
    res = simulate(cfg, job["instances"], job["trace"], Network(**PAPER_NET), slo_admission=job["admission"])
    s = res["slo"]["normal"]
    row = {k: s[k] for k in ("admitted", "refused", "gave_up", "failed", "met", "missed_ttft", "missed_tpot",
                             "missed_both", "attainment", "goodput", "p99_ttft_ms", "p99_tpot_ms",
                             "prediction_error")}
    row.update({k: res[k] for k in ("duration", "completed", "median_ttft_ms", "median_tpot_ms",
                                    "request_throughput", "preemptions")})
    row["refused_share"] = s["refused"] / max(1, s["admitted"] + s["refused"])
    row["migrations_committed"] = sum(v for k, v in res["migrations"].items() if k.endswith("/committed"))
    row["wall_s"] = time.perf_counter() - t0
    return keep_part(job, {"load": job["load"], "system": job["system"], "requests": len(job["trace"]), "result": row},
                     f"{job['load']:g}x-{job['system']}")


def jobs_for(loads, systems, n: int, instances: int, quick: bool, parts: str | None) -> tuple[list[dict], dict]:
    bounds = QUICK_BOUNDS if quick else None
    kw = {"prompt_bounds": bounds, "output_bounds": bounds} if bounds else {}
    jobs, traces = [], {}
    for load in loads:
        rate = load * CAPACITY * instances / 16
        tr = paper_trace(MIX, n, rate, arrival=ARRIVAL, cv=CV, seed=SEED, **kw)
        traces[f"{load:g}"] = {"rate": rate, "summary": trace_summary(tr)}
        for name in systems:
            spec = SYSTEMS[name]
            jobs.append({"label": f"{load:g}x/{name}", "load": load, "system": name, "instances": instances,
                         "trace": tr, "sets": spec["sets"] + target_sets(TARGETS), "admission": spec["admission"],
                         "parts": parts, "cost": load})
    return jobs, traces


def goals(points: dict) -> dict:
    """The issue's goals over the sweep (``points``: load -> system -> row)."""
    loads = sorted(points, key=float)
    slo = {ld: points[ld].get("slo") for ld in loads if points[ld].get("slo")}
    out: dict = {}
    if slo:
        worst = min(slo.items(), key=lambda kv: kv[1]["attainment"] or 0.0)
        out["attainment_of_admitted_at_least_0.99"] = {
            "met": all((r["attainment"] or 0.0) >= 0.99 for r in slo.values()),
            "per_load": {ld: r["attainment"] for ld, r in slo.items()}, "worst": {"load": worst[0],
                                                                                  "attainment": worst[1]["attainment"]}}
        # The knee: the load of slo's highest goodput (the highest load swept if it still rises), and the
        # capacity point (1x) beside it.
        knee = max(slo, key=lambda ld: slo[ld]["goodput"])
        past = {ld: r["goodput"] for ld, r in slo.items() if float(ld) > float(knee)}
        floor = min(past.values()) if past else None
        past_1x = {ld: r["goodput"] for ld, r in slo.items() if float(ld) > 1.0}
        at_1x = slo.get("1", {}).get("goodput")
        out["goodput_past_knee_at_least_0.9x"] = {
            "knee_load": knee, "goodput_at_knee": slo[knee]["goodput"], "past_knee": past,
            "min_ratio": None if floor is None else floor / slo[knee]["goodput"],
            "met": True if floor is None else floor >= 0.9 * slo[knee]["goodput"],
            "note": "goodput peaks at the highest load swept: nothing past it fell" if floor is None else "",
            "min_ratio_past_1x_to_1x": (min(past_1x.values()) / at_1x) if past_1x and at_1x else None}
    two = points.get("2")
    if two and two.get("slo"):
        ratios = {other: (two["slo"]["goodput"] / two[other]["goodput"] if two[other]["goodput"] else float("inf"))
                  for other in ("llumnix", "infaas++") if two.get(other)}
        out["goodput_at_2x_at_least_2x_others"] = {"ratios": ratios, "met": all(r >= 2.0 for r in ratios.values())}
    return out


def plot(plt, data):
    pts = data["points"]
    loads = sorted(pts, key=float)
    panels = [("goodput", "goodput (met req/s)", False), ("attainment", "attainment of admitted", False),
              ("p99_ttft_ms", "P99 TTFT of admitted (ms)", True), ("p99_tpot_ms", "P99 TPOT of admitted (ms)", True),
              ("refused_share", "refused share", False)]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 2.8))
    for ax, (k, title, log) in zip(axes, panels):
        for name, style in zip(SYSTEMS, ("o-", "s--", "^:")):
            xs = [float(ld) for ld in loads if pts[ld].get(name)]
            ys = [pts[ld][name][k] for ld in loads if pts[ld].get(name)]
            ax.plot(xs, ys, style, label=name, ms=4)
        if log:
            ax.set_yscale("log")
        if k == "attainment":
            ax.axhline(0.99, color="grey", lw=0.6, ls=":")
        ax.set_title(title, fontsize=8)
        ax.set_xlabel("load (x capacity)", fontsize=7)
        ax.tick_params(labelsize=6)
    axes[0].legend(fontsize=6)
    t = data["run"]["targets"]
    fig.suptitle(f"Serving to an SLO: {data['run']['instances']} simulated instances, {MIX} Gamma cv {CV:g}, "
                 f"TTFT {t['ttft_ms']:g} ms, TPOT {t['tpot_ms']:g} ms", fontsize=9)
    fig.tight_layout()


def table(data) -> str:
    head = f"{'load':>5} {'system':>9} {'adm':>5} {'ref':>5} {'gave':>5} {'met':>5} {'attain':>7} {'goodput':>8} " \
           f"{'p99ttft':>9} {'p99tpot':>8} {'errTTFT':>8} {'errTPOT':>8} {'wall':>6}"
    lines = [head]
    for ld in sorted(data["points"], key=float):
        for name, r in data["points"][ld].items():
            e = r["prediction_error"]

            def f(v, spec):
                return "-" if v is None else format(v, spec)

            lines.append(f"{ld:>5} {name:>9} {r['admitted']:>5} {r['refused']:>5} {r['gave_up']:>5} {r['met']:>5} "
                         f"{f(r['attainment'], '.3f'):>7} {r['goodput']:>8.3f} {f(r['p99_ttft_ms'], '.0f'):>9} "
                         f"{f(r['p99_tpot_ms'], '.1f'):>8} {f(e['ttft'], '.0%'):>8} {f(e['tpot'], '.0%'):>8} "
                         f"{r['wall_s']:>6.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("results"), help="where slo-fleet.json and slo-fleet.png go")
    p.add_argument("--quick", action="store_true", help="a tiny version (tests): short lengths, 2 instances")
    p.add_argument("--requests", type=int, default=None, help="requests per simulation (default 2000)")
    p.add_argument("--instances", type=int, default=None, help="instances (default 16)")
    p.add_argument("--loads", default=None, help="loads, x capacity, comma-separated (default 0.5,1,1.5,2,2.5,3)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="systems to run (default all)")
    sweep_options(p, "run nothing: the figure from the rows of earlier runs' --parts DIR (a sweep run in pieces)")
    args = p.parse_args(argv)
    n = args.requests or (40 if args.quick else 2000)
    instances = args.instances or (2 if args.quick else 16)
    loads = [float(x) for x in args.loads.split(",")] if args.loads else list(LOADS)
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        if s not in SYSTEMS:
            p.error(f"unknown system {s!r}: {', '.join(SYSTEMS)}")
    t0 = time.perf_counter()
    if args.collect is not None:
        results = collected(p, args.collect)
        n = results[0]["requests"]
        loads = sorted({r["load"] for r in results})
    jobs, traces = jobs_for(loads, systems, n, instances, args.quick, args.parts)
    procs = args.processes or min(len(jobs), os.cpu_count() or 1)
    if args.collect is None:
        results = run_sweep(run_job, jobs, procs)
    points: dict = {}
    for r in results:
        points.setdefault(f"{r['load']:g}", {})[r["system"]] = r["result"]
    points = {ld: {s: points[ld][s] for s in SYSTEMS if s in points[ld]} for ld in sorted(points, key=float)}
    data = {
        "figure": "slo-fleet",
        "what": "goodput (requests per second that met both targets), attainment of admitted requests, P99 TTFT/TPOT "
                "and prediction error per system and load; slo = dispatch_policy slo + admission by SLO; llumnix and "
                "infaas++ queue everything",
        "run": {"instances": instances, "requests_per_simulation": n, "quick": args.quick, "mix": MIX,
                "arrival": ARRIVAL, "cv": CV, "seed": SEED, "capacity_rps_16": CAPACITY, "capacity_note": CAPACITY_NOTE,
                "unloaded": UNLOADED, "targets": TARGETS, "targets_note": TARGETS_NOTE,
                "settings": PAPER_LIKE + COMMON_SETS + target_sets(TARGETS),
                "systems": {s: SYSTEMS[s] for s in systems}, "network": PAPER_NET, "traces": traces,
                "wall_s": sweep_wall_s(t0, args.collect, results, procs),
                "cores": os.cpu_count(), "processes": procs},
        "points": points,
        "goals": goals(points),
    }
    write(args.out, "slo-fleet", data, plot)
    print(table(data))
    print({k: v.get("met") for k, v in data["goals"].items()})
    return data


if __name__ == "__main__":
    main()
