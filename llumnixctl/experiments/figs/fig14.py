"""Fig 14 and Fig 15 of the Llumnix paper (OSDI'24): auto-scaling. Cost (instance-seconds, and the mean
instance count) against P99 latency, llumnix against INFaaS++ under the same freeness-based scaling rule
(``scaling.policy=llumnix`` applies to both dispatch policies), on a trace whose load goes low-high-low;
the scaling thresholds are swept to trace a cost-latency curve (the paper's Fig 15 sweeps the scale-up
threshold).

    python -m llumnixctl.experiments.figs.fig14 [--out results/] [--quick] [--requests N] [--instances N]

``--instances`` is the most instances the cluster may scale to (scaling.max_instances); it starts with a
quarter of that. A launched instance registers ``--launch-s`` (default 20 s) later: loading LLaMA-7B's
13 GB of fp16 weights from a local NVMe disk plus vLLM's start-up (profiling, CUDA graphs) takes on the
order of 15-30 s on one A10 (an estimate, not a measurement).
"""

from __future__ import annotations

from dataclasses import replace

from llumnixctl.experiments.figs import common
from llumnixctl.experiments.figs.fig13 import run_jobs
from llumnixctl.experiments.traces.mix import paper_trace, reindex
from llumnixctl.experiments.traces.gen import TraceRequest

PAPER = {
    "setup": "LLaMA-7B on A10s with auto-scaling by average freeness; Fig 14 varies the Poisson rate and the "
             "Gamma CV, Fig 15 sweeps the scale-up threshold (from memory; the thresholds and launch times the "
             "paper used are not remembered precisely — we think scale-out/in thresholds of about 10 and 60 "
             "free blocks per request, unsure)",
    "fig14": "llumnix has lower P99 prefill and request latencies than INFaaS++ with the same scaling rule, "
             "while using similar or fewer instances on average (per-point factors: not remembered, unsure)",
    "fig15": "at similar P99 prefill latency llumnix needs fewer instances: cost savings of up to 36% (the "
             "abstract's 'up to 36% cost savings while achieving similar tail latencies'; that this figure "
             "is the one in Fig 15 is from memory, fairly but not fully sure)",
    "cost_saving_up_to": 0.36,
    "certainty": "0.36 is the abstract's number; the rest is recalled, not quoted",
}


def low_high_low(n: int, low: float, high: float, mix: str, cv: float, seed: int,
                 bounds: dict | None = None) -> list[TraceRequest]:
    """A trace in three phases of equal length, rates low, high, low (Gamma arrivals of ``cv`` within each)."""
    dur = n / (low + high + low)  # each phase lasts this long
    out: list[TraceRequest] = []
    t0 = 0.0
    for k, rate in enumerate((low, high, low)):
        part = paper_trace(mix, max(1, round(rate * dur)), rate, arrival="gamma", cv=cv, seed=seed + k, **(bounds or {}))
        out += [replace(r, arrival_s=t0 + r.arrival_s) for r in part if r.arrival_s < dur]
        t0 += dur
    return reindex(sorted(out, key=lambda r: r.arrival_s))


def _bounds(args) -> dict:
    """--quick: lengths within [1, 512] tokens (the paper's mixes use [1, 6000]) to keep tests fast."""
    return {"prompt_bounds": (1, 512), "output_bounds": (1, 512)} if args.quick else {}


