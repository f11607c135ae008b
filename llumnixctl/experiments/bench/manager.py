"""``llumnixctl bench manager``: the real llumnix-manager against many emulated instances.

For each instance count the real ``llumnix-manager`` runs as a subprocess (``python -m daemons.manager``),
and a few emulator processes each hold one ZeroMQ DEALER per emulated instance (its own identity), all
served by one ``zmq.Poller``. An emulated instance registers as a real one does (daemons/instance/
``register_msg``), sends a LoadReport every ``manager.heartbeat_interval_s`` (staggered) and, like a
real instance whose load changed, one more soon after it was dispatched requests (their count is its
``requests_received``, which retires the manager's dispatch estimates). Loads vary: a quarter of the
instances are loaded below ``scheduling.migrate_out_threshold``, a quarter nearly free, the rest in
between, redrawn at every report, so that every pairing round has pairs to order. A MigrateStart is
answered at once with a MigrateResult with no outcome (the source found nothing worth moving), a
ListRequests with an empty RequestList.

Then, per dispatch rate, a client process sends Dispatch queries open loop on one DEALER (as the
proxy does, daemons/proxy/cluster/client.py): every millisecond, the ones due by then, whatever came back. Per
dispatch, the round trip from its send to its DispatchReply; the achieved rate; the manager's CPU (and
the emulators' and the client's: they share the machine). The manager's
``llumnix_manager_pairing_round_seconds`` histogram, scraped from its /metrics before and after each
phase, gives the pairing rounds of the phase (mean exact; p99 and max from the bucket bounds).

Nothing here asserts a timing; the figures depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Annotated, Optional

import psutil
import typer
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from daemons import wire
from llumnixctl.admin import AdminClient, ManagerUnreachable
from llumnixctl.experiments.bench.budget import (DEFAULT_BUDGET_S, STOP_RESERVE_S, Budget, BudgetOpt, JsonOpt, Progress,
                                                 estimate, skipped_lines)
from llumnixctl.experiments.bench.manager_peers import MODEL, emulated_load
from llumnixctl.lab.localcluster import free_port
from llumnixctl.lab.procs import stop
from llumnixctl.lab.scratch import keep, scratch_dir

PER_EMULATOR = 400  # emulated instances per emulator process
HISTOGRAM = "llumnix_manager_pairing_round_seconds"


# ---------------------------------------------------------------------- orchestration


def _spawn(argv: list[str], log: Path, procs: list[subprocess.Popen]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "LLUMNIX_CONFIG"}  # the bench's settings only
    with open(log, "ab") as f:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)
    procs.append(p)
    return p


    procs.clear()


def _scrape(port: int) -> tuple[dict[float, float], float, float, dict[str, float]]:
    """The pairing histogram (cumulative buckets by bound, sum, count) and a few counters."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    buckets: dict[float, float] = {}
    total = count = 0.0
    counters: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == HISTOGRAM + "_bucket":
                buckets[float(s.labels["le"])] = s.value
            elif s.name == HISTOGRAM + "_sum":
                total = s.value
            elif s.name == HISTOGRAM + "_count":
                count = s.value
            elif s.name in ("llumnix_manager_instance_deaths_total", "llumnix_manager_dispatch_failures_total"):
                counters[s.name] = counters.get(s.name, 0.0) + s.value
    return buckets, total, count, counters


def _rounds(before, after) -> dict:
    """Pairing rounds between two scrapes: count, mean (exact), p99 (interpolated in its bucket, as
    Prometheus's histogram_quantile) and the upper bound of the highest bucket any round fell in."""
    b0, s0, c0, _ = before
    b1, s1, c1, _ = after
    n = c1 - c0
    out = {"count": int(n), "mean_ms": None, "p99_ms": None, "max_ms_le": None}
    if n <= 0:
        return out
    out["mean_ms"] = round((s1 - s0) / n * 1e3, 4)
    bounds = sorted(b1)
    cum = [b1[b] - b0.get(b, 0.0) for b in bounds]
    rank = 0.99 * n
    prev_b, prev_c = 0.0, 0.0
    for b, c in zip(bounds, cum):
        if c >= rank:
            if math.isinf(b):
                out["p99_ms"] = round(prev_b * 1e3, 4)
            else:
                frac = (rank - prev_c) / (c - prev_c) if c > prev_c else 1.0
                out["p99_ms"] = round((prev_b + (b - prev_b) * frac) * 1e3, 4)
            break
        prev_b, prev_c = b, c
    prev_c = 0.0
    for b, c in zip(bounds, cum):
        if c > prev_c:
            out["max_ms_le"] = b * 1e3 if not math.isinf(b) else None
        prev_c = c
    return out


