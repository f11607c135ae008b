"""Sim-to-real: one trace through real daemons (sim instances, real time, real ZeroMQ and HTTP) and
through ``llumnixctl simulate`` with the same settings; do they agree?

    python -m llumnixctl.experiments.sim.sim2real [--instances 4] [--requests 400] [--rate 12] [--out results/sim2real.json]

The real run replays the trace open loop against a local cluster's proxy (``bench serve``'s replay), the
simulated one runs the daemons' scheduler and policy code in virtual time. The figures compared are
vLLM's (TTFT, TPOT, E2E mean and P99); ``agree`` is the issue's bar: P99 TTFT within 20%, mean within 10%.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import sys
import tempfile
from pathlib import Path

from daemons.config import load_config
from llumnixctl.admin import AdminClient
from llumnixctl.experiments.bench import serve as bench_serve, serve_figures as bench_serve_figures
from llumnixctl.experiments.traces import gen as trace_mod
from llumnixctl.experiments.sim.simulate import Network, simulate
from llumnixctl.lab import localcluster
from llumnixctl.stats import percentile

KEYS = ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_e2el_ms", "p99_e2el_ms")
SETS = ["instance.log_level=warning", "proxy.log_level=warning", "manager.log_level=warning",
        "proxy.access_log=false"]


def real_run(trace: list[trace_mod.TraceRequest], instances: int, sets: list[str]) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="llumnix-sim2real-"))
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
    sim = simulate(cfg, instances, trace, net)
    rel = {k: (sim[k] - real[k]) / real[k] if real[k] else None for k in KEYS}
    agree = (rel["mean_ttft_ms"] is not None and abs(rel["mean_ttft_ms"]) <= 0.10
             and rel["p99_ttft_ms"] is not None and abs(rel["p99_ttft_ms"]) <= 0.20)
    pick = lambda d: {k: d.get(k) for k in (*KEYS, "completed", "preemptions")}  # noqa: E731
    return {"instances": instances, "settings": sets, "trace": trace_mod.summary(trace),
            "calibration": cal,
            "real": {**pick(real), "migrations_committed": real["migrations_committed"],
                     "send_lag_ms_p99": real["send_lag_ms_p99"], "failed": real["failed"]},
            "simulated": {**pick(sim), "migrations": sim["migrations"], "wall_s": sim["wall_s"]},
            "relative_difference": rel, "agree": agree,
            "bar": "P99 TTFT within 20%, mean TTFT within 10% (issue #10)"}


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
