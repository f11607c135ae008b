"""Fig 13 of the Llumnix paper (OSDI'24): priorities. High-priority requests' latency (TTFT, TPOT,
end-to-end; mean and P99) with and without headroom for high priority, llumnix against INFaaS++, with a
10% high-priority share; and what the normal requests pay for it.

    python -m llumnixctl.experiments.figs.fig13 [--out results/] [--quick] [--requests N] [--instances N]

The simulator's result has no per-priority split, so ``PrioritySimulation`` (a subclass of
``llumnixctl.experiments.sim.simulate.Simulation``) adds ``by_priority`` to it from its own requests.
"""

from __future__ import annotations

import multiprocessing
import os

from daemons.config import load_config
from llumnixctl.experiments.figs import common
from llumnixctl.experiments.sim.simulate import Network, Simulation, stats_of
from llumnixctl.experiments.traces.mix import paper_trace

METRICS = ("ttft", "tpot", "e2el")


class PrioritySimulation(Simulation):
    """The simulation, with the latencies of high- and normal-priority requests apart."""

    def result(self, wall_s: float) -> dict:
        out = super().result(wall_s)
        out["by_priority"] = {}
        for prio in ("high", "normal"):
            done = [r for r in self.requests.values() if r.finish and (r.trace.priority == "high") == (prio == "high")]
            figs = {"completed": len(done)}
            figs.update(stats_of("ttft", [r.first - r.trace.arrival_s for r in done]))
            figs.update(stats_of("tpot", [(r.last - r.first) / (r.tokens - 1) for r in done if r.tokens > 1]))
            figs.update(stats_of("e2el", [r.last - r.trace.arrival_s for r in done]))
            out["by_priority"][prio] = figs
        return out


def run_one(job: dict) -> dict:
    """One simulation of ``job`` (as common.run_all's, plus ``cls``: the Simulation subclass, and
    ``observers``: callables made in the worker by ``make_observers(sim)``, whose ``collect()`` goes into
    the result as ``observed``)."""
    import logging

    logging.getLogger("llumnix").setLevel(logging.WARNING)
    cfg = load_config(None, common.PAPER_LIKE + list(job.get("sets", ())))
    net = Network(**{**common.PAPER_NET, **job.get("net", {})})
    sim = job.get("cls", PrioritySimulation)(cfg, job["instances"], job["trace"], net, job.get("sample_s", 0.0))
    extra = job["make_observer"](sim) if job.get("make_observer") else None
    if extra is not None:
        sim.observe(extra)
    res = sim.run()
    if not job.get("keep_events"):
        res["scaling"].pop("events", None)
    if extra is not None and hasattr(extra, "collect"):
        res["observed"] = extra.collect(sim)
    return {"label": job["label"], "params": job.get("params", {}), "result": res}


def run_jobs(jobs: list[dict]) -> list[dict]:
    n = min(len(jobs), os.cpu_count() or 1)
    if n <= 1:
        return [run_one(j) for j in jobs]
    with multiprocessing.get_context("fork").Pool(n) as pool:
        return pool.map(run_one, jobs, chunksize=1)


# What the paper says (Llumnix, OSDI'24, §6.4 and the abstract). From memory of its text: only the
# abstract's "up to 1.5x" is quoted with confidence; the per-metric factors are not reproduced here
# because we do not remember them precisely enough to print numbers.
PAPER = {
    "setup": "LLaMA-7B on A10 instances, a generated trace with 10% high-priority requests (from memory; the "
             "exact instance count, rate and headroom value of the paper's run are not remembered precisely)",
    "high_priority_speedup": "up to 1.5x lower latency for high-priority requests (abstract: 'accelerates "
                             "high-priority requests by up to 1.5x'); the paper's Fig 13 shows mean and P99 "
                             "request, prefill and decode latencies of high-priority requests, with larger gains "
                             "in P99 prefill/decode than in mean end-to-end latency (factors per metric: unsure)",
    "normal_requests": "the paper reports normal requests' latencies as only slightly affected (from memory; unsure of numbers)",
    "baseline": "INFaaS++ (load-balanced dispatch, no migration), which treats both priorities alike",
    "certainty": "only the abstract's 'up to 1.5x' is certain; everything else in this block is recalled, not quoted",
}