def service_times(n: int, sets: list[str]) -> dict:
    """The manager's own code in this process, no sockets: median microseconds per call of its dispatch
    (a batch of 1 and of 10 queries), a load report and a pairing round, with ``n`` instances registered
    (the emulated loads, no dispatch estimates retired). What one query costs it however idle the machine."""
    import asyncio

    from daemons.config import load_config
    from daemons.manager import Manager

    async def measure() -> dict:
        m = Manager(load_config(None, ["manager.log_level=warning", *sets]))
        try:
            rng = random.Random(0)
            ids = [f"e{k:04d}" for k in range(n)]
            for k, iid in enumerate(ids):
                m.on_register(f"emu-{iid}".encode(), wire.Register(
                    iid, "emulated", 1, f"inproc://emulated-{iid}", "emulated", MODEL, emulated_load(rng, k % 4, 0),
                    uptime_s=60.0))
            reps = max(5, min(200, 20_000 // n))
            q = iter(range(10**9))

            def median_us(f, k: int = reps) -> float:
                ts = []
                for _ in range(k):
                    t = time.perf_counter()
                    f()
                    ts.append(time.perf_counter() - t)
                return round(statistics.median(ts) * 1e6, 1)

            def pair() -> None:
                m.resched.pair_once()
                for t in list(m._tasks):  # the orders it spawned: nobody answers them here
                    t.cancel()

            out = {
                "dispatch_1": median_us(lambda: m.on_dispatch_batch([wire.Dispatch(next(q), "r", 500)])),
                "dispatch_10": median_us(lambda: m.on_dispatch_batch([wire.Dispatch(next(q), "r", 500)
                                                                      for _ in range(10)]), max(3, reps // 4)),
                "report": median_us(lambda: m.on_report(b"x", wire.LoadReport(
                    ids[next(q) % n], 1, emulated_load(rng, next(q) % 4, 0)))),
                "pairing_round": median_us(pair, max(3, reps // 4)),
            }
            await asyncio.sleep(0)
            return out
        finally:
            m.ctx.destroy(linger=0)

    return asyncio.run(measure())


def _cpu(ps: list[psutil.Process]) -> float:
    total = 0.0
    for p in ps:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _wait_for(pred, timeout_s: float, what: str, alive: list[subprocess.Popen]):
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got:
            return got
        for p in alive:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: a process it needs exited (pid {p.pid}, status {p.returncode})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout_s:g}s")
        time.sleep(0.2)


def run(instances: list[int], rates: list[int], seconds: float, heartbeat_s: float, sets: list[str],
        up_timeout_s: float = 60.0, log_dir: Path | None = None, echo=lambda s: None, profile: str = "",
        budget: Budget | None = None, progress: Progress | None = None) -> dict:
    """The whole benchmark; every process it starts is stopped (by pid) before it returns or raises.
    ``budget``: an instance count whose estimate (from the counts measured before, ``budget.estimate``) does
    not fit in what is left is skipped (``skipped``)."""
    budget = budget or Budget(None)
    progress = progress or Progress(len(instances), heartbeat_s=None)
    measured: list[tuple[int, float]] = []
    work = scratch_dir("llumnix-bench-manager-")
    log_dir = log_dir or work
    procs: list[subprocess.Popen] = []
    started: list[int] = []
    out = {"cores": os.cpu_count(), "seconds": seconds, "heartbeat_s": heartbeat_s, "settings": sets,
           "emulated_per_process": PER_EMULATOR, "runs": []}
    py = sys.executable
    try:
        for n in instances:
            if not budget.consider({"instances": n}, estimate(measured, n), STOP_RESERVE_S):
                progress.skipped(f"{n} instances", budget.skipped[-1]["reason"])
                continue
            progress.step(f"{n} instances")
            t_n = time.monotonic()
            service = service_times(n, sets)
            port, mport = free_port(), free_port()
            address = f"tcp://127.0.0.1:{port}"
            settings = [f"manager.address={address}", "manager.bind=", f"manager.metrics_port={mport}",
                        "manager.log_level=warning", f"manager.heartbeat_interval_s={heartbeat_s}",
                        f"model.name={MODEL}", *sets]
            prof = ["-m", "cProfile", "-o", f"{profile}.{n}"] if profile else []  # written when it stops
            mgr = _spawn([py, *prof, "-m", "daemons.manager", *[a for s in settings for a in ("--set", s)]],
                         log_dir / f"manager-{n}.log", procs)
            started.append(mgr.pid)
            admin = AdminClient(address, timeout_s=2.0)
            try:
                def status():
                    try:
                        return admin.status()
                    except ManagerUnreachable:
                        return None

                _wait_for(status, up_timeout_s, "llumnix-manager answering", [mgr])
                ids = [f"e{k:04d}" for k in range(n)]
                chunks = [ids[j:j + PER_EMULATOR] for j in range(0, n, PER_EMULATOR)]
                feeds, emus, emu_out, owner = [], [], [], {}
                for e, chunk in enumerate(chunks):
                    feed = f"tcp://127.0.0.1:{free_port()}"
                    spec = {"ids": chunk, "first": e * PER_EMULATOR, "manager": address, "feed": feed,
                            "heartbeat_s": heartbeat_s, "min_interval_s": 0.02,
                            "max_s": up_timeout_s + len(rates) * (seconds + 30) + 30,
                            "out": str(work / f"emu-{n}-{e}.json")}
                    p = _spawn([py, "-m", "llumnixctl.experiments.bench.manager_peers", "emulate", json.dumps(spec)],
                               log_dir / f"emulator-{n}-{e}.log", procs)
                    started.append(p.pid)
                    emus.append(p)
                    emu_out.append(Path(spec["out"]))
                    feeds.append(feed)
                    owner.update({iid: e for iid in chunk})
                t_up = time.monotonic()

                def all_alive():
                    s = status()
                    return s if s and sum(1 for v in s.instances if v.state == "alive") == n else None

                snap = _wait_for(all_alive, up_timeout_s, f"{n} emulated instances registered", [mgr, *emus])
                run_n = {"instances": n, "registered": len(snap.instances), "emulators": len(emus),
                         "register_s": round(time.monotonic() - t_up, 2), "service_us": service, "phases": []}
                echo(f"{n} instances registered in {run_n['register_s']}s")
                pm, pe = psutil.Process(mgr.pid), [psutil.Process(p.pid) for p in emus]
                c0, t0 = _cpu([pm]), time.monotonic()
                time.sleep(max(1.0, 2 * heartbeat_s))  # a few report rounds before the first phase
                run_n["idle_manager_cpu_percent"] = round(100 * (_cpu([pm]) - c0) / (time.monotonic() - t0), 1)
                for rate in rates:
                    progress.update(f"{n} instances, {rate}/s")
                    before = _scrape(mport)
                    c_mgr, c_emu, t0 = _cpu([pm]), _cpu(pe), time.monotonic()
                    spec = {"manager": address, "rate": rate, "seconds": seconds, "grace_s": 5.0, "feeds": feeds,
                            "owner": owner, "out": str(work / f"client-{n}-{rate}.json")}
                    cl = _spawn([py, "-m", "llumnixctl.experiments.bench.manager_peers", "client", json.dumps(spec)],
                                log_dir / f"client-{n}-{rate}.log", procs)
                    started.append(cl.pid)
                    try:
                        cl.wait(seconds + 60)
                    except subprocess.TimeoutExpired:
                        raise RuntimeError(f"the dispatch client at {rate}/s did not finish") from None
                    finally:
                        procs.remove(cl) if cl.returncode is not None else None
                    wall = time.monotonic() - t0
                    c_mgr, c_emu = _cpu([pm]) - c_mgr, _cpu(pe) - c_emu
                    after = _scrape(mport)
                    res = json.loads(Path(spec["out"]).read_text())
                    deaths = after[3].get("llumnix_manager_instance_deaths_total", 0) - \
                        before[3].get("llumnix_manager_instance_deaths_total", 0)
                    phase = {**res, "pairing_round": _rounds(before, after),
                             "manager_cpu_percent": round(100 * c_mgr / wall, 1),
                             "manager_cpu_s": round(c_mgr, 3),
                             "emulators_cpu_percent": round(100 * c_emu / wall, 1),
                             "instance_deaths": int(deaths)}
                    # Whatever the manager still has queued (a saturated phase) is not the next phase's:
                    # wait until a status query, queued behind it all, is answered.
                    t_drain = time.monotonic()
                    try:
                        _wait_for(status, 120.0, "llumnix-manager catching up after a phase", [mgr, *emus])
                        phase["catch_up_s"] = round(time.monotonic() - t_drain, 2)
                    except RuntimeError:
                        if mgr.poll() is not None:
                            raise
                        phase["catch_up_s"] = None  # still behind after 120s: the next phase starts behind
                    run_n["phases"].append(phase)
                    echo(f"{n} instances, {rate}/s: p50 {phase['latency_ms']['p50']} ms, p99 "
                         f"{phase['latency_ms']['p99']} ms, achieved {phase['achieved_rate']}/s")
                snap = status()
                run_n["alive_at_end"] = sum(1 for v in snap.instances if v.state == "alive") if snap else None
                run_n["dispatched_total"] = snap.dispatched_total if snap else None
            finally:
                admin.close()
                stop(procs)
            emu_stats: dict[str, int] = {}
            for f in emu_out:
                try:
                    for k, v in json.loads(f.read_text()).items():
                        emu_stats[k] = emu_stats.get(k, 0) + v
                except (OSError, ValueError):
                    pass
            run_n["emulated"] = emu_stats
            out["runs"].append(run_n)
            measured.append((n, time.monotonic() - t_n))
    except RuntimeError as exc:
        keep(log_dir)
        raise RuntimeError(f"{exc} (logs in {log_dir})") from None
    except Exception:  # a client that died without its output: its log says why
        keep(log_dir)
        raise
    else:
        if log_dir == work:
            shutil.rmtree(work, ignore_errors=True)
    finally:
        stop(procs)
        out["pids"] = started
        out.update(budget.fields())
    return out


# ---------------------------------------------------------------------- the command


def _ints(text: str, what: str) -> list[int]:
    try:
        xs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"{what}: comma-separated whole numbers, e.g. 64,256") from None
    if not xs or min(xs) < 1:
        raise typer.BadParameter(f"{what}: at least one, each 1 or more")
    return xs


def command(
    instances: Annotated[str, typer.Option(metavar="N,N...", help="comma-separated emulated instance counts")] = "64,256,1000",
    rates: Annotated[str, typer.Option(metavar="R,R...", help="comma-separated dispatch rates, queries/s")] = "1000,10000",
    seconds: Annotated[float, typer.Option(help="seconds of dispatching per rate", min=0.5)] = 5.0,
    heartbeat: Annotated[float, typer.Option(help="manager.heartbeat_interval_s (every instance's report interval)", min=0.05)] = 0.5,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="extra manager setting: section.key=value")] = None,
    up_timeout: Annotated[float, typer.Option(help="seconds the manager and the instances may take to come up", min=1.0)] = 60.0,
    profile: Annotated[str, typer.Option(metavar="FILE", help="run the manager under cProfile: stats to FILE.N per instance count")] = "",
    json_: JsonOpt = False,
    budget_s: BudgetOpt = DEFAULT_BUDGET_S,
) -> None:
    """The real llumnix-manager against emulated instances over ZeroMQ: dispatch latency, pairing rounds.

    For each instance count, the manager starts as a subprocess and emulator
    processes register that many instances, which report varying loads every
    heartbeat (and after they were dispatched to) and decline every
    migration order at once. For each rate, a client sends Dispatch queries
    open loop for --seconds and times each one's round trip.

    --json prints {"cores", "seconds", "heartbeat_s", "settings", "runs": [{
    "instances", "registered", "emulators", "register_s", "service_us":
    {"dispatch_1", "dispatch_10", "report", "pairing_round"},
    "idle_manager_cpu_percent", "alive_at_end", "dispatched_total", "emulated": {"registers", "reports",
    "migrate_starts", ...}, "phases": [{"rate", "sent", "answered",
    "no_instance", "unanswered", "achieved_rate", "answered_rate",
    "latency_ms" and "send_lag_ms": {"mean", "p50", "p99", "p999", "max"},
    "pairing_round": {"count", "mean_ms", "p99_ms", "max_ms_le"},
    "manager_cpu_percent", "manager_cpu_s", "emulators_cpu_percent",
    "client_cpu_percent", "instance_deaths", "catch_up_s"}]}], "pids",
    "budget_s", "skipped": [{"instances", "reason"}]}.

    Instance counts run in the order given; one whose estimate (from the counts run before it) does not fit in
    what is left of --budget-s is skipped.
    """
    budget = Budget(budget_s)
    ns, rs = _ints(instances, "--instances"), _ints(rates, "--rates")
    console = Console(stderr=json_)
    try:
        with Progress(len(ns), start=budget.t0) as progress:
            data = run(ns, rs, seconds, heartbeat, list(set_ or []), up_timeout,
                       echo=lambda s: console.print(f"[dim]{s}[/dim]"), profile=profile, budget=budget,
                       progress=progress)
    except RuntimeError as exc:
        console.print(f"[red]bench manager: {exc}[/red]")
        raise typer.Exit(1) from None
    if json_:
        print(json.dumps(data, indent=1))
        return
    table = Table(title=f"llumnix-manager with emulated instances ({data['cores']} cores, {seconds:g}s per rate; "
                        "dispatch round trips and pairing rounds in ms; CPU of the manager and of the rest, %)")
    for col in ("inst", "rate", "sent/s", "answered", "p50", "p99", "max", "rounds", "round", "rnd p99", "mgr",
                "rest"):
        table.add_column(col, justify="right")
    for r in data["runs"]:
        for p in r["phases"]:
            lat, pr = p["latency_ms"], p["pairing_round"]
            table.add_row(str(r["instances"]), str(p["rate"]), f"{p['achieved_rate']:.0f}",
                          f"{p['answered']}/{p['sent']}", f"{lat['p50']:.3f}", f"{lat['p99']:.3f}",
                          f"{lat['max']:.1f}", str(pr["count"]),
                          "-" if pr["mean_ms"] is None else f"{pr['mean_ms']:.2f}",
                          "-" if pr["p99_ms"] is None else f"{pr['p99_ms']:.2f}",
                          f"{p['manager_cpu_percent']:.0f}",
                          f"{p['emulators_cpu_percent'] + p['client_cpu_percent']:.0f}")
    console.print(table)
    service = Table(title="the manager's code in-process, no sockets (median µs per call)")
    for col in ("instances", "dispatch (1)", "dispatch batch (10)", "load report", "pairing round"):
        service.add_column(col, justify="right")
    for r in data["runs"]:
        sv = r["service_us"]
        service.add_row(str(r["instances"]), *(f"{sv[k]:.0f}" for k in ("dispatch_1", "dispatch_10", "report",
                                                                         "pairing_round")))
    console.print(service)
    for line in skipped_lines(data.get("skipped", []), lambda s: f"{s['instances']} instances"):
        console.print(line, markup=False)