def build_jobs(args) -> tuple[list[dict], dict]:
    trace = low_high_low(args.requests, args.low, args.high, args.mix, args.cv, args.seed, _bounds(args))
    start = max(args.min_instances, args.instances // 4)
    base = ["scaling.policy=llumnix", f"scaling.min_instances={args.min_instances}",
            f"scaling.max_instances={args.instances}", f"scaling.sustain_s={args.sustain_s}",
            f"scaling.cooldown_s={args.cooldown_s}"]
    jobs = []
    for up, down in args.thresholds:
        for pol in ("llumnix", "infaas++"):
            jobs.append({"label": f"{pol} up={up:g} down={down:g}", "instances": start, "trace": trace,
                         "keep_events": True, "net": {"launch_s": args.launch_s},
                         "params": {"policy": pol, "scale_up_threshold": up, "scale_down_threshold": down},
                         "sets": base + [f"manager.dispatch_policy={pol}", f"scaling.scale_up_threshold={up}",
                                         f"scaling.scale_down_threshold={down}"]})
    setup = {"trace": {"shape": "low-high-low, three phases of equal length", "mix": args.mix,
                       "rates": [args.low, args.high, args.low], "arrival": "gamma", "cv": args.cv,
                       "seed": args.seed, "summary": common.trace_summary(trace)},
             "start_instances": start, "min_instances": args.min_instances, "max_instances": args.instances,
             "launch_s": args.launch_s, "sustain_s": args.sustain_s, "cooldown_s": args.cooldown_s,
             "thresholds": args.thresholds, "settings": common.PAPER_LIKE + base, "net": common.PAPER_NET}
    return jobs, setup


def analyse(results: list[dict]) -> dict:
    points = {}
    for r in results:
        res = r["result"]
        ev = res["scaling"].pop("events", [])
        points[r["label"]] = {
            "params": r["params"], "instance_seconds": round(res["instance_seconds"], 1),
            "mean_instances": round(res["instance_seconds"] / res["duration"], 2),
            "duration_s": round(res["duration"], 1),
            "scale_out": res["scaling"]["out"], "scale_in": res["scaling"]["in"],
            **{k: round(res[k], 1) for k in ("p99_ttft_ms", "mean_ttft_ms", "p99_tpot_ms", "mean_tpot_ms",
                                             "p99_e2el_ms", "mean_e2el_ms")},
            "preemptions": res["preemptions"],
            "migrations_committed": sum(v for k, v in res["migrations"].items() if k.endswith("/committed")),
            "serving_over_time": [[round(e["t"], 1), e["serving"] + (e["what"] == "out")] for e in ev],
            "wall_s": round(res["wall_s"], 1),
        }
    pairs = {}
    llx = [p for p in points.values() if p["params"]["policy"] == "llumnix"]
    inf = [p for p in points.values() if p["params"]["policy"] == "infaas++"]
    for a in llx:
        b = next(p for p in inf if p["params"]["scale_up_threshold"] == a["params"]["scale_up_threshold"])
        key = f"up={a['params']['scale_up_threshold']:g} down={a['params']['scale_down_threshold']:g}"
        pairs[key] = {"cost_llumnix_over_infaas++": _r(a["instance_seconds"] / b["instance_seconds"]),
                      "p99_ttft_speedup": _r(common.ratio(a["p99_ttft_ms"], b["p99_ttft_ms"])),
                      "p99_e2el_speedup": _r(common.ratio(a["p99_e2el_ms"], b["p99_e2el_ms"]))}
    # the paper's Fig 15 reading: the largest saving of a llumnix point over an infaas++ point whose P99 TTFT
    # is no lower than the llumnix point's (within 10%)
    best = None
    for a in llx:
        for b in inf:
            if a["p99_ttft_ms"] <= 1.1 * b["p99_ttft_ms"]:
                s = 1 - a["instance_seconds"] / b["instance_seconds"]
                if best is None or s > best[0]:
                    best = (s, a["params"], b["params"], a["p99_ttft_ms"], b["p99_ttft_ms"])
    saving = None if best is None else {
        "saving": round(best[0], 3), "llumnix": best[1], "infaas++": best[2],
        "p99_ttft_ms": {"llumnix": best[3], "infaas++": best[4]},
        "definition": "largest 1 - cost(llumnix)/cost(infaas++) over pairs of points (any thresholds) where "
                      "llumnix's P99 TTFT is at most 1.1x infaas++'s"}
    return {"points": points, "same_thresholds": pairs, "cost_saving_at_similar_p99_ttft": saving}


def _r(x):
    return None if x is None else round(x, 3)


def differences(an: dict, setup: dict | None = None) -> list[str]:
    s = an["cost_saving_at_similar_p99_ttft"]
    pct = "n/a" if s is None else f"{100 * s['saving']:.0f}%"
    rates = (setup or {}).get("trace", {}).get("rates") or [5.0, 30.0]
    step = f"{rates[1] / rates[0]:g}x"
    return [f"Ours: the largest cost saving of llumnix at similar (<= 1.1x) P99 TTFT is {pct} against the "
            "paper's up to 36%; migration here is the only thing that differs between the two curves (same "
            "scaling rule, same trace), and our sim instance's estimated A10 profile, the 20 s launch time and "
            "the low-high-low trace (not the paper's) all shift where the curves sit, so only the direction, not "
            "the size, is meant to be compared.",
            "Our absolute P99 TTFTs (seconds to minutes) are far above what we recall the paper plotting (a few seconds; unsure): "
            f"the trace steps up {step} at once and a launched instance serves only launch_s (20 s) after the scaling decision, so a "
            "backlog builds while instances load; the gap between the two policies comes from that backlog, "
            "which llumnix spreads onto new instances by migration while infaas++ only sends new requests there."]


def plot(plt, data: dict) -> None:
    pts = data["ours"]["points"]
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4))
    for pol, mark in (("llumnix", "o-"), ("infaas++", "s--")):
        ps = sorted((p for p in pts.values() if p["params"]["policy"] == pol), key=lambda p: p["mean_instances"])
        a1.plot([p["mean_instances"] for p in ps], [p["p99_ttft_ms"] / 1e3 for p in ps], mark, label=pol)
        a2.plot([p["mean_instances"] for p in ps], [p["p99_e2el_ms"] / 1e3 for p in ps], mark, label=pol)
        for p in ps:
            a1.annotate(f"{p['params']['scale_up_threshold']:g}", (p["mean_instances"], p["p99_ttft_ms"] / 1e3),
                        fontsize=7)
    a1.set_xlabel("mean instances (instance-seconds / duration)")
    a1.set_ylabel("P99 TTFT (s)")
    a1.set_yscale("log")
    a2.set_xlabel("mean instances")
    a2.set_ylabel("P99 end-to-end (s)")
    a1.legend()
    a1.set_title("cost vs P99 TTFT (labels: scale-up threshold)")
    mid = data["setup"]["thresholds"][len(data["setup"]["thresholds"]) // 2]
    for lbl, p in pts.items():
        if p["params"]["scale_up_threshold"] == mid[0] and p["serving_over_time"]:
            xs = [0.0] + [t for t, _ in p["serving_over_time"]]
            ys = [data["setup"]["start_instances"]] + [n for _, n in p["serving_over_time"]]
            a3.step(xs, ys, where="post", label=lbl)
    a3.set_xlabel("time (s)")
    a3.set_ylabel("instances (after each scaling decision)")
    if a3.lines:
        a3.legend(fontsize=7)
    a3.set_title("scaling decisions over time")
    fig.suptitle("Fig 14/15 (sim): auto-scaling, llumnix vs infaas++ under the same scaling rule")


def parse(argv):
    p = common.size_parser("llumnixctl.experiments.figs.fig14", __doc__, "scaling.max_instances")
    p.add_argument("--mix", default=None)
    p.add_argument("--cv", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--launch-s", type=float, default=20.0)
    p.add_argument("--sustain-s", type=float, default=2.0)
    p.add_argument("--cooldown-s", type=float, default=2.0)
    p.add_argument("--rates", default=None, help="LOW,HIGH arrivals per second (default 5,30 x instances/16)")
    p.add_argument("--name", default="fig14", help="write NAME.json and NAME.png")
    p.add_argument("--thresholds", default="2:30,5:40,10:60,20:90", help="scale_up:scale_down pairs")
    args = p.parse_args(argv)
    args.thresholds = [tuple(float(x) for x in t.split(":")) for t in args.thresholds.split(",")]
    if args.quick:
        args.requests, args.instances, args.mix = args.requests or 100, args.instances or 4, args.mix or "S-S"
        args.thresholds = args.thresholds[1:3:2] or args.thresholds
        args.launch_s = min(args.launch_s, 5.0)
    common.full_size(args)
    args.min_instances = 2 if args.instances >= 4 else 1
    args.low, args.high = 5.0 * args.instances / 16, 30.0 * args.instances / 16
    if args.quick:
        args.low, args.high = 2.0, 12.0
    if args.rates:
        args.low, args.high = (float(x) for x in args.rates.split(","))
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    return common.run_figure(args, args.name, "Llumnix (OSDI'24) Fig 14 and Fig 15: auto-scaling", PAPER, build_jobs,
                             run_jobs, analyse, differences, plot)


if __name__ == "__main__":
    main()
