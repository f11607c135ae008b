"""Information lag (a reviewer's question to the Llumnix paper): P99 TTFT and herding of dispatches as the
load reports' lag to the manager grows (0, 10, 50, 200, 1000 ms), with and without counting in-flight
dispatches (dispatches not yet in an instance's reports count as pending usage;
``manager.pending_dispatch_ttl_s=0`` turns that off). 16 instances, llumnix dispatch, virtual time.

    python -m llumnixctl.experiments.figs.lag [--out results] [--quick] [--requests N] [--instances N]
"""

from __future__ import annotations

import os
import time

from llumnixctl.experiments.figs.common import PAPER_LIKE, PAPER_NET, trace_summary, write
from llumnixctl.experiments.figs.fig11 import COMMON_SETS, bounds, HERD_WINDOW_S, latency, parser, run_jobs
from llumnixctl.experiments.traces.mix import paper_trace

LAGS_MS = (0, 10, 50, 200, 1000)
MODES = {"pending counted": "manager.pending_dispatch_ttl_s=5.0",
         "pending not counted": "manager.pending_dispatch_ttl_s=0"}
MIX, ARRIVAL, CV, RATE16 = "M-M", "gamma", 2.0, 120

HERDING = {
    "window_s": HERD_WINDOW_S,
    "mean_max_share": "dispatches are cut into 100 ms windows of virtual time; in each window with at least 4 "
                      "dispatches, the share of them that went to the most-chosen instance; averaged over windows",
    "p99_max_share": "the 99th percentile of that share over windows",
    "ideal_max_share": "the same average if every window were spread as evenly as possible (ceil(k/N)/k)",
    "same_as_previous": "share of dispatches that went to the same instance as the dispatch just before "
                        "(when it came at most 100 ms earlier)",
    "uniform_same_as_previous": "1/N: what a uniform random choice would give",
}

PAPER = {
    "source": "not in the paper: a reviewer's question (how stale may the global scheduler's load view be?)",
    "paper_figures": None,
    "related_claim": "Llumnix's instances report their load to the global scheduler asynchronously; the paper "
                     "argues the scheduler needs only approximate, recent load (no numbers for lag given)",
    "unsure": "the paper has no information-lag experiment that we know of; nothing to put beside ours",
}


def main(argv: list[str] | None = None) -> dict:
    args = parser(__doc__, 1500, 16).parse_args(argv)
    n = args.requests or (30 if args.quick else 1500)
    instances = args.instances or (2 if args.quick else 16)
    lags = (0, 200) if args.quick else LAGS_MS
    rate = (40 if args.quick else RATE16) * instances / 16
    t0 = time.perf_counter()
    tr = paper_trace(MIX, n, rate, arrival=ARRIVAL, cv=CV, seed=1, **bounds(args.quick))
    jobs = []
    for mode, s in MODES.items():
        for lag in lags:
            jobs.append({"label": f"{mode}/{lag}", "instances": instances, "trace": tr,
                         "sets": COMMON_SETS + ["manager.dispatch_policy=llumnix", s],
                         "net": {"report_lag_s": lag / 1e3}, "params": {"mode": mode, "lag_ms": lag}})
    rows = []
    for r in run_jobs(jobs):
        res = r["result"]
        rows.append({**r["params"], "latency": latency(res), "herding": res["herding"]})
    rows.sort(key=lambda x: (x["mode"], x["lag_ms"]))
    data = {
        "figure": "lag",
        "what": "P99 TTFT and herding vs load-report lag, pending dispatches counted or not (llumnix dispatch)",
        "run": {"instances": instances, "requests_per_simulation": n, "quick": args.quick,
                "settings": PAPER_LIKE + COMMON_SETS + ["manager.dispatch_policy=llumnix"], "modes": MODES,
                "lags_ms": list(lags), "network": PAPER_NET,
                "trace": {"mix": MIX, "arrival": ARRIVAL, "cv": CV, "rate": rate, "seed": 1,
                          "length_bounds": bounds(args.quick)["prompt_bounds"],
                          "summary": trace_summary(tr)},
                "wall_s": time.perf_counter() - t0, "cores": os.cpu_count()},
        "herding_definition": HERDING,
        "rows": rows,
        "paper": PAPER,
        "notes": ["Even at 0 ms lag, dispatch without pending counting herds: an instance's report reflects a "
                  "dispatch only after the proxy's submit (half the dispatch round trip + submit_s) and the "
                  "instance's coalescing (instance.load_report_min_interval_s=0.02), so a burst of dispatches "
                  "within ~20 ms sees the same freest instance; counting in-flight dispatches removes that at "
                  "every lag measured here."],
        "differences": ["No paper figure to compare with. In the simulator a load report is the instance's exact "
                        "state delayed by the lag; real reports also coalesce (instance.load_report_min_interval_s) "
                        "and jitter, which the simulator models only as the fixed minimum interval."],
    }
    write(args.out, "lag", data, plot)
    for x in rows:
        print(f"lag: {x['mode']:<20} {x['lag_ms']:>5} ms  p99 ttft {x['latency']['p99_ttft_ms']:8.0f} ms  "
              f"max share {x['herding']['mean_max_share']}  same-as-prev {x['herding']['same_as_previous']:.3f}")
    return data


def plot(plt, data):
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    for mode in MODES:
        rs = [r for r in data["rows"] if r["mode"] == mode]
        xs = [max(r["lag_ms"], 1) for r in rs]
        axes[0].plot(xs, [r["latency"]["p99_ttft_ms"] for r in rs], "o-", label=mode)
        axes[1].plot(xs, [r["herding"]["mean_max_share"] or 0 for r in rs], "o-", label=mode)
        axes[2].plot(xs, [r["herding"]["same_as_previous"] for r in rs], "o-", label=mode)
    for ax, t in zip(axes, ("P99 TTFT (ms)", "mean max share of one instance per 100 ms",
                            "same instance as previous dispatch")):
        ax.set_xscale("log")
        ax.set_xlabel("report lag (ms; 0 drawn at 1)")
        ax.set_title(t, fontsize=9)
        ax.legend(fontsize=7)
    axes[0].set_yscale("log")
    fig.suptitle(f"Information lag (simulated, {data['run']['instances']} instances)", fontsize=10)
    fig.tight_layout()


if __name__ == "__main__":
    main()
