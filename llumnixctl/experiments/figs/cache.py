"""Cache-aware dispatch in a fleet (issue #24), in the virtual-time simulator with prefix caching on
(``sim.prefix_caching``) on the paper-like instance of ``common.PAPER_LIKE``:

- ``fleet``: 16 and 64 instances, a shared-prefix trace (system prompts that together need about twice
  one instance's KV, zipf popularity) and a multi-turn trace (sessions resend their history), a sweep of
  request rates per instance; llumnix-cache vs llumnix vs infaas++, and oracle-cache (each request to the
  instance whose cache really holds most of its prompt) for the hit rate nothing placing by cache can
  beat by much. P99 TTFT, prefix hit rates; the knee is the lowest rate where plain llumnix's P99 TTFT is
  at least twice its lightest-load value.
- ``sweep``: never worse on unique prompts: 16 instances, the paper's L-L mix with gamma arrivals of CV 3,
  from light load to deep overload; llumnix-cache and llumnix against infaas++.
- ``hotspot``: one system prompt is 80% of the traffic: P99 TTFT and the largest share of the running
  requests any one instance held (sampled every second).

    python -m llumnixctl.experiments.figs.cache [--out results/] [--quick] [--parts fleet,sweep,hotspot]

Writes results/cache-fleet.json (and .png). With --quick: fewer requests and rates, 16 instances (tests).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from llumnixctl.experiments.traces import cache as tracecache
from llumnixctl.experiments.figs import common
from llumnixctl.experiments.traces.mix import paper_trace
from llumnixctl.stats import percentile

POLICIES = ("llumnix-cache", "llumnix", "infaas++", "oracle-cache")
KV_TOKENS = 1150 * 16  # one PAPER_LIKE instance's KV cache
PREFIX_TOKENS = 384
PREFIXES = 2 * KV_TOKENS // PREFIX_TOKENS  # their prompts need twice one instance's KV


def trace_of(kind: str, n: int, rate: float, seed: int, hot: float = 0.0):
    if kind == "shared-prefix":
        return tracecache.shared_prefix(n, rate=rate, prefixes=PREFIXES, prefix_tokens=PREFIX_TOKENS, skew=1.0,
                                        hot=hot, suffix=(16, 128), output=(16, 256), seed=seed)
    if kind == "multi-turn":
        return tracecache.multi_turn(n, rate=rate, turns=(2, 8), system_prompts=16, system_tokens=256,
                                     message=(16, 128), reply=(16, 256), think=5.0, max_context=4096, seed=seed)
    if kind == "unique":
        return paper_trace("L-L", n, rate, arrival="gamma", cv=3.0, seed=seed)
    raise ValueError(kind)


def job(label: str, instances: int, trace, policy: str, params: dict, sample_s: float = 0.0) -> dict:
    sets = ["sim.prefix_caching=true",
            f"manager.dispatch_policy={'llumnix' if policy == 'oracle-cache' else policy}"]
    return {"label": label, "instances": instances, "trace": trace, "sets": sets, "oracle": policy == "oracle-cache",
            "params": {**params, "policy": policy, "instances": instances}, "sample_s": sample_s}


class Shares:
    """The largest share of the cluster's running requests on one instance, at each sample."""

    def __init__(self):
        self.worst = 0.0
        self.samples = []

    def __call__(self, kind, sim, data) -> None:
        if kind != "sample":
            return
        running = [ld.running for ld in data["loads"]]
        total = sum(running)
        if total >= 8:  # a share of a handful says nothing
            share = max(running) / total
            self.samples.append(share)
            self.worst = max(self.worst, share)

    def collect(self, sim) -> dict:
        xs = sorted(self.samples)
        return {"max_running_share": round(self.worst, 3),
                "p99_running_share": round(percentile(xs, 99), 3) if xs else None}