def _bounds(args) -> dict:
    """--quick: lengths within [1, 512] tokens (the paper's mixes use [1, 6000]) to keep tests fast."""
    return {"prompt_bounds": (1, 512), "output_bounds": (1, 512)} if args.quick else {}


def build_jobs(args) -> tuple[list[dict], dict]:
    jobs, traces = [], {}
    for rate in args.rates:
        trace = paper_trace(args.mix, args.requests, rate, arrival="gamma", cv=args.cv, high_fraction=0.1,
                            seed=args.seed, **_bounds(args))
        traces[f"{rate:g}"] = common.trace_summary(trace)
        runs = [("infaas++", 0.0)] + [("llumnix", h) for h in args.headrooms]
        jobs += [{"label": f"rate={rate:g} {pol} headroom={h:g}", "instances": args.instances, "trace": trace,
                  "params": {"rate": rate, "policy": pol, "headroom": h},
                  "sets": [f"manager.dispatch_policy={pol}", f"scheduling.high_priority_headroom={h}"]}
                 for pol, h in runs]
    setup = {"trace": {"mix": args.mix, "requests": args.requests, "rates": args.rates, "arrival": "gamma",
                       "cv": args.cv, "high_fraction": 0.1, "seed": args.seed, "summary_by_rate": traces},
             "instances": args.instances, "runs": [j["label"] for j in jobs], "settings": common.PAPER_LIKE,
             "net": common.PAPER_NET,
             "note": "headroom only changes llumnix's virtual usage; infaas++ dispatches by real usage, so it "
                     "is run once per rate"}
    return jobs, setup


def analyse(results: list[dict]) -> dict:
    table = {}
    for r in results:
        res = r["result"]
        row = {"params": r["params"]}
        for prio in ("high", "normal"):
            bp = res["by_priority"][prio]
            row[prio] = {f"{s}_{m}_ms": round(bp[f"{s}_{m}_ms"], 1) for m in METRICS for s in ("mean", "p99")}
            row[prio]["completed"] = bp["completed"]
        row["all"] = {k: round(res[k], 1) for k in ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
                                                    "mean_e2el_ms", "p99_e2el_ms")}
        row["preemptions"] = res["preemptions"]
        row["migrations_committed"] = sum(v for k, v in res["migrations"].items() if k.endswith("/committed"))
        row["wall_s"] = round(res["wall_s"], 1)
        table[r["label"]] = row
    speedups = {}
    for label, row in table.items():
        rate = row["params"]["rate"]
        base = next(v for v in table.values() if v["params"] == {"rate": rate, "policy": "infaas++", "headroom": 0.0})
        noh = next((v for v in table.values() if v["params"] == {"rate": rate, "policy": "llumnix", "headroom": 0.0}),
                   None)
        if row is base:
            continue
        sp = {"vs_infaas++": {}, "vs_llumnix_no_headroom": {}, "normal_cost_vs_infaas++": {}}
        for m in METRICS:
            for s in ("mean", "p99"):
                k = f"{s}_{m}_ms"
                sp["vs_infaas++"][k] = _r(common.ratio(row["high"][k], base["high"][k]))
                if noh is not None and row is not noh:
                    sp["vs_llumnix_no_headroom"][k] = _r(common.ratio(row["high"][k], noh["high"][k]))
                sp["normal_cost_vs_infaas++"][k] = _r(common.ratio(base["normal"][k], row["normal"][k]))
        speedups[label] = sp
    return {"table": table, "high_priority_speedup": speedups,
            "speedup_definition": "infaas++ (or no-headroom) latency / this run's latency for high-priority "
                                  "requests (>1: faster); normal_cost: this run's normal-priority latency / "
                                  "infaas++'s (>1: normal requests pay)"}


def _r(x):
    return None if x is None else round(x, 2)


