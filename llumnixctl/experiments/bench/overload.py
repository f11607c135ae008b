"""``llumnixctl bench overload``: admission control at several times the cluster's capacity (sim engine, or
vllm with --backend vllm).

A local cluster is measured three ways: its capacity (a closed loop that keeps every batch slot busy;
completed requests per second), its unloaded time to first token (requests one at a time), then an open loop of
Poisson arrivals at ``--factor`` times that capacity for ``--seconds``, a share of them high priority. Printed:
how many were admitted, refused (429) or answered 503, how fast a refusal at admission came (P50, P99, max; a
request that was admitted and then gave up queueing past slo.give_up_factor x its TTFT target is counted
apart, as gave_up_429) and with which Retry-After, the admitted requests' TTFT against the unloaded figure, requests that ended in any other error
(a timeout: nothing should wait to one), and high-priority refusals beside normal admissions.

With --slo-ttft-ms/--slo-tpot-ms the cluster serves to those targets ([slo]: admission by predicted TTFT) and the
figures add goodput and attainment per class (llumnixctl/experiments/bench/goodput.py) and the moments a
high-priority request was refused while a normal one was admitted; --no-slo-enforce measures against the same
targets with [slo] left off (the comparison).

With --burst N the open loop is replaced by a burst (llumnixctl/experiments/bench/burst.py): a warm-up of --warmup
short requests, then N streams written at once over the cluster's --proxies proxies by a raw client (an HTTP
library's own cost on a 2-core host would be counted as the server's), refused ones retrying after their
Retry-After up to --retries times; printed: admitted and refused, the admitted TTFT, the refusals' time at the
client and at the proxies (their llumnix_proxy_refusal_seconds), and what the retries got.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import shutil
import time
from pathlib import Path
from typing import Annotated, Optional

import httpx
import typer
from rich.console import Console
from rich.table import Table

from llumnixctl.experiments.bench.budget import (DEFAULT_BUDGET_S, STOP_RESERVE_S, Budget, BudgetOpt, JsonOpt, Progress,
                                                 SaveOpt, emit, fit_seconds)
from llumnixctl.experiments.bench.goodput import gave_up, high_refused_while_normal_admitted, slo_figures
from llumnixctl.experiments.bench.serve import closed_loop_rate, poisson_arrivals, stream_completion
from llumnixctl.lab import localcluster
from llumnixctl.stats import percentile
from llumnixctl.lab.scratch import kept_if, scratch_dir

MODEL = "llumnix-sim"
VOCAB = 30000  # prompt token ids stay under this (--backend vllm: the tiny model's vocabulary)


def _body(prompt: int, output: int, high: bool, k: int) -> dict:
    body = {"model": MODEL, "prompt": [(k * 31 + i) % VOCAB + 3 for i in range(prompt)], "max_tokens": output,
            "ignore_eos": True, "stream": True}
    if high:
        body["priority"] = "high"
    return body


async def _capacity(url: str, concurrency: int, seconds: float, prompt: int, output: int, timeout: float) -> float:
    """Completed requests per second with ``concurrency`` requests always in flight."""
    return await closed_loop_rate(url, concurrency, seconds, timeout,
                                  lambda w: (_body(prompt, output, False, w * 100_000 + k) for k in itertools.count()))


async def _unloaded(url: str, n: int, prompt: int, output: int, timeout: float) -> list[float]:
    ttfts = []
    async with httpx.AsyncClient(timeout=timeout) as client:
        for k in range(n):
            r = await stream_completion(client, url, _body(prompt, min(output, 8), False, 900_000 + k), None, timeout)
            if r["error"] is None:
                ttfts.append(r["times"][0])
    return ttfts


async def _overload(url: str, rate: float, seconds: float, prompt: int, output: int, high_fraction: float,
                    timeout: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    arrivals = poisson_arrivals(rng, rate, seconds, lambda: rng.random() < high_fraction)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout, connect=10.0)) as client:
        t0 = time.perf_counter() + 0.2

        async def one(k: int, at: float, high: bool) -> dict:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            r = await stream_completion(client, url, _body(prompt, output, high, k), None, timeout)
            r["high"] = high
            return r

        return list(await asyncio.gather(*(one(k, at, high) for k, (at, high) in enumerate(arrivals))))


def vocab_of(path: Path) -> int:
    """The token ids a checkpoint takes: its config's vocabulary, or its tokenizer's where that knows fewer (the
    proxy refuses an id the tokenizer does not know)."""
    vocab = int(json.loads((path / "config.json").read_text()).get("vocab_size", 32000))
    tokenizer = path / "tokenizer.json"
    if tokenizer.exists():
        vocab = min(vocab, len(json.loads(tokenizer.read_text())["model"]["vocab"]))
    return vocab


def _ms(xs: list[float], q: float) -> float | None:
    return percentile(xs, q) * 1000 if xs else None


def analyse(results: list[dict], unloaded: list[float], capacity: float, rate: float, seconds: float = 0.0,
            ttft_s: float = 0.0, tpot_s: float = 0.0) -> dict:
    ok = [r for r in results if r["error"] is None]
    refused = [r for r in results if r.get("status") == 429]
    unavailable = [r for r in results if r.get("status") == 503]
    other = [r for r in results if r["error"] is not None and r.get("status") not in (429, 503)]
    ttft = [r["times"][0] for r in ok]
    given_up = [r for r in refused if gave_up(r)]  # admitted, then 429 after queueing past slo.give_up_factor
    refusal = [r["answered_s"] for r in refused + unavailable if not gave_up(r)]  # decided at admission
    unloaded_p99 = _ms(unloaded, 99)
    admitted_p99 = _ms(ttft, 99)
    return {
        "capacity_rps": capacity, "offered_rps": rate, "requests": len(results), "admitted": len(ok),
        "refused_429": len(refused), "refused_503": len(unavailable), "other_errors": len(other),
        "first_other_error": other[0]["error"][:300] if other else "",
        "retry_after": sorted({r.get("retry_after") for r in refused + unavailable if r.get("retry_after")}),
        "refusal_p50_ms": _ms(refusal, 50), "refusal_p99_ms": _ms(refusal, 99),
        "refusal_max_ms": max(refusal) * 1000 if refusal else None,
        "unloaded_ttft_p99_ms": unloaded_p99, "admitted_ttft_p50_ms": _ms(ttft, 50), "admitted_ttft_p99_ms": admitted_p99,
        "ttft_p99_ratio": admitted_p99 / unloaded_p99 if admitted_p99 and unloaded_p99 else None,
        "high_refused": sum(1 for r in refused + unavailable if r["high"]),
        "high_admitted": sum(1 for r in ok if r["high"]), "normal_admitted": sum(1 for r in ok if not r["high"]),
        "high_refused_while_normal_admitted": high_refused_while_normal_admitted(results),
        "gave_up_429": len(given_up), "gave_up_p50_ms": _ms([r["answered_s"] for r in given_up], 50),
        "slo": slo_figures(results, ttft_s, tpot_s, seconds) if (ttft_s or tpot_s) else None,
    }


def command(
    instances: Annotated[int, typer.Option(help="sim instances", min=1)] = 2,
    batch: Annotated[int, typer.Option(help="sim.max_num_seqs of each instance", min=1)] = 8,
    factor: Annotated[float, typer.Option(help="offered load, times the measured capacity", min=0.1)] = 10.0,
    seconds: Annotated[float, typer.Option(help="length of the overload, s", min=1.0)] = 120.0,
    prompt: Annotated[int, typer.Option(help="prompt tokens of every request", min=1)] = 128,
    output: Annotated[int, typer.Option(help="output tokens of every request", min=1)] = 200,
    high_fraction: Annotated[float, typer.Option(help="share of high-priority requests", min=0.0, max=1.0)] = 0.1,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="a setting of the cluster: section.key=value")] = None,
    slo_ttft_ms: Annotated[float, typer.Option(help="TTFT target, ms: sets slo.ttft_ms on the cluster (admission by predicted TTFT) and reports goodput and attainment per class against it (0: none)", min=0.0)] = 0.0,
    slo_tpot_ms: Annotated[float, typer.Option(help="TPOT target, ms: sets slo.tpot_ms and counts in goodput (0: none)", min=0.0)] = 0.0,
    slo_enforce: Annotated[bool, typer.Option(help="--no-slo-enforce: measure goodput against --slo-ttft-ms/--slo-tpot-ms with [slo] left off on the cluster (the comparison)")] = True,
    backend: Annotated[str, typer.Option(metavar="sim|vllm", help="engine of the instances (vllm: a tiny random-weight model unless --model)")] = "sim",
    model: Annotated[Optional[Path], typer.Option(metavar="DIR", help="--backend vllm: the checkpoint (default: a tiny random-weight model)")] = None,
    seed: Annotated[int, typer.Option(help="arrivals seed")] = 0,
    burst_n: Annotated[int, typer.Option("--burst", help="instead of the open loop: a warm-up of --warmup short requests, then this many streams sent at once, spread over --proxies proxies (0: the open loop)", min=0)] = 0,
    warmup: Annotated[int, typer.Option(help="--burst: requests one at a time before the burst, with short answers", min=0)] = 12,
    retries: Annotated[int, typer.Option(help="--burst: a refused stream waits its Retry-After and tries again, this many times at most", min=0)] = 0,
    proxies: Annotated[int, typer.Option(help="--burst: proxies of the cluster; the burst is spread evenly over them", min=1)] = 1,
    save: SaveOpt = None,
    json_: JsonOpt = False,
    budget_s: BudgetOpt = DEFAULT_BUDGET_S,
) -> None:
    """Admission control at --factor times the cluster's capacity: refusals, their speed, admitted TTFT; with
    --slo-ttft-ms, goodput and attainment per class. An overload longer than what is left of --budget-s is
    shortened to fit (JSON: seconds is what ran, skipped says what was cut and why)."""
    global MODEL, VOCAB
    budget = Budget(budget_s)
    progress = Progress(2 if burst_n else 3, start=budget.t0)
    err = Console(stderr=True)
    if backend not in ("sim", "vllm"):
        raise typer.BadParameter("sim or vllm", param_hint="--backend")
    run_dir = scratch_dir("llumnix-overload-")
    sets = [f"{backend}.max_num_seqs={batch}", "instance.log_level=warning", "proxy.log_level=warning",
            "proxy.access_log=false", *(set_ or [])]
    if slo_enforce:
        sets += [f"slo.ttft_ms={slo_ttft_ms:g}"] * bool(slo_ttft_ms) + [f"slo.tpot_ms={slo_tpot_ms:g}"] * bool(slo_tpot_ms)
    if backend == "vllm":
        from llumnixctl.lab.model import write_tiny_model

        path = (model or write_tiny_model(run_dir / "tiny")).resolve()
        MODEL, VOCAB = path.name, vocab_of(path) - 8
        sets += [f"model.path={path}", f"model.name={MODEL}"]
    timeout = 600.0
    with kept_if(run_dir, localcluster.ClusterError):  # its error points at the daemons' logs there
        state = localcluster.up(run_dir, instances, backend, 0, None, sets, timeout_s=60 if backend == "sim" else 300,
                                proxies=proxies)
    if burst_n:
        return _burst_command(state, run_dir, budget, progress, burst_n, warmup, retries, prompt, output,
                              slo_ttft_ms, slo_tpot_ms, backend, instances, batch, set_ or [], save, json_)
    try:
        progress.step("capacity")
        t_cap = time.monotonic()
        err.print("capacity ...")
        capacity = asyncio.run(_capacity(state.url, instances * batch, 15.0, prompt, output, timeout))
        tail_s = time.monotonic() - t_cap  # what the overload's last admitted requests take to finish, about
        progress.step("unloaded TTFT")
        err.print(f"capacity {capacity:.2f} requests/s; unloaded TTFT ...")
        unloaded = asyncio.run(_unloaded(state.url, 30, prompt, output, timeout))
        rate = factor * capacity
        requested = seconds
        seconds = fit_seconds(budget, seconds, tail_s + STOP_RESERVE_S)
        if seconds < requested:
            budget.skip({"part": "overload", "requested_s": requested, "run_s": seconds},
                        f"overload shortened from {requested:g} s to {seconds:g} s: "
                        f"{max(0.0, budget.left()):.0f} s of the {budget.budget_s:.0f} s budget left, "
                        f"{tail_s + STOP_RESERVE_S:.0f} s kept for its requests' tail and the cluster's stop")
        progress.step(f"overload, {seconds:g} s")
        err.print(f"overload: {rate:.1f} requests/s for {seconds:g}s ...")
        results = asyncio.run(_overload(state.url, rate, seconds, prompt, output, high_fraction, timeout, seed))
    finally:
        progress.close()
        localcluster.stop(state)
        shutil.rmtree(run_dir, ignore_errors=True)
    res = {"instances": instances, "batch": batch, "factor": factor, "seconds": seconds, "prompt": prompt,
           "output": output, "high_fraction": high_fraction, "sets": set_ or [], "backend": backend,
           "slo_enforced": bool(slo_enforce and (slo_ttft_ms or slo_tpot_ms)),
           **analyse(results, unloaded, capacity, rate, seconds, slo_ttft_ms / 1000, slo_tpot_ms / 1000),
           **budget.fields()}
    emit(res, json_, _show, lambda s: s["part"], save=save)


def _show(res: dict) -> None:
    """The overload's measures (and the SLO's, with targets), as a table."""
    table = _measures(f"{res['factor']:g}x capacity ({res['capacity_rps']:.2f} requests/s) for {res['seconds']:g}s, "
                      f"{res['instances']} {res['backend']} instances of batch {res['batch']}", res)
    if res["slo"] is not None:
        slo = res["slo"]
        table.add_section()
        table.add_row(f"SLO (TTFT {slo['slo_ttft_ms']:g} ms, TPOT {slo['slo_tpot_ms']:g} ms; "
                      f"{'enforced' if res['slo_enforced'] else 'measured only'})", "")
        table.add_row("goodput (met per s)", f"{slo['goodput_rps']:.2f}")
        table.add_row("attainment (met / admitted)", "-" if slo["attainment"] is None else f"{slo['attainment']:.3f}")
        for cls, c in slo["classes"].items():
            table.add_row(f"  {cls}: met / admitted / refused", f"{c['met']} / {c['admitted']} / {c['refused']}")
            table.add_row(f"  {cls}: attainment, goodput", ("-" if c["attainment"] is None else f"{c['attainment']:.3f}")
                          + f", {c['goodput_rps']:.2f}/s")
    Console().print(table)


def _burst_command(state, run_dir: Path, budget: Budget, progress: Progress, n: int, warmup: int, retries: int,
                   prompt: int, output: int, ttft_ms: float, tpot_ms: float, backend: str, instances: int, batch: int,
                   sets: list[str], save: Optional[Path], json_: bool) -> None:
    from llumnixctl.experiments.bench import burst

    def body(k: int, out: int) -> dict:
        return _body(prompt, out, False, k)

    try:
        progress.step(f"warm-up, {warmup} requests")
        warmed = asyncio.run(burst.warm_up(state.url, body, warmup, min(output, 16), 600.0))
        progress.step(f"burst of {n} over {len(state.urls)} proxies")
        deadline = max(30.0, budget.left() - STOP_RESERVE_S)
        t0 = time.perf_counter()
        results = asyncio.run(burst.burst(state.urls, body, n, output, retries, 600.0, deadline))
        wall = time.perf_counter() - t0
        at_proxy = burst.proxy_refusals(state.urls)
    finally:
        progress.close()
        localcluster.stop(state)
        shutil.rmtree(run_dir, ignore_errors=True)
    res = {"backend": backend, "instances": instances, "batch": batch, "proxies": len(state.urls), "burst": n,
           "warmup": warmed, "retries": retries, "prompt": prompt, "output": output, "slo_ttft_ms": ttft_ms,
           "slo_tpot_ms": tpot_ms, "sets": sets, "wall_s": round(wall, 1),
           **burst.analyse(results, ttft_ms / 1000, tpot_ms / 1000), **at_proxy, **budget.fields()}
    emit(res, json_, _show_burst, lambda s: s["part"], save=save)


def _show_burst(res: dict) -> None:
    Console().print(_measures(f"a burst of {res['burst']} streams on {res['instances']} {res['backend']} instances, "
                              f"TTFT target {res['slo_ttft_ms']:g} ms", res))


def _measures(title: str, res: dict) -> Table:
    """A table of ``res``'s plain measures, one row each (its settings, SLO part, skipped units and empty
    lists apart)."""
    table = Table(title=title)
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key, value in res.items():
        if key in ("sets", "slo", "skipped") or isinstance(value, (list, dict)) and not value:
            continue
        table.add_row(key, f"{value:.2f}" if isinstance(value, float) else str(value))
    return table
