"""``llumnixctl bench policies``: dispatch and scheduling policies on one generated trace (the paper's §6.3).

For each policy a throw-away local sim cluster starts with the same settings but ``manager.dispatch_policy``,
and the same trace (llumnixctl/experiments/traces/gen.py) is replayed against its proxy, open loop: every request is sent
at its arrival time whatever happened to the ones before it. Each request is a streamed completion with
an exact prompt length (a list of token ids) and ``max_tokens`` = its output length with ``ignore_eos``.
Per request: TTFT (sent to first token event), TPOT (mean gap per output token after the first) and
end-to-end latency; at the end, the instances' preemptions and migrations from the manager's status.
A sampler asks the manager for the requests in flight every second, to see which requests moved and
whether any went back to an instance it had left (ping-pong).

Nothing here asserts a timing; the figures depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import sys
import threading
import time
from typing import Annotated, Optional

import psutil
import typer
from rich.console import Console
from rich.table import Table

from daemons.config import ConfigError, load_config
from llumnixctl.admin import AdminClient, ManagerUnreachable
from llumnixctl.experiments.bench import serve as bench_serve, serve_figures as bench_serve_figures
from llumnixctl.experiments.bench.cluster import start_cluster
from llumnixctl.experiments.bench.budget import (DEFAULT_BUDGET_S, STOP_RESERVE_S, Budget, BudgetOpt, JsonOpt, Progress,
                                                 Units, emit, trace_prefix)
from llumnixctl.experiments.traces import gen as trace, options as traceopts
from llumnixctl.experiments.traces.gen import TraceOptions
from llumnixctl.lab import localcluster
from llumnixctl.stats import percentile
from llumnixctl.lab.scratch import scratch_dir

DEFAULT_POLICIES = "rr,infaas++,llumnix"
# What a policy's replay takes past the trace's last arrival, to cut a trace to the budget (--budget-s): a decode
# step at sim.time_scale 1 is 15-20 ms, and a cluster starts and stops in about 15 s on 2 loaded cores (a policy's
# replay of the first 53 requests, 13 s of arrivals, took 45-50 s in all at load average 3-7).
STEP_S_ESTIMATE = 0.02
POLICY_OVERHEAD_S = 15.0
MODEL = "llumnix-sim"
# The cluster every policy gets (see the command's docstring for why these values).
PRESSURE = ["sim.num_blocks=320", "sim.block_size=16", "sim.time_scale=1.0"]
QUIET = ["instance.log_level=warning", "proxy.log_level=warning", "manager.log_level=warning"]


def _dist_ms(xs: list[float]) -> dict | None:
    if not xs:
        return None
    s = bench_serve_figures.stats_ms(xs)  # numpy's, as `bench serve` (and vLLM's) figures
    return {"mean": s["mean"], "p50": s["median"], "p99": s["p99"]}


# ---------------------------------------------------------------------- the client (bench serve's replay core)


def _body(req: trace.TraceRequest) -> dict:
    return {"model": MODEL, "prompt": [100 + i % 1000 for i in range(req.prompt_tokens)],
            "max_tokens": req.output_tokens, "ignore_eos": True, "stream": True, "priority": req.priority,
            "stream_options": {"include_usage": True}}


def _replay(url: str, reqs: list[trace.TraceRequest], timeout_s: float) -> list[dict]:
    """Every request at its arrival time; per request its id, streamed tokens, error and the times (seconds
    from sending) of its first and last token events."""
    results, _ = asyncio.run(bench_serve.replay(url, reqs, _body, timeout_s=timeout_s))
    return [{"index": q.index, "priority": q.priority, "expected": q.output_tokens, "lag_s": r["lag_s"],
             "id": r["id"], "tokens": r["completion_tokens"] or 0, "error": r["error"],
             "first_s": r["times"][0] if r["times"] else None, "last_s": r["times"][-1] if r["times"] else None}
            for q, r in zip(reqs, results)]


# ---------------------------------------------------------------------- the sampler


class _Sampler(threading.Thread):
    """Every ``interval_s``: the cluster's queue and KV use, and where each request in flight runs."""

    def __init__(self, manager: str, interval_s: float = 1.0):
        super().__init__(daemon=True)
        self.manager, self.interval_s = manager, interval_s
        self.stop = threading.Event()
        self.waiting: list[int] = []
        self.kv_used: list[float] = []
        self.where: dict[str, list[str]] = {}  # request id -> the instances it was seen on, in order
        self.preempted: set[str] = set()  # request ids seen waiting after a preemption
        self.start()

    def run(self) -> None:
        admin = AdminClient(self.manager, timeout_s=2.0)
        try:
            while not self.stop.wait(self.interval_s):
                try:
                    snap, reqs = admin.status(), admin.requests()
                except ManagerUnreachable:
                    continue
                alive = [v for v in snap.instances if v.state == "alive"]
                self.waiting.append(sum(v.load.waiting for v in alive))
                total = sum(v.load.blocks_total for v in alive)
                self.kv_used.append(sum(v.load.blocks_used for v in alive) / total if total else 0.0)
                for r in reqs.requests:
                    if r.state == "preempted":
                        self.preempted.add(r.request_id)
                    seen = self.where.setdefault(r.request_id, [])
                    if not seen or seen[-1] != r.instance_id:
                        seen.append(r.instance_id)
        finally:
            admin.close()

    def moves(self) -> dict:
        moved = [s for s in self.where.values() if len(s) > 1]
        back = [s for s in moved if any(s[j] in s[:j - 1] for j in range(2, len(s)))]
        return {"moved_requests": len(moved), "moves_seen": sum(len(s) - 1 for s in moved),
                "ping_pong_requests": len(back), "most_moves": max((len(s) - 1 for s in moved), default=0)}

    def end(self) -> dict:
        self.stop.set()
        self.join(10)
        return {"waiting_mean": statistics.fmean(self.waiting) if self.waiting else None,
                "waiting_max": max(self.waiting, default=None),
                "kv_used_mean": statistics.fmean(self.kv_used) if self.kv_used else None, **self.moves()}