def build(args) -> list[dict]:
    jobs = []
    parts = set(args.parts.split(","))
    if "fleet" in parts:
        for n in args.fleet:
            for kind in ("shared-prefix", "multi-turn"):
                for per in args.rates if kind == "shared-prefix" else args.mt_rates:
                    trace = trace_of(kind, args.requests * n // 16 // (2 if n > 16 else 1), per * n, args.seed)
                    for pol in POLICIES:
                        jobs.append(job(f"fleet n={n} {kind} rate/inst={per:g} {pol}", n, trace, pol,
                                        {"part": "fleet", "trace": kind, "rate_per_instance": per}))
    if "sweep" in parts:
        for per in args.sweep_rates:
            trace = trace_of("unique", args.requests, per * 16, args.seed)
            for pol in ("llumnix-cache", "llumnix", "infaas++"):
                jobs.append(job(f"sweep rate/inst={per:g} {pol}", 16, trace, pol,
                                {"part": "sweep", "trace": "unique L-L cv3", "rate_per_instance": per}))
    if "hotspot" in parts:
        for per in args.hot_rates:
            trace = trace_of("shared-prefix", args.requests, per * 16, args.seed, hot=0.8)
            for pol in ("llumnix-cache", "llumnix", "infaas++", "oracle-cache"):
                jobs.append(job(f"hotspot rate/inst={per:g} {pol}", 16, trace, pol,
                                {"part": "hotspot", "trace": "shared-prefix hot=0.8", "rate_per_instance": per},
                                sample_s=1.0))
    return jobs


def run_one(j: dict) -> dict:
    import logging

    from daemons.config import load_config
    from llumnixctl.experiments.sim.simulate import Network, Simulation

    logging.getLogger("llumnix").setLevel(logging.WARNING)
    cfg = load_config(None, common.PAPER_LIKE + j["sets"])
    sim = Simulation(cfg, j["instances"], j["trace"], Network(**common.PAPER_NET), j["sample_s"], j["oracle"])
    shares = Shares() if j["sample_s"] else None
    if shares is not None:
        sim.observe(shares)
    res = sim.run()
    row = {k: res[k] for k in ("completed", "failed", "preemptions", "leaked_blocks", "wall_s")}
    row.update({k: round(res[k], 1) for k in ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms")})
    row["prefix_hit_rate"] = round(res.get("prefix_hit_rate", 0.0), 4)
    row["migrations_committed"] = sum(v for k, v in res["migrations"].items() if k.endswith("/committed"))
    if shares is not None:
        row.update(shares.collect(sim))
    return {"label": j["label"], "params": j["params"], "result": row}


def analyse(rows: list[dict]) -> dict:
    by = {}
    for r in rows:
        p = r["params"]
        by.setdefault((p["part"], p.get("instances"), p["trace"]), {}).setdefault(p["rate_per_instance"], {})[
            p["policy"]] = r["result"]
    out = {}
    for (part, n, kind), rates in sorted(by.items(), key=lambda x: str(x[0])):
        key = f"{part} n={n} {kind}"
        table = []
        light = None
        knee = None
        for per in sorted(rates):
            pols = rates[per]
            ll = pols.get("llumnix", {}).get("p99_ttft_ms")
            light = light if light is not None else ll
            entry = {"rate_per_instance": per,
                     "p99_ttft_ms": {pol: v["p99_ttft_ms"] for pol, v in pols.items()},
                     "hit_rate": {pol: v["prefix_hit_rate"] for pol, v in pols.items()},
                     "failed": {pol: v["failed"] for pol, v in pols.items()}}
            if "llumnix-cache" in pols:
                c = pols["llumnix-cache"]["p99_ttft_ms"]
                entry["cache_vs_llumnix_p99"] = common.ratio(c, ll)  # how many times lower
                if "infaas++" in pols:
                    entry["infaas_over_llumnix_cache"] = round(pols["infaas++"]["p99_ttft_ms"] / c, 3) if c else None
                    entry["infaas_over_llumnix"] = round(pols["infaas++"]["p99_ttft_ms"] / ll, 3) if ll else None
                if "oracle-cache" in pols:
                    entry["hit_gap_to_oracle_points"] = round(
                        100 * (pols["oracle-cache"]["prefix_hit_rate"] - pols["llumnix-cache"]["prefix_hit_rate"]), 1)
            if "max_running_share" in next(iter(pols.values())):
                entry["max_running_share"] = {pol: v["max_running_share"] for pol, v in pols.items()}
            if knee is None and ll is not None and light and ll >= 2 * light:
                knee = per
                entry["knee"] = True
            table.append(entry)
        out[key] = {"knee_rate_per_instance": knee, "points": table}
    return out


def plot(plt, data: dict) -> None:
    fleet = {k: v for k, v in data["analysis"].items() if k.startswith("fleet")}
    keys = list(fleet) + [k for k in data["analysis"] if not k.startswith("fleet")]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys):
        pts = data["analysis"][key]["points"]
        xs = [p["rate_per_instance"] for p in pts]
        for pol in POLICIES:
            ys = [p["p99_ttft_ms"].get(pol) for p in pts]
            if any(y is not None for y in ys):
                ax.plot(xs, [y / 1e3 if y is not None else None for y in ys], marker="o", label=pol)
        ax.set_yscale("log")
        ax.set_title(key, fontsize=8)
        ax.set_xlabel("requests/s per instance")
        ax.set_ylabel("P99 TTFT (s)")
    axes[0][0].legend(fontsize=7)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--parts", default="fleet,sweep,hotspot")
    ap.add_argument("--requests", type=int, default=None, help="requests per trace at 16 instances (scaled with n)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fleet", default=None, help="instance counts of the fleet part, e.g. 16,64")
    ap.add_argument("--rates", default=None, help="fleet, shared-prefix: requests/s per instance, e.g. 2,5,8")
    ap.add_argument("--mt-rates", default=None, help="fleet, multi-turn: requests/s per instance (nominal)")
    args = ap.parse_args(argv)
    fleet, rates, mt_rates = args.fleet, args.rates, args.mt_rates
    if args.quick:
        args.requests = args.requests or 300
        args.fleet, args.rates, args.sweep_rates, args.hot_rates = [16], [5.0], [2.0], [6.0]
        args.mt_rates = [5.0]
    else:
        args.requests = args.requests or 3000
        args.fleet, args.rates = [16, 64], [2.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0]
        args.mt_rates = [4.0, 8.0, 12.0, 14.0, 16.0, 18.0, 20.0]
        args.sweep_rates = [0.25, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.5, 2.0, 3.0, 4.0]
        args.hot_rates = [4.0, 6.0, 7.0, 8.0, 10.0]
    if fleet:
        args.fleet = [int(x) for x in fleet.split(",")]
    if rates:
        args.rates = [float(x) for x in rates.split(",")]
    if mt_rates:
        args.mt_rates = [float(x) for x in mt_rates.split(",")]
    jobs = build(args)
    t0 = time.perf_counter()
    import multiprocessing
    import os

    with multiprocessing.get_context("fork").Pool(min(len(jobs), os.cpu_count() or 1)) as pool:
        rows = pool.map(run_one, sorted(jobs, key=lambda j: -j["instances"] * len(j["trace"])), chunksize=1)
    data = {"setup": {"settings": common.PAPER_LIKE + ["sim.prefix_caching=true"], "net": common.PAPER_NET,
                      "requests_at_16": args.requests, "seed": args.seed, "prefixes": PREFIXES,
                      "prefix_tokens": PREFIX_TOKENS, "kv_tokens_per_instance": KV_TOKENS, "quick": args.quick},
            "analysis": analyse(rows), "runs": rows, "wall_s": round(time.perf_counter() - t0, 1)}
    for path in common.write(args.out, "cache-fleet", data, plot):
        print(path)


if __name__ == "__main__":
    main()
