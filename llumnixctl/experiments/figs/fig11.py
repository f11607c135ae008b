"""Fig 11 of the Llumnix paper (OSDI'24): serving latency of 16 instances under llumnix, INFaaS++ and
round-robin dispatch, over the paper's length mixes and arrival processes, the request rate swept from
light to heavy load, in virtual time (``llumnixctl.experiments.sim.simulate``: the daemons' own manager, policy and sim
engine).

    python -m llumnixctl.experiments.figs.fig11 [--out results] [--quick] [--requests N] [--instances N]

-> results/fig11.json, results/fig11.png. Also the shared runner of the other figure modules
(fig12, fig16, lag): ``run_jobs`` runs simulations on every core with optional probes (preemption loss,
herding, manager wall-clock timing) that need hooks ``figs.common.run_all`` does not offer.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from collections import Counter, defaultdict
from pathlib import Path

from daemons.config import load_config
from daemons.engine import sim as sim_engine
from llumnixctl.experiments.figs.common import PAPER_LIKE, PAPER_NET, ratio, trace_summary, write
from llumnixctl.experiments.sim.simulate import Network, Simulation
from llumnixctl.experiments.traces.mix import PAPER_BOUNDS, paper_trace
from llumnixctl.stats import percentile

POLICIES = ("llumnix", "infaas++", "rr")
# The same for every policy and every point (infaas++ and rr never migrate, so only llumnix reads the
# migration settings): the project's defaults, written out so that the JSON says what ran.
COMMON_SETS = [
    "scheduling.migrate_out_threshold=6.0", "scheduling.migrate_in_threshold=8.0",
    "scheduling.migration_interval_s=0.5", "scheduling.max_migrations_per_instance=2",
]
HERD_WINDOW_S = 0.1
QUICK_BOUNDS = (1, 1024)  # --quick: short tails, so that a test's simulations end in a second


def bounds(quick: bool) -> dict:
    b = QUICK_BOUNDS if quick else PAPER_BOUNDS
    return {"prompt_bounds": b, "output_bounds": b}


# ---------------------------------------------------------------------- the shared runner and probes


class _Probed(Simulation):
    """A Simulation with wall-clock timers around the manager's decisions (Fig 16) and preemption
    bookkeeping (preemption loss); nothing in simulate.py changes."""

    timing = False

    def _start(self) -> None:
        if self.timing:
            self.wall = {"dispatch": [], "plan": []}
            self.cpu = {"dispatch": [], "plan": []}
            mgr, resched = self.mgr, self.mgr.resched
            inner_d, inner_p = mgr.on_dispatch_batch, resched.orders.plan

            def on_dispatch_batch(msgs):
                t, c = time.perf_counter(), time.thread_time()
                try:
                    return inner_d(msgs)
                finally:
                    self.wall["dispatch"].append(time.perf_counter() - t)
                    self.cpu["dispatch"].append(time.thread_time() - c)

            def plan(now, *a, **kw):
                t, c = time.perf_counter(), time.thread_time()
                try:
                    return inner_p(now, *a, **kw)
                finally:
                    self.wall["plan"].append(time.perf_counter() - t)
                    self.cpu["plan"].append(time.thread_time() - c)

            mgr.on_dispatch_batch = on_dispatch_batch
            resched.orders.plan = plan  # (its pairing loop plans through it)
        super()._start()


_CURRENT: dict = {}
_PATCHED = False  # SimEngine._preempt wrapped, once per process


def _patch_preempt() -> None:
    """Record each preemption (virtual time, tokens to recompute) of the simulation running in this process."""
    global _PATCHED
    if _PATCHED:
        return
    inner = sim_engine.SimEngine._preempt

    def _preempt(self, req):
        s = _CURRENT.get("sim")
        if s is not None:
            s.preempted_at[req.rid] = s.now
            s.recompute_tokens += req.prompt_len + req.generated
        return inner(self, req)

    sim_engine.SimEngine._preempt = _preempt
    _PATCHED = True


def _herding(dispatches: list[tuple[float, str]], n_instances: int) -> dict:
    """Herding of dispatches, by 100 ms windows of virtual time (see HERDING in the JSON)."""
    windows: dict[int, Counter] = defaultdict(Counter)
    same = 0
    for k, (t, iid) in enumerate(dispatches):
        windows[int(t / HERD_WINDOW_S)][iid] += 1
        if k and iid == dispatches[k - 1][1] and t - dispatches[k - 1][0] <= HERD_WINDOW_S:
            same += 1
    shares = [max(c.values()) / sum(c.values()) for c in windows.values() if sum(c.values()) >= 4]
    busy = [c for c in windows.values() if sum(c.values()) >= 4]
    return {
        "windows": len(shares),
        "mean_max_share": sum(shares) / len(shares) if shares else None,
        "p99_max_share": percentile(shares, 99) if shares else None,
        "ideal_max_share": None if not busy else sum(
            -(-sum(c.values()) // n_instances) / sum(c.values()) for c in busy) / len(busy),
        "same_as_previous": same / max(1, len(dispatches) - 1),
        "uniform_same_as_previous": 1 / n_instances,
    }


def run_job(job: dict) -> dict:
    import logging

    logging.getLogger("llumnix").setLevel(logging.WARNING)
    cfg = load_config(None, PAPER_LIKE + list(job.get("sets", ())))
    net = Network(**{**PAPER_NET, **job.get("net", {})})
    cls = type("Sim", (_Probed,), {"timing": bool(job.get("timing"))})
    sim = cls(cfg, job["instances"], job["trace"], net, job.get("sample_s", 0.0))
    sim.preempted_at, sim.recompute_tokens = {}, 0
    loss: list[float] = []
    dispatches: list[tuple[float, str]] = []

    def observer(kind, s, data):
        if kind == "step":
            for tok in data["outputs"]:
                t0 = s.preempted_at.pop(tok.request_id, None)
                if t0 is not None:
                    loss.append(s.now - t0)
        elif kind == "dispatch":
            dispatches.append((s.now, data["instance"]))

    sim.observe(observer)
    _patch_preempt()
    _CURRENT["sim"] = sim
    try:
        res = sim.run()
    finally:
        _CURRENT.pop("sim", None)
    res["scaling"].pop("events", None)
    res["preemption_loss"] = {
        "preemptions_resumed": len(loss),
        "total_s": sum(loss), "per_request_ms": 1e3 * sum(loss) / max(1, res["completed"]),
        "recomputed_tokens": sim.recompute_tokens,
        "recompute_s": sim.recompute_tokens * cfg.sim.prefill_ms_per_token / 1e3,
    }
    res["herding"] = _herding(dispatches, job["instances"])
    if job.get("timing"):
        res["manager_wall_s"] = dict(sim.wall)
        res["manager_cpu_s"] = dict(sim.cpu)
    return {"label": job["label"], "params": job.get("params", {}), "result": res}


def run_jobs(jobs: list[dict], processes: int | None = None) -> list[dict]:
    """Like figs.common.run_all (every core, fork), with run_job's probes."""
    n = processes or min(len(jobs), os.cpu_count() or 1)
    if n <= 1:
        return [run_job(j) for j in jobs]
    with multiprocessing.get_context("fork").Pool(n) as pool:
        return pool.map(run_job, sorted(jobs, key=lambda j: -j.get("cost", 1)), chunksize=1)