def differences(an: dict) -> list[str]:
    sps = an["high_priority_speedup"]
    best = {}
    for m in ("mean_e2el_ms", "p99_ttft_ms", "p99_tpot_ms", "mean_tpot_ms"):
        v, lbl = max(((sp["vs_infaas++"].get(m) or 0), lbl) for lbl, sp in sps.items())
        best[m] = f"{v:.2f}x ({lbl})"
    worst_normal = max(((sp["normal_cost_vs_infaas++"].get("mean_ttft_ms") or 0), lbl) for lbl, sp in sps.items())
    hp = [row["high"]["p99_ttft_ms"] for row in an["table"].values()]
    lo, hi = min(hp), max(hp)
    small = min((lbl for lbl in sps if an["table"][lbl]["params"]["headroom"] > 0),
                key=lambda lbl: (an["table"][lbl]["params"]["headroom"], -an["table"][lbl]["params"]["rate"]),
                default=None)
    small_cost = "" if small is None else (
        f"; at the smallest headroom ({small}) normal requests' mean TTFT is "
        f"{sps[small]['normal_cost_vs_infaas++']['mean_ttft_ms']:.2f}x and P99 TPOT "
        f"{sps[small]['normal_cost_vs_infaas++']['p99_tpot_ms']:.2f}x infaas++'s")
    return [
        "Ours, best high-priority speedups over infaas++: mean E2E " + best["mean_e2el_ms"] + ", P99 TTFT "
        + best["p99_ttft_ms"] + ", mean TPOT " + best["mean_tpot_ms"] + ", P99 TPOT " + best["p99_tpot_ms"]
        + "; the paper reports up to 1.5x. Ours is smaller mainly because the sim engine already admits "
        "high-priority requests first on every instance under both policies (so queueing, which dominates "
        "TTFT, is already mostly removed for them), leaving headroom only the decode interference of "
        "co-located normal requests to win, which our estimated step-time model (+0.3 ms per extra sequence "
        "in a batch) makes small compared to a real A10.",
        f"Normal requests pay for headroom: up to {worst_normal[0]:.2f}x infaas++'s mean TTFT ({worst_normal[1]})"
        + small_cost + "; the paper describes the normal requests' cost as small (recalled, unsure). A large "
        "headroom (0.3 of an instance's blocks per running high-priority request, with ~10% of requests high) "
        "reserves a big part of the cluster's virtual capacity, so normal requests queue behind it.",
        f"High-priority P99 TTFT ranges only {lo:.0f}-{hi:.0f} ms across all runs: it is the prefill of the longest "
        "prompts themselves (up to 6000 tokens at 0.2 ms a token, chunked), not queueing, so no dispatch "
        "choice can cut it in our model.",
        "E2E latency is dominated by long outputs (power-law lengths up to 6000 tokens at ~20-40 ms a token), "
        "so end-to-end ratios stay closer to 1 than TTFT/TPOT ratios.",
    ]


def plot(plt, data: dict) -> None:
    table = data["ours"]["table"]
    labels = list(table)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    width = 0.8 / len(labels)
    for ax, m in zip(axes, METRICS):
        for i, lbl in enumerate(labels):
            vals = [table[lbl]["high"][f"mean_{m}_ms"], table[lbl]["high"][f"p99_{m}_ms"],
                    table[lbl]["normal"][f"mean_{m}_ms"], table[lbl]["normal"][f"p99_{m}_ms"]]
            ax.bar([x + i * width for x in range(4)], vals, width, label=lbl)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(4)])
        ax.set_xticklabels(["high mean", "high P99", "normal mean", "normal P99"], fontsize=8)
        ax.set_title(f"{m.upper()} (ms)")
        ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle("Fig 13 (sim): high-priority latency with/without headroom, llumnix vs infaas++")


def parse(argv):
    p = common.size_parser("llumnixctl.experiments.figs.fig13", __doc__)
    p.add_argument("--rates", default=None, help="arrivals per second, comma-separated (default 40,55 x instances/16)")
    p.add_argument("--cv", type=float, default=2.0)
    p.add_argument("--mix", default=None, help="the paper's length mix (default M-M; S-S with --quick)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--headrooms", default="0,0.1,0.3", help="llumnix's scheduling.high_priority_headroom values")
    args = p.parse_args(argv)
    args.headrooms = [float(x) for x in args.headrooms.split(",")]
    if args.quick:
        args.requests, args.instances = args.requests or 60, args.instances or 2
        args.rates, args.mix = args.rates or "8", args.mix or "S-S"
        args.headrooms = args.headrooms[-1:]
    common.full_size(args)
    args.rates = ([float(x) for x in args.rates.split(",")] if args.rates
                  else [round(r * args.instances / 16, 1) for r in (40.0, 55.0)])
    return args


def main(argv: list[str] | None = None) -> dict:
    return common.run_figure(parse(argv), "fig13", "Llumnix (OSDI'24) Fig 13: priorities", PAPER, build_jobs,
                             run_jobs, analyse, lambda an, setup: differences(an), plot)


if __name__ == "__main__":
    main()