# ---------------------------------------------------------------------- one policy


def _cpu(p: psutil.Process) -> float:
    try:
        return sum(p.cpu_times()[:2])
    except psutil.Error:  # it exited; its time is lost, and the figure is a lower bound
        return 0.0


def _tpot(r: dict) -> float | None:
    """Mean time per output token after the first: (last token - first token) / (tokens - 1), as vLLM's."""
    if r["first_s"] is None:
        return None
    return bench_serve_figures.tpot_s({"error": r["error"], "times": [r["first_s"], r["last_s"]]}, r["tokens"])


def _summarize(results: list[dict]) -> dict:
    ok = [r for r in results if r["error"] is None]
    ttft = [r["first_s"] for r in ok if r["first_s"] is not None]
    e2e = [r["last_s"] for r in ok if r["last_s"] is not None]
    tpot = [t for t in map(_tpot, ok) if t is not None]
    return {"requests": len(results), "completed": sum(r["tokens"] == r["expected"] for r in ok),
            "errors": len(results) - len(ok), "timeouts": sum(str(r["error"]).startswith("timeout") for r in results),
            "short_streams": sum(r["tokens"] != r["expected"] for r in ok),
            "ttft_ms": _dist_ms(ttft), "tpot_ms": _dist_ms(tpot), "e2e_ms": _dist_ms(e2e)}