def parser(doc: str, requests: int, instances: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("results"), help="where NAME.json and NAME.png go")
    p.add_argument("--quick", action="store_true", help="a tiny version (tests): a few requests on 2 instances")
    p.add_argument("--requests", type=int, default=None, help=f"requests per simulation (default {requests})")
    p.add_argument("--instances", type=int, default=None, help=f"instances (default {instances})")
    return p


def latency(res: dict) -> dict:
    keys = ("mean_ttft_ms", "p99_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_e2el_ms",
            "p99_e2el_ms", "completed", "failed", "preemptions", "request_throughput", "wall_s")
    out = {k: res[k] for k in keys}
    out["migrations_committed"] = sum(v for k, v in res["migrations"].items() if k.endswith("/committed"))
    out["preemption_loss_per_request_ms"] = res["preemption_loss"]["per_request_ms"]
    out["recompute_s"] = res["preemption_loss"]["recompute_s"]
    return out


# ---------------------------------------------------------------------- Fig 11

# (mix, arrival, cv, rates); rates per second for 16 instances, scaled by instances / 16.
SWEEP = [
    ("M-M", "gamma", 2.0, (80, 120, 150, 190)),
    ("M-M", "poisson", 1.0, (150,)),
    ("L-L", "gamma", 2.0, (6, 7.5, 9, 12, 20, 30)),
]
SAMPLE_S = 0.1  # fragmentation samples (Fig 12 reads them from fig11.json)
QUICK = [("M-M", "gamma", 2.0, (6,))]

