"""``llumnixctl bench predict``: how well the cluster predicts each request's time to first token and time per output
token ([slo]: the instances' step-time models, daemons/policy/slo.py), on the real engine or the sim.

A local cluster is measured first: its capacity (a closed loop keeping every batch slot busy; completed requests per
second, which also gives every instance its step-time model and finish rate). Then, for each load in ``--loads``
(times that capacity), Poisson arrivals for ``--seconds`` of requests with mixed prompt and output lengths. Every
answer carries the prediction it was placed by (the proxy's ``x-llumnix-predicted-ttft-ms`` and ``-tpot-ms``
headers); the client measures the actual ones (TTFT: sending to the first token; TPOT: the mean gap between the
first token and the last). Printed per load: requests, the median and P90 of |predicted - actual| / actual, and the
median of (predicted - actual) / actual (its bias: below 0, predictions too low).
Admission is not by SLO here (no TTFT target is set): every request is served, so the prediction is tested at every
queue length the load makes.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import shutil
import time
from pathlib import Path
from typing import Annotated, Iterator, Optional

import httpx
import typer
from rich.console import Console
from rich.table import Table

from llumnixctl.experiments.bench.budget import (DEFAULT_BUDGET_S, Budget, BudgetOpt, JsonOpt, Progress, SaveOpt, Units,
                                                 emit)
from llumnixctl.experiments.bench.cluster import start_cluster
from llumnixctl.experiments.bench.serve import closed_loop_rate, poisson_arrivals, stream_completion
from llumnixctl.lab import localcluster
from llumnixctl.stats import percentile
from llumnixctl.lab.scratch import scratch_dir

PROMPTS = (32, 64, 128, 256, 512)
OUTPUTS = (16, 32, 64, 128)


def _body(model: str, rng: random.Random, k: int) -> dict:
    prompt = rng.choice(PROMPTS)
    return {"model": model, "prompt": [(k * 31 + i) % 1000 + 3 for i in range(prompt)],
            "max_tokens": rng.choice(OUTPUTS), "ignore_eos": True, "stream": True, "temperature": 0}


async def _capacity(url: str, model: str, concurrency: int, seconds: float, timeout: float) -> float:
    def bodies(w: int) -> Iterator[dict]:
        rng = random.Random(w)
        return (_body(model, rng, w * 100_000 + k) for k in itertools.count())

    return await closed_loop_rate(url, concurrency, seconds, timeout, bodies)


async def _load(url: str, model: str, rate: float, seconds: float, timeout: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    arrivals = poisson_arrivals(rng, rate, seconds)
    bodies = [_body(model, rng, 500_000 + k) for k in range(len(arrivals))]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout, connect=10.0)) as client:
        t0 = time.perf_counter() + 0.2

        async def one(at: float, body: dict) -> dict:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            return await stream_completion(client, url, body, None, timeout)

        return list(await asyncio.gather(*(one(at, b) for at, b in zip(arrivals, bodies))))


def errors(results: list[dict]) -> dict:
    """Relative errors |predicted - actual| / actual of TTFT and TPOT over the answered requests that carry a
    prediction."""
    ttft, tpot, answered = [], [], 0
    signed = {"ttft": [], "tpot": []}  # (predicted - actual) / actual: which way it errs
    for r in results:
        if r["error"] is not None or not r["times"]:
            continue
        answered += 1
        times = r["times"]
        if r.get("predicted_ttft_ms"):
            actual = times[0]
            signed["ttft"].append((float(r["predicted_ttft_ms"]) / 1000 - actual) / actual)
            ttft.append(abs(signed["ttft"][-1]))
        if r.get("predicted_tpot_ms") and len(times) > 2:
            actual = (times[-1] - times[0]) / (len(times) - 1)
            if actual > 0:
                signed["tpot"].append((float(r["predicted_tpot_ms"]) / 1000 - actual) / actual)
                tpot.append(abs(signed["tpot"][-1]))
    out = {"requests": len(results), "answered": answered, "predicted": len(ttft)}
    for name, xs in (("ttft", ttft), ("tpot", tpot)):
        out[f"{name}_error_p50"] = percentile(xs, 50) if xs else None
        out[f"{name}_error_p90"] = percentile(xs, 90) if xs else None
        out[f"{name}_bias_p50"] = percentile(signed[name], 50) if signed[name] else None  # < 0: predicted too low
    return out


def command(
    backend: Annotated[str, typer.Option(help="engine of the instances: sim or vllm (a tiny random model unless "
                                             "--model)")] = "sim",
    instances: Annotated[int, typer.Option(help="instances", min=1)] = 2,
    batch: Annotated[int, typer.Option(help="max_num_seqs of each instance", min=1)] = 16,
    loads: Annotated[str, typer.Option(help="offered loads, times the measured capacity, comma-separated")] = "0.5,1,1.5",
    seconds: Annotated[float, typer.Option(help="length of each load, s", min=1.0)] = 60.0,
    model: Annotated[Optional[Path], typer.Option(metavar="DIR", help="vllm: checkpoint directory")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="a setting of the cluster: section.key=value")] = None,
    seed: Annotated[int, typer.Option(help="arrivals seed")] = 0,
    save: SaveOpt = None,
    json_: JsonOpt = False,
    budget_s: BudgetOpt = DEFAULT_BUDGET_S,
) -> None:
    """How far the predicted TTFT and TPOT of each request are from the actual ones, at several loads. A load
    that would not fit in --budget-s is skipped (--json: skipped)."""
    budget = Budget(budget_s)
    err = Console(stderr=True)
    try:
        factors = [float(x) for x in loads.split(",") if x.strip()]
    except ValueError:
        err.print(f"llumnixctl: --loads must be numbers separated by commas, got {loads!r}", markup=False)
        raise typer.Exit(2) from None
    if backend not in ("sim", "vllm") or not factors or any(f <= 0 for f in factors):
        err.print("llumnixctl: --backend is sim or vllm, and every load is > 0", markup=False)
        raise typer.Exit(2)
    run_dir = scratch_dir("llumnix-predict-")
    sets = ["instance.log_level=warning", "proxy.log_level=warning", "proxy.access_log=false"]
    name = "llumnix-sim"
    if backend == "vllm":
        from llumnixctl.lab.model import write_tiny_model

        path = model or write_tiny_model(run_dir / "tiny-llama")
        name = "bench"
        sets += [f"model.path={Path(path).resolve()}", f"model.name={name}", f"vllm.max_num_seqs={batch}"]
    else:
        sets += [f"sim.max_num_seqs={batch}", "sim.eos_rate=0"]
    sets += set_ or []
    timeout = 600.0
    rows = []
    progress = Progress(1 + len(factors), start=budget.t0)
    units = Units(budget, progress)
    state = start_cluster(run_dir, instances, backend, sets, timeout_s=300)
    try:
        progress.step("capacity")
        err.print("capacity (and every instance's step-time model) ...")
        capacity = asyncio.run(_capacity(state.url, name, instances * batch, 20.0, timeout))
        units.measured[None] = [(1.0, seconds)]  # a load takes its seconds and its requests' tail: at least that
        for k, factor in enumerate(factors):
            if not units.start({"load": factor}, f"load {factor:g}x"):
                continue
            err.print(f"{factor:g}x capacity ({factor * capacity:.2f} requests/s) for {seconds:g}s ...")
            results = asyncio.run(_load(state.url, name, factor * capacity, seconds, timeout, seed + k))
            rows.append({"load": factor, "rate_rps": factor * capacity, **errors(results)})
            units.done()
    finally:
        progress.close()
        localcluster.stop(state)
        shutil.rmtree(run_dir, ignore_errors=True)
    res = {"backend": backend, "instances": instances, "batch": batch, "capacity_rps": capacity,
           "seconds": seconds, "sets": set_ or [], "loads": rows, **budget.fields()}
    emit(res, json_, _show, lambda s: f"load {s['load']:g}x", save=save)


def _show(res: dict) -> None:
    """The loads' prediction errors, as a table."""
    table = Table(title=f"predicted vs actual, {res['instances']} {res['backend']} instances of batch {res['batch']}, "
                        f"capacity {res['capacity_rps']:.2f} requests/s; |predicted - actual| / actual")
    for col in ("load", "requests", "predicted", "TTFT P50", "TTFT P90", "TTFT bias", "TPOT P50", "TPOT P90",
                "TPOT bias"):
        table.add_column(col, justify="right")

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x * 100:.0f}%"

    for r in res["loads"]:
        table.add_row(f"{r['load']:g}x", str(r["requests"]), str(r["predicted"]), pct(r["ttft_error_p50"]),
                      pct(r["ttft_error_p90"]), pct(r["ttft_bias_p50"]), pct(r["tpot_error_p50"]),
                      pct(r["tpot_error_p90"]), pct(r["tpot_bias_p50"]))
    Console().print(table)
