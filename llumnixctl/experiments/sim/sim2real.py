"""Sim-to-real: one trace through real daemons (sim instances, real time, real ZeroMQ and HTTP) and
through ``llumnixctl simulate`` with the same settings; do they agree?

    python -m llumnixctl.experiments.sim.sim2real [--instances 4] [--requests 400] [--rate 12] [--out results/sim2real.json]

The real run replays the trace open loop against a local cluster's proxy (``bench serve``'s replay), the
simulated one runs the daemons' scheduler and policy code in virtual time. The figures compared are
vLLM's (TTFT, TPOT, E2E mean and P99); ``agree`` is the issue's bar: P99 TTFT within 20%, mean within 10%.

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


def real_run(trace: list[trace_mod.TraceRequest], instances: int, sets: list[str]) -> dict:
    run_dir = scratch_dir("llumnix-sim2real-")
    try:
        state = localcluster.up(run_dir, instances, "sim", 0, None, sets, timeout_s=120)
        try:
            def body(req: trace_mod.TraceRequest) -> dict:
                return {"model": "llumnix-sim", "prompt": [10 + (req.index * 7 + i) % 30000 for i in range(req.prompt_tokens)],
                        "max_tokens": req.output_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}, "priority": req.priority}

            probe = trace_mod.generate(10, rate=2.0, prompt=(16, 16), output=(8, 8), seed=99)
            calibration, _ = asyncio.run(bench_serve.replay(state.url, probe, body, timeout_s=60, max_concurrency=1))
            results, duration = asyncio.run(bench_serve.replay(state.url, trace, body, timeout_s=600))
            res = bench_serve_figures.metrics(trace, results, duration)
            snap = AdminClient(state.manager_address, timeout_s=5).status()
            res["preemptions"] = sum(v.load.preemptions for v in snap.instances)
            res["migrations_committed"] = sum(v.load.migrations_committed for v in snap.instances)
            res["fits"] = [v.load.latency for v in snap.instances]
            res["send_lag_ms_p99"] = percentile((r["lag_s"] for r in results), 99) * 1e3
            res["calibration"] = calibrate(calibration, load_config(None, sets))
            return res
        finally:
            localcluster.stop(state)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def calibrate(probe: list[dict], cfg) -> dict:
    """This machine's fixed costs, from one request at a time (16-token prompts, 8 tokens out): the time to
    the first token beyond the modelled prefill step (HTTP, the proxy, the manager's round trip, the
    instance's sockets), and each step's time beyond the modelled decode step (the step loop's own work)."""
    import statistics

    sim = cfg.sim
    ok = [r for r in probe if r["error"] is None and len(r["times"]) >= 3]
    if not ok:
        return {"dispatch_s": 0.0, "step_s": 0.0, "probes": 0}
    prefill = sim.time_scale * (sim.prefill_ms_per_token * 16 + sim.prefill_ms) / 1e3
    decode = sim.time_scale * (sim.decode_ms_per_seq + sim.decode_ms_per_token * 20 + sim.decode_ms) / 1e3
    ttft = statistics.median(r["times"][0] for r in ok)
    step = statistics.median(b - a for r in ok for a, b in zip(r["times"][:-1], r["times"][1:-1]))
    over_step = max(0.0, step - decode)
    return {"dispatch_s": max(0.0, ttft - prefill - over_step), "step_s": over_step, "probes": len(ok)}


def compare(trace: list[trace_mod.TraceRequest], instances: int = 4, sets: list[str] | None = None,
            net: Network | None = None) -> dict:
    sets = SETS + list(sets or [])
    real = real_run(trace, instances, sets)
    logging.getLogger("llumnix").setLevel(logging.WARNING)
    cal = real["calibration"]
    cfg = load_config(None, sets)
    # The fixed cost before the instance has the request: the manager's round trip where the proxy asks it,
    # else (proxy.dispatch = local, the default) the way to the instance.
    if cfg.proxy.dispatch == "local":
        net = net or Network(dispatch_rtt_s=cal["dispatch_s"], submit_s=cal["dispatch_s"], step_overhead_s=cal["step_s"])
    else:
        net = net or Network(dispatch_rtt_s=cal["dispatch_s"], submit_s=0.0, step_overhead_s=cal["step_s"])
    simulation = Simulation(cfg, instances, trace, net)
    sim = simulation.run()
    rel = {k: (sim[k] - real[k]) / real[k] if real[k] else None for k in KEYS}
    prompts = [r.prompt_tokens for r in trace]
    sim_fits = fit_agreement([i.fit.fit() for i in simulation.instances.values()], cfg, max(prompts))
    real_fits = fit_agreement(real["fits"], cfg, max(prompts))
    agree = (rel["mean_ttft_ms"] is not None and abs(rel["mean_ttft_ms"]) <= 0.10
             and rel["p99_ttft_ms"] is not None and abs(rel["p99_ttft_ms"]) <= 0.20)
    pick = lambda d: {k: d.get(k) for k in (*KEYS, "completed", "preemptions")}  # noqa: E731
    return {"instances": instances, "settings": sets, "trace": trace_mod.summary(trace),
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
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--rate", type=float, default=12.0)
    ap.add_argument("--cv", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    trace = trace_mod.generate(args.requests, rate=args.rate, arrival="gamma" if args.cv != 1.0 else "poisson",
                               cv=args.cv, prompt=(16, 512), output=(16, 256), seed=args.seed)
    res = compare(trace, args.instances, args.sets)
    text = json.dumps(res, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    sys.stdout.write(text + "\n")
    return 0 if res["agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