PAPER = {
    "source": "Llumnix (OSDI'24), Section 6.3 text and Fig 11 (16 LLaMA-7B instances on A10s; Poisson and "
              "Gamma arrivals; ShareGPT, BurstGPT and generated power-law S/M/L mixes)",
    "claims_vs_infaas++": {
        "p99_prefill_latency_lower_up_to_x": 14.8, "mean_prefill_latency_lower_up_to_x": 7.7,
        "mean_e2e_latency_lower_up_to_x": 1.5, "p99_e2e_latency_lower_up_to_x": 1.6,
        "preemption_loss_reduction_up_to": 0.70,
    },
    "unsure": [
        "the per-trace request rates of the paper's x-axes: not copied here (we do not remember them exactly); "
        "ours are chosen for our latency model, from light load to overload",
        "the decode (P99 TPOT) gains: the paper reports decode speedups too, but we do not remember their "
        "exact values, so none are given",
        "the paper's exact definition of preemption loss (we take it as the extra time preempted requests "
        "spend queued and recomputing; see preemption_loss_definition)",
        "which trace/rate each 'up to' figure comes from: the paper gives maxima over its sweep",
    ],
}


def jobs_for(sweep, n: int, instances: int, seed: int = 1, quick: bool = False) -> tuple[list[dict], dict]:
    jobs, traces = [], {}
    for mix, arrival, cv, rates in sweep:
        for r16 in rates:
            rate = r16 * instances / 16
            tr = paper_trace(mix, n, rate, arrival=arrival, cv=cv, seed=seed, **bounds(quick))
            key = f"{mix}/{arrival}{'' if arrival == 'poisson' else f'(cv={cv})'}/{rate:g}"
            traces[key] = {"mix": mix, "arrival": arrival, "cv": cv, "rate": rate, "seed": seed,
                           "length_bounds": bounds(quick)["prompt_bounds"], "summary": trace_summary(tr)}
            for pol in POLICIES:
                jobs.append({"label": f"{key}/{pol}", "instances": instances, "trace": tr,
                             "sets": COMMON_SETS + [f"manager.dispatch_policy={pol}"],
                             "params": {"point": key, "policy": pol}, "sample_s": SAMPLE_S,
                             "cost": rate * (4 if mix == "L-L" else 1)})
    return jobs, traces


def points(results: list[dict], traces: dict) -> list[dict]:
    by = defaultdict(dict)
    for r in results:
        by[r["params"]["point"]][r["params"]["policy"]] = {**latency(r["result"]),
                                                           "fragmentation": r["result"]["fragmentation"]}
    out = []
    for key, t in traces.items():
        pol = by[key]
        l, i = pol.get("llumnix"), pol.get("infaas++")
        gains = {}
        if l and i:
            for k in ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_e2el_ms", "p99_e2el_ms"):
                gains[k.replace("_ms", "") + "_x"] = ratio(l[k], i[k])
            li, ii = l["preemption_loss_per_request_ms"], i["preemption_loss_per_request_ms"]
            gains["preemption_loss_reduction"] = None if not ii else 1 - li / ii
        out.append({"point": key, **{k: t[k] for k in ("mix", "arrival", "cv", "rate")}, "policies": pol,
                    "llumnix_vs_infaas++": gains})
    return out


def summarize(pts: list[dict]) -> dict:
    def best(k):
        vals = [(p["llumnix_vs_infaas++"].get(k), p["point"]) for p in pts if p["llumnix_vs_infaas++"].get(k) is not None]
        if not vals:
            return None
        v, where = max(vals)
        return {"value": round(v, 3), "at": where}

    ours = {k: best(k) for k in ("p99_ttft_x", "mean_ttft_x", "mean_e2el_x", "p99_e2el_x", "p99_tpot_x",
                                 "preemption_loss_reduction")}
    got = (ours["p99_ttft_x"] or {}).get("value") or 0
    return {
        "ours_best_over_sweep_vs_infaas++": ours,
        "paper_vs_infaas++": PAPER["claims_vs_infaas++"],
        "goal_p99_prefill_gain_at_least_14.8x": {"met": got >= 14.8, "ours": got},
    }


DIFFERENCES = [
    "Our P99-prefill gain over INFaaS++ reaches the paper's order only in a narrow band: below the knee, "
    "P99 TTFT is set by "
    "the prefill of the longest prompts (up to 6,000 tokens, ~1.2 s in our latency model), which no "
    "scheduling shortens, and INFaaS++ (freest instance by real usage at dispatch, pending dispatches "
    "counted) already places requests well; far past the knee every policy queues for tens of seconds, so "
    "the ratio falls again (1.4-1.8x); the gain peaks (see summary) just past the knee (L-L at 7.5-9 "
    "req/s here), where INFaaS++'s queue heads wait on preemption and memory held by other instances while "
    "llumnix migrates to make room; our few rates sample that band coarsely, so the true maximum may be "
    "higher or lower than our best point.",
    "Our migration thresholds are the project's defaults (migrate_out_threshold=6, migrate_in_threshold=8 "
    "free blocks per request; not tuned), the same for every point; with them llumnix migrates little "
    "(tens of migrations per run at M-M), far less than the paper's Llumnix.",
    "Our instance is an estimated LLaMA-7B-on-A10 latency model (figs.common.PAPER_LIKE), not a measured A10: "
    "where the knee of each mix lies, and so the rates, differ from the paper's.",
    "The simulator does not model the GPU work a migration steals from the source and destination (only its "
    "copy time and the downtime), nor several migrations sharing a link: llumnix's costs are, if anything, "
    "understated.",
    "The paper's largest P99-prefill gains come from rates where INFaaS++'s instances preempt and queue behind "
    "fragmented memory while the cluster still has room; our sweep has few rates (2-core machine, ~10 min "
    "budget), so it can miss the rate of the paper's maximum; the 'up to' figures are maxima over different "
    "sweeps and are not directly comparable.",
    "Preemption loss is our approximation (virtual time from each preemption to the request's next token, "
    "i.e. requeue plus recompute), normalised per completed request; recompute_s (recomputed tokens x "
    "prefill ms per token) is given beside it.",
    "S-S and the mixed/real traces (ShareGPT, BurstGPT) are not in the sweep (time budget; no trace files "
    "offline).",
]


