"""Fig 12 of the Llumnix paper (OSDI'24): memory fragmentation, llumnix vs INFaaS++, over a Fig 11 style
load (16 instances), in virtual time.

Fragmentation, sampled every 100 ms of virtual time: a sample is *blocked* when some instance's queue head
waits for room, and *fragmented* when such a head would fit in the cluster's total free KV blocks but in
no single instance's (llumnixctl.experiments.sim.simulate's ``sample_s``).

    python -m llumnixctl.experiments.figs.fig12 [--out results] [--quick] [--requests N] [--instances N]
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict

from llumnixctl.experiments.figs.common import PAPER_LIKE, PAPER_NET, trace_summary, write
from llumnixctl.experiments.figs.fig11 import COMMON_SETS, bounds, latency, parser, run_jobs
from llumnixctl.experiments.traces.mix import paper_trace

POLICIES = ("llumnix", "infaas++")
SWEEP = [("M-M", "gamma", 2.0, (80, 120, 150)), ("L-L", "gamma", 2.0, (20, 30))]  # as Fig 11's gamma points
QUICK = [("M-M", "gamma", 2.0, (40,))]
SAMPLE_S = 0.1

PAPER = {
    "source": "Llumnix (OSDI'24), Fig 12 and Section 6.3 (16 LLaMA-7B instances)",
    "claim": "llumnix's migration de-fragments memory across instances: the paper shows its fragmented memory "
             "(free memory that no single instance can use for its queue head) well below INFaaS++'s over "
             "the serving run",
    "numbers": None,
    "unsure": "we do not remember the paper's exact fragmentation figures nor its exact metric (it plots "
              "fragmented memory over time / as a share of the cluster's memory); none are given here, and "
              "ours is a frequency of fragmented samples, not an amount of memory",
}

DIFFERENCES = [
    "By our strict metric llumnix shows MORE fragmented samples than INFaaS++ in the overloaded L-L runs: it "
    "keeps instances evenly loaded, so when a queue head is blocked no single instance has room while the sum "
    "does; but its queue heads are blocked far less often (blocked_share: none at all in the M-M runs, where "
    "INFaaS++'s are blocked in 18-56% of samples, and about a third less in L-L), which is the effect the "
    "paper's de-fragmentation aims at. The paper's fragmentation is an amount of memory, not this frequency.",
    "Our metric counts how often (share of 100 ms samples) a queue head is blocked although the cluster's "
    "total free blocks could hold it; the paper's measures fragmented memory, so only the direction "
    "(llumnix lower than INFaaS++) is comparable.",
    "Estimated A10 latency model and a short sweep (2-core machine): the rates where fragmentation appears "
    "differ from the paper's.",
]


def main(argv: list[str] | None = None) -> dict:
    ap = parser(__doc__, 2000, 16)
    ap.add_argument("--own-runs", action="store_true",
                    help="run this figure's own simulations even when OUT/fig11.json (whose runs sample "
                         "fragmentation) is there")
    args = ap.parse_args(argv)
    n = args.requests or (30 if args.quick else 2000)
    instances = args.instances or (2 if args.quick else 16)
    t0 = time.perf_counter()
    f11 = args.out / "fig11.json"
    if not (args.quick or args.own_runs or args.requests or args.instances) and f11.exists():
        data = _from_fig11(json.loads(f11.read_text()), f11)
        if data is not None:
            write(args.out, "fig12", data, plot)
            print(f"fig12 (from {f11}): {data['summary']}")
            return data
    jobs, traces = [], {}
    for mix, arrival, cv, rates in (QUICK if args.quick else SWEEP):
        for r16 in rates:
            rate = r16 * instances / 16
            tr = paper_trace(mix, n, rate, arrival=arrival, cv=cv, seed=1, **bounds(args.quick))
            key = f"{mix}/{arrival}(cv={cv})/{rate:g}"
            traces[key] = {"mix": mix, "arrival": arrival, "cv": cv, "rate": rate, "seed": 1,
                           "length_bounds": bounds(args.quick)["prompt_bounds"],
                           "summary": trace_summary(tr)}
            for pol in POLICIES:
                jobs.append({"label": f"{key}/{pol}", "instances": instances, "trace": tr, "sample_s": SAMPLE_S,
                             "sets": COMMON_SETS + [f"manager.dispatch_policy={pol}"],
                             "params": {"point": key, "policy": pol}, "cost": rate * (4 if mix == "L-L" else 1)})
    by = defaultdict(dict)
    for r in run_jobs(jobs):
        res = r["result"]
        by[r["params"]["point"]][r["params"]["policy"]] = _frag(res["fragmentation"], latency(res))
    pts = _points(by, traces)
    run = {"instances": instances, "requests_per_simulation": n, "quick": args.quick,
           "settings": PAPER_LIKE + COMMON_SETS, "network": PAPER_NET, "traces": traces, "seeds": [1],
           "wall_s": time.perf_counter() - t0, "cores": os.cpu_count()}
    data = _data(pts, run)
    write(args.out, "fig12", data, plot)
    print(f"fig12: {data['summary']}; wall {data['run']['wall_s']:.0f} s")
    return data


def _frag(f: dict, lat: dict) -> dict:
    s, b, fr = f.get("samples", 0), f.get("blocked", 0), f.get("fragmented", 0)
    return {"samples": s, "blocked": b, "fragmented": fr,
            "fragmented_share": fr / s if s else 0.0, "blocked_share": b / s if s else 0.0,
            "fragmented_of_blocked": fr / b if b else None, "latency": lat}


def _points(by: dict, traces: dict) -> list[dict]:
    pts = []
    for key, t in traces.items():
        p = by[key]
        l, i = p["llumnix"]["fragmented_share"], p["infaas++"]["fragmented_share"]
        pts.append({"point": key, **{k: t[k] for k in ("mix", "arrival", "cv", "rate")}, "policies": p,
                    "fragmentation_reduction_vs_infaas++": None if not i else 1 - l / i})
    return pts


def _from_fig11(f11: dict, path) -> dict | None:
    """The fragmentation samples of the Fig 11 runs (same load, same settings): no second simulation."""
    try:
        by = defaultdict(dict)
        for pt in f11["points"]:
            for pol in POLICIES:
                lat = dict(pt["policies"][pol])
                by[pt["point"]][pol] = _frag(lat.pop("fragmentation"), lat)
        traces = f11["run"]["traces"]
        run = {**{k: v for k, v in f11["run"].items() if k != "per_policy"},
               "source": f"the Fig 11 runs ({path}), which sample fragmentation every {SAMPLE_S} s"}
    except (KeyError, TypeError):
        return None
    return _data(_points(by, traces), run)


def _data(pts: list[dict], run: dict) -> dict:
    return {
        "figure": "fig12",
        "what": "Fig 12: fragmentation, llumnix vs infaas++",
        "metric": {"sample_s": SAMPLE_S,
                   "blocked": "samples where some instance's queue head waits for KV room",
                   "fragmented": "blocked samples where such a head fits in the cluster's total free blocks but "
                                 "in no single instance's",
                   "fragmented_share": "fragmented / samples"},
        "run": run,
        "points": pts,
        "summary": {
            "ours_mean_fragmented_share": {
                pol: sum(p["policies"][pol]["fragmented_share"] for p in pts) / len(pts) for pol in POLICIES},
            "ours_mean_blocked_share": {
                pol: sum(p["policies"][pol]["blocked_share"] for p in pts) / len(pts) for pol in POLICIES},
            "by_mix": {mix: {pol: {k: sum(p["policies"][pol][k] for p in ps) / len(ps)
                                   for k in ("fragmented_share", "blocked_share")} for pol in POLICIES}
                       for mix in sorted({p["mix"] for p in pts})
                       for ps in [[p for p in pts if p["mix"] == mix]]},
        },
        "paper": PAPER,
        "differences": DIFFERENCES,
    }


def plot(plt, data):
    pts = data["points"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    xs = range(len(pts))
    for ax, k, title in ((axes[0], "fragmented_share", "fragmented samples (share)"),
                         (axes[1], "blocked_share", "blocked queue heads (share)")):
        for j, pol in enumerate(POLICIES):
            ax.bar([x + 0.4 * j for x in xs], [p["policies"][pol][k] for p in pts], 0.4, label=pol)
        ax.set_xticks([x + 0.2 for x in xs])
        ax.set_xticklabels([p["point"].replace("/gamma(cv=2.0)/", " @") for p in pts], fontsize=7, rotation=20)
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelsize=6)
        ax.legend(fontsize=7)
    fig.suptitle(f"Fig 12 (simulated, {data['run']['instances']} instances)", fontsize=10)
    fig.tight_layout()


if __name__ == "__main__":
    main()