def run_policy(policy: str, reqs: list[trace.TraceRequest], instances: int, sets: list[str], timeout_s: float,
               up_timeout_s: float, log, per_request: bool = False) -> dict:
    run_dir = scratch_dir("llumnix-bench-pol-")
    log(f"{policy}: starting {instances} sim instances ...")
    t_up = time.perf_counter()
    state = start_cluster(run_dir, instances, "sim", sets + [f"manager.dispatch_policy={policy}"],
                          timeout_s=up_timeout_s)
    up_s = time.perf_counter() - t_up
    sampler = None
    try:
        log(f"{policy}: replaying {len(reqs)} requests over {reqs[-1].arrival_s:.0f}s ...")
        sampler = _Sampler(state.manager_address)
        procs = [psutil.Process()] + [p for p in (q.process() for q in state.procs) if p is not None]
        cpu0, t0 = [_cpu(p) for p in procs], time.perf_counter()
        results = _replay(state.url, reqs, timeout_s)
        wall = time.perf_counter() - t0
        cpu = [b - a for a, b in zip(cpu0, (_cpu(p) for p in procs))]
        sampled = sampler.end()
        time.sleep(1.0)  # the instances' last load reports reach the manager
        admin = AdminClient(state.manager_address, timeout_s=5.0)
        try:
            snap = admin.status()
        finally:
            admin.close()
    except ManagerUnreachable as exc:
        raise RuntimeError(f"{policy}: the manager did not answer after the run: {exc}") from None
    finally:
        if sampler is not None:
            sampler.end()
        localcluster.stop(state)
        shutil.rmtree(run_dir, ignore_errors=True)
    out = {"policy": policy, "up_s": up_s, "wall_s": wall, **_summarize(results)}
    if any(r.priority == "high" for r in reqs):
        out["high"] = _summarize([r for r in results if r["priority"] == "high"])
        out["normal"] = _summarize([r for r in results if r["priority"] == "normal"])
    loads = [v.load for v in snap.instances]
    out["preemptions"] = sum(ld.preemptions for ld in loads)
    out["migrations"] = {"committed": sum(ld.migrations_committed for ld in loads),
                         "aborted": sum(ld.migrations_aborted for ld in loads)}
    out["migrations"]["total"] = out["migrations"]["committed"] + out["migrations"]["aborted"]
    out["ordered_migrations"] = dict(snap.ordered_migrations)
    out["manager"] = {"dispatch_policy": snap.dispatch_policy, "pairing_policy": snap.pairing_policy,
                      "migrating": snap.migrating, "dispatched_total": snap.dispatched_total}
    out["sampled"] = sampled
    lags = [r["lag_s"] for r in results]
    # Cores busy: near the machine's count means steps wait for the CPU, not for the latency model.
    out["cpu"] = {"client_s": cpu[0], "cluster_s": sum(cpu[1:]), "busy_cores": sum(cpu) / wall,
                  "send_lag_ms_p99": percentile(lags, 99) * 1e3}
    out["first_errors"] = sorted({r["error"] for r in results if r["error"]})[:5]
    if per_request:
        out["per_request"] = [_request_row(r, sampler) for r in results]
    return out


def _request_row(r: dict, sampler: _Sampler) -> dict:
    tpot = _tpot(r)
    ms = lambda x: None if x is None else round(x * 1e3, 3)  # noqa: E731
    return {"index": r["index"], "id": r["id"], "priority": r["priority"], "tokens": r["tokens"],
            "expected": r["expected"], "error": r["error"], "ttft_ms": ms(r["first_s"]), "tpot_ms": ms(tpot),
            "e2e_ms": ms(r["last_s"]), "instances": sampler.where.get(r["id"], []),
            "preempted": r["id"] in sampler.preempted}


# ---------------------------------------------------------------------- the command


def _row(table: Table, label: str, r: dict, extra: list[str]) -> None:
    def ms(d: dict | None, key: str, scale: float = 1.0, digits: int = 0) -> str:
        return "-" if d is None else f"{d[key] / scale:.{digits}f}"

    table.add_row(label, ms(r["ttft_ms"], "mean"), ms(r["ttft_ms"], "p99"), ms(r["tpot_ms"], "mean", digits=1),
                  ms(r["tpot_ms"], "p99", digits=1), ms(r["e2e_ms"], "mean", 1e3, 2), ms(r["e2e_ms"], "p99", 1e3, 2),
                  *extra, f"{r['errors']}" + (f" ({r['short_streams']} short)" if r["short_streams"] else ""))