def plot(plt, data):
    pts = data["points"]
    groups = defaultdict(list)
    for p in pts:
        groups[(p["mix"], p["arrival"])].append(p)
    metrics = [("mean_ttft_ms", "mean prefill (TTFT) ms"), ("p99_ttft_ms", "P99 prefill ms"),
               ("mean_tpot_ms", "mean decode (TPOT) ms"), ("p99_tpot_ms", "P99 decode ms"),
               ("mean_e2el_ms", "mean end-to-end ms"), ("p99_e2el_ms", "P99 end-to-end ms"),
               ("preemption_loss_per_request_ms", "preemption loss / request ms")]
    fig, axes = plt.subplots(len(groups), len(metrics), figsize=(3.0 * len(metrics), 2.6 * len(groups)),
                             squeeze=False)
    for row, ((mix, arr), ps) in enumerate(groups.items()):
        ps.sort(key=lambda p: p["rate"])
        for col, (k, title) in enumerate(metrics):
            ax = axes[row][col]
            for pol, style in zip(POLICIES, ("o-", "s--", "^:")):
                ys = [p["policies"].get(pol, {}).get(k) for p in ps]
                ax.plot([p["rate"] for p in ps], ys, style, label=pol, ms=4)
            if k != "preemption_loss_per_request_ms" and k != "mean_tpot_ms" and k != "p99_tpot_ms":
                ax.set_yscale("log")
            ax.set_title(f"{mix} {arr}: {title}", fontsize=8)
            ax.set_xlabel("req/s", fontsize=7)
            ax.tick_params(labelsize=6)
            if row == 0 and col == 0:
                ax.legend(fontsize=6)
    fig.suptitle(f"Fig 11 (simulated, {data['run']['instances']} instances)", fontsize=10)
    fig.tight_layout()


def main(argv: list[str] | None = None) -> dict:
    args = parser(__doc__, 2000, 16).parse_args(argv)
    n = args.requests or (30 if args.quick else 2000)
    instances = args.instances or (2 if args.quick else 16)
    sweep = QUICK if args.quick else SWEEP
    t0 = time.perf_counter()
    jobs, traces = jobs_for(sweep, n, instances, quick=args.quick)
    results = run_jobs(jobs)
    pts = points(results, traces)
    data = {
        "figure": "fig11",
        "what": "Fig 11: prefill (TTFT), decode (TPOT) and end-to-end latency, mean and P99, and preemption "
                "loss; llumnix vs infaas++ vs rr; rate swept light to heavy",
        "run": {"instances": instances, "requests_per_simulation": n, "quick": args.quick,
                "settings": PAPER_LIKE + COMMON_SETS, "per_policy": {p: f"manager.dispatch_policy={p}" for p in POLICIES},
                "network": PAPER_NET, "traces": traces, "seeds": [1],
                "rates_note": "rates are for 16 instances and scale with --instances; the L-L rates 6, 7.5 and 9 "
                              "were added after a first sweep (12-30) showed every policy overloaded there: "
                              "the settings are the same at every point",
                "wall_s": time.perf_counter() - t0, "cores": os.cpu_count()},
        "preemption_loss_definition": "ours: for each preemption, the virtual time from the preemption to the "
                                      "request's next token (requeue + recompute), summed and divided by completed "
                                      "requests; recompute_s: recomputed tokens x sim.prefill_ms_per_token",
        "points": pts,
        "summary": summarize(pts),
        "paper": PAPER,
        "differences": DIFFERENCES,
    }
    write(args.out, "fig11", data, plot)
    s = data["summary"]["ours_best_over_sweep_vs_infaas++"]
    print(f"fig11: best over the sweep vs infaas++: {s}; wall {data['run']['wall_s']:.0f} s")
    return data


if __name__ == "__main__":
    main()