def print_tables(result: dict) -> None:
    console = Console(width=None if sys.stdout.isatty() else 180)  # piped: never squeeze the table
    t = result["trace"]
    arrivals = t["arrival"] if t["arrival"] == "poisson" else f"gamma cv {t['cv']:g}"
    title = (f"policies · {result['instances']} sim instances · {t['requests']} requests, {arrivals} at "
             f"{t['rate']:g}/s · {result['cores']} cores")
    table = Table(title=title)
    for col in ("policy", "TTFT ms mean", "TTFT ms P99", "TPOT ms mean", "TPOT ms P99", "E2E s mean", "E2E s P99",
                "preemptions", "migrations (aborted)", "moved / moved back", "wall s", "errors"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for name, r in result["policies"].items():
        m, s = r["migrations"], r["sampled"]
        _row(table, name, r, [str(r["preemptions"]), f"{m['committed']} ({m['aborted']})",
                              f"{s['moved_requests']} / {s['ping_pong_requests']}", f"{r['wall_s']:.0f}"])
    console.print(table)
    if any("high" in r for r in result["policies"].values()):
        hi = Table(title=f"the same runs, by priority ({t['summary']['high_priority']} high-priority requests)")
        for col in ("policy", "TTFT ms mean", "TTFT ms P99", "TPOT ms mean", "TPOT ms P99", "E2E s mean", "E2E s P99",
                    "errors"):
            hi.add_column(col, justify="left" if col == "policy" else "right")
        for name, r in result["policies"].items():
            _row(hi, f"{name} high", r["high"], [])
            _row(hi, f"{name} normal", r["normal"], [])
        console.print(hi)


# The trace this benchmark generates unless told otherwise (see the command's docstring for why).
TRACE = TraceOptions(requests=300, rate=4.0, cv=3.0, prompt_max=1024, output_max=2048)


def command(
    instances: Annotated[int, typer.Option(help="sim instances per cluster", min=1)] = 4,
    requests: traceopts.Requests = TRACE.requests, rate: traceopts.Rate = TRACE.rate,
    arrival: traceopts.Arrival = TRACE.arrival, cv: traceopts.Cv = TRACE.cv,
    prompt_min: traceopts.PromptMin = TRACE.prompt_min, prompt_max: traceopts.PromptMax = TRACE.prompt_max,
    output_min: traceopts.OutputMin = TRACE.output_min, output_max: traceopts.OutputMax = TRACE.output_max,
    alpha: traceopts.Alpha = TRACE.alpha, high_fraction: traceopts.HighFraction = TRACE.high_fraction,
    seed: traceopts.Seed = TRACE.seed,
    policies: Annotated[str, typer.Option(metavar="P,P...", help="comma-separated dispatch policies to compare")] = DEFAULT_POLICIES,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="extra setting for every cluster: section.key=value")] = None,
    request_timeout: Annotated[float, typer.Option(help="seconds a request may take before it counts as an error", min=1.0)] = 180.0,
    up_timeout: Annotated[float, typer.Option(help="seconds a cluster may take to come up", min=1.0)] = 60.0,
    per_request: Annotated[bool, typer.Option(help="with --json: every request's figures too (under per_request)")] = False,
    json_: JsonOpt = False,
    budget_s: BudgetOpt = DEFAULT_BUDGET_S,
) -> None:
    """Round-robin, INFaaS++ and Llumnix on the same generated trace: latencies, preemptions, migrations.
    A policy whose run would not fit in --budget-s is skipped (--json: skipped).

    One throw-away sim cluster per policy, with the same settings but the
    policy; the same trace replayed open loop against each. The defaults put
    4 instances under KV-memory pressure near their capacity; one policy
    takes about 2 minutes. Within the default --budget-s (240 s) on 2
    cores the trace is cut to its first requests (the policies then see
    little pressure; skipped says so): --budget-s 0 replays all of it.

    --json prints:
    {"trace": {"requests", "rate", "arrival", "cv", "prompt", "output"
      (each a two-element list: min, max), "alpha", "high_fraction", "seed",
      "summary": {...}}, "instances", "cores", "settings": [...],
     "policies": {NAME: {"policy", "up_s", "wall_s", "requests", "completed",
      "errors", "timeouts", "short_streams", "ttft_ms", "tpot_ms", "e2e_ms"
      (each {"mean", "p50", "p99"}, or null), "preemptions",
      "migrations": {"committed", "aborted", "total"},
      "ordered_migrations": {"reason/outcome": n}, "manager": {...},
      "sampled": {"waiting_mean", "waiting_max", "kv_used_mean",
      "moved_requests", "moves_seen", "ping_pong_requests", "most_moves"},
      "cpu": {"client_s", "cluster_s", "busy_cores", "send_lag_ms_p99"},
      "first_errors": [...],
      "high", "normal": the request and latency fields per priority class
      (only when the trace has high-priority requests),
      "per_request": [...] (only with --per-request)}}}
    \f
    Why the defaults (measured on 2 cores shared by the client, the proxy, the manager and 4 instances): KV
    memory, not the CPU, must be what runs out. Each instance gets 320 blocks of 16 tokens (5,120 tokens,
    about 1.7 times the longest request), so a few long requests fill it; lengths follow a power law (alpha
    1: median prompt ~130 and output ~150 tokens, means ~260 and ~360, a few near 1,000 and 2,000), so
    requests grow unevenly and an instance that admitted several long ones must preempt. sim.time_scale
    stays 1: decode steps of 15-20 ms, which the TPOT of requests never preempted matches, so steps wait
    for the latency model and not for the CPU; a smaller scale multiplies the steps and streamed tokens
    per second on the same cores. The 1,000-2,000 tokens/s streamed keep the cores about 0.7-0.8 busy
    (30% of it the client, which parses raw SSE bytes to stay cheap). 4
    requests/s is just under what the 4 instances sustain: queues form in bursts and drain, and that is
    where the policies differ most. Measured on this trace: at 3.5/s infaas++ preempts only ~25 times and
    queues ~1 request on average; at 4.5/s queues grow through the second half of the trace, every
    instance is full and queueing, no instance is free enough to take a migration, and llumnix and
    infaas++ come out alike. 300 requests arrive over ~78 s, and the longest output (~2,000 tokens,
    ~40 s) ends 100-115 s after the start; with start and stop, one policy takes about 2 minutes.
    The llumnix policy keeps its own defaults (the [scheduling] section); --set changes them.
    """
    budget = Budget(budget_s)
    err = Console(stderr=True)

    def die(msg: str, code: int = 2) -> None:
        err.print(f"llumnixctl: {msg}", markup=False)
        raise typer.Exit(code)

    names = [p.strip() for p in policies.split(",") if p.strip()]
    sets = PRESSURE + QUIET + list(set_ or [])
    try:
        cfg = load_config(None, sets)
        for name in names:
            load_config(None, sets + [f"manager.dispatch_policy={name}"])  # an unknown policy fails here
    except ConfigError as exc:
        die(str(exc))
    if not names:
        die("--policies is empty; name at least one of rr, infaas++, llumnix")
    if prompt_min > prompt_max or output_min > output_max:
        die("--prompt-min/--output-min must not exceed --prompt-max/--output-max")
    longest = prompt_max + output_max
    usable = int(cfg.sim.num_blocks * (1 - cfg.sim.watermark)) * cfg.sim.block_size
    if longest > min(cfg.model.max_model_len, usable):
        die(f"--prompt-max + --output-max = {longest} tokens does not fit one request's limit "
            f"(model.max_model_len {cfg.model.max_model_len}, KV of one instance {usable} tokens); "
            "lower them or raise the setting with --set")
    try:
        reqs = trace.generate(requests, rate=rate, arrival=arrival, cv=cv, prompt=(prompt_min, prompt_max),
                              output=(output_min, output_max), alpha=alpha, high_fraction=high_fraction, seed=seed)
    except ValueError as exc:
        die(str(exc))
    if budget.budget_s is not None and len(names) > 1:
        # Every policy replays the same trace, so that they compare: a trace they cannot all replay within the
        # budget is cut (its first requests) rather than a policy skipped.
        k = trace_prefix([r.arrival_s for r in reqs], [r.output_tokens for r in reqs], len(names),
                         budget.left() - STOP_RESERVE_S, STEP_S_ESTIMATE, POLICY_OVERHEAD_S)
        if k < len(reqs):
            budget.skip({"part": "trace", "requests": len(reqs), "run": k},
                        f"the trace cut to its first {k} of {len(reqs)} requests (arriving over "
                        f"{reqs[k - 1].arrival_s:.0f} s): {len(names)} policies replaying all of it would take about "
                        f"{len(names) * (reqs[-1].arrival_s + max(r.output_tokens for r in reqs) * STEP_S_ESTIMATE + POLICY_OVERHEAD_S):.0f} s, "
                        f"{max(0.0, budget.left()):.0f} s of the {budget.budget_s:.0f} s budget left")
            reqs = reqs[:k]
            sys.stderr.write(f"bench policies: {budget.skipped[-1]['reason']}\n")  # one line, never wrapped
    result = {"trace": {"requests": requests, "rate": rate, "arrival": arrival, "cv": cv if arrival == "gamma" else 1.0,
                        "prompt": [prompt_min, prompt_max], "output": [output_min, output_max], "alpha": alpha,
                        "high_fraction": high_fraction, "seed": seed, "summary": trace.summary(reqs)},
              "instances": instances, "cores": psutil.cpu_count(), "settings": sets, "policies": {}}
    log = lambda m: err.print(m, markup=False)  # noqa: E731
    progress = Progress(len(names), start=budget.t0)
    units = Units(budget, progress)
    for name in names:
        if not units.start({"policy": name}, f"policy {name}"):
            continue
        try:
            r = run_policy(name, reqs, instances, sets, request_timeout, up_timeout, log, per_request and json_)
        except RuntimeError as exc:
            progress.close()
            die(str(exc), 1)
        units.done()
        result["policies"][name] = r
        log(f"{name}: done in {r['wall_s']:.0f}s; {r['completed']}/{r['requests']} completed, {r['errors']} errors, "
            f"{r['preemptions']} preemptions, {r['migrations']['committed']} migrations")
    progress.close()
    result.update(budget.fields())
    emit(result, json_, print_tables, lambda s: f"policy {s['policy']}" if "policy" in s else "part of the trace")
