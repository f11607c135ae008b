"""Benchmarks that print their figures. Not tests: nothing here asserts a timing.

``llumnixctl bench proxy``: what the proxy costs. It starts a local sim cluster whose steps take no model
time, then measures (1) the time to first token through the proxy against submitting the same request
to an instance directly over ZeroMQ (one client, sequential requests), and (2) tokens/s and the proxy's
CPU time per streamed token with many concurrent streams.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import shutil
import socket
import statistics
import time
import uuid
from typing import Annotated, Callable

import psutil
import typer
import zmq
from rich.console import Console
from rich.table import Table

from daemons import runtime, wire
from daemons.config import ConfigError, load_config
from llumnixctl.admin import AdminClient
from llumnixctl.experiments.bench import (cache as bench_cache, disagg as bench_disagg, engine as bench_engine, manager as bench_manager,
                                         handover as bench_handover, migration as bench_migration, overload as bench_overload,
                                         lora as bench_lora, predict as bench_predict,
                                         policies as bench_policies, serve as bench_serve, sessions as bench_sessions,
                                         steady as bench_steady)
from llumnixctl.experiments.bench.budget import (DEFAULT_BUDGET_S, STOP_RESERVE_S, Budget, BudgetOpt, JsonOpt, Progress,
                                                 emit)
from llumnixctl.experiments.bench.cluster import start_cluster
from llumnixctl.experiments.bench.proxy_short import (SHORT_GOAL_RPS, host_port, open_nodelay, pick_client,
                                                     short_rate, stream_load)
from llumnixctl.lab import localcluster
from llumnixctl.stats import percentile
from llumnixctl.lab.scratch import scratch_dir

app = typer.Typer(no_args_is_help=True, help="Benchmarks that print their figures.")


def direct_ttft(request_address: str, n: int, prompt: list[int]) -> list[float]:
    """Submit to an instance over ZeroMQ and wait for the first token, as the proxy's own path does."""
    ctx = zmq.Context.instance()
    pull = runtime.tune(ctx.socket(zmq.PULL))
    reply_to = runtime.bind(pull, "tcp://127.0.0.1:0")
    dealer = runtime.tune(ctx.socket(zmq.DEALER))
    dealer.connect(request_address)
    samples = []
    try:
        for i in range(n + 5):
            sub = wire.Submit(f"direct-{uuid.uuid4().hex}", prompt, wire.SamplingParams(max_tokens=1, ignore_eos=True), reply_to)
            t0 = time.perf_counter()
            dealer.send(wire.encode(sub))
            if not pull.poll(5000):
                raise RuntimeError("the instance did not answer a direct request within 5s")
            pull.recv()
            if i >= 5:  # warm-up
                samples.append(time.perf_counter() - t0)
    finally:
        dealer.close(0)
        pull.close(0)
    return samples


def proxy_ttft(url: str, model: str, n: int, prompt: list[int]) -> list[float]:
    """Time to the first token event over one keep-alive HTTP connection with TCP_NODELAY."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.connect()
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1, "ignore_eos": True, "stream": True})
    samples = []
    for i in range(n + 5):
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        first = None
        while True:
            line = resp.readline()  # de-chunked by http.client
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - t0
            if not line:
                break
        if i >= 5 and first is not None:
            samples.append(first)
    conn.close()
    return samples




# ---------------------------------------------------------------- a burst over several proxies


async def _burst_stream(conn, request: bytes, t0: float) -> float | None:
    """Read one streamed response; its time to the first token event since ``t0``, None if it failed."""
    reader, writer = conn
    first, status = None, b""
    try:
        status = await reader.readline()
        async for line in reader:  # Connection: close: the stream ends with the connection
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - t0
    except ConnectionError:
        first = None
    finally:
        writer.close()
    return first if status.startswith(b"HTTP/1.1 200") else None


async def _burst(urls: list[str], model: str, k: int, tokens: int) -> list[float | None]:
    """``k`` streamed requests spread evenly over ``urls``, released together: every connection is open
    before the first request is written, so no proxy sees its share trickle in."""
    targets = [host_port(urls[i % len(urls)]) for i in range(k)]
    conns = await asyncio.gather(*(open_nodelay(h, p) for h, p in targets))
    body = json.dumps({"model": model, "prompt": list(range(200, 216)), "max_tokens": tokens, "ignore_eos": True,
                       "stream": True}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
    starts = []
    for _, writer in conns:  # all writes in one go, before the loop reads anything
        starts.append(time.perf_counter())
        writer.write(request)
    return list(await asyncio.gather(*(_burst_stream(c, request, t) for c, t in zip(conns, starts))))


def _received(client: AdminClient) -> dict[str, int]:
    return {v.instance_id: v.load.requests_received for v in client.status().instances}


def _idle(client: AdminClient) -> bool:
    alive = [v for v in client.status().instances if v.state == "alive"]
    return all(v.load.running == 0 and v.load.waiting == 0 and v.pending_dispatches == 0 for v in alive)


def _wait(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {timeout_s:g}s")
        time.sleep(0.05)


def burst(state, model: str, k: int, tokens: int, snapshot_interval_s: float) -> dict:
    """One warm-up request per proxy, then (cluster idle) ``k`` simultaneous streams over every proxy:
    TTFT percentiles and the requests each instance took (its requests_received, after minus before)."""
    asyncio.run(_burst(state.urls, model, len(state.urls), 1))  # first requests pay one-time costs
    client = AdminClient.for_args(state.manager_address, state.args)
    try:
        _wait(lambda: _idle(client), 30, "the cluster did not go idle after the warm-up")
        _wait(lambda: client.status().proxies >= len(state.urls), 30,  # each proxy knows its rank among them
              f"the manager did not hear from all {len(state.urls)} proxies")
        # The proxies' own views are not observable from here: let each take two snapshots of the idle
        # cluster, so that no proxy dispatches from a view that still holds the warm-up requests.
        time.sleep(2 * snapshot_interval_s)
        before = _received(client)
        t0 = time.perf_counter()
        ttfts = asyncio.run(_burst(state.urls, model, k, tokens))
        wall = time.perf_counter() - t0
        ok = [t for t in ttfts if t is not None]
        _wait(lambda: sum(_received(client).values()) - sum(before.values()) >= len(ok), 30,
              "the instances did not report the burst's requests")
        after = _received(client)
    finally:
        client.close()
    got = {i: after.get(i, 0) - before.get(i, 0) for i in sorted(after)}
    ms = sorted(t * 1e3 for t in ok) or [float("nan")]
    mean = sum(got.values()) / max(len(got), 1)
    return {"proxies": len(state.urls), "requests": k, "tokens": tokens, "completed": len(ok),
            "failures": k - len(ok), "wall_s": wall,
            "ttft_ms": {"p50": percentile(ms, 50, "nearest"), "p99": percentile(ms, 99, "nearest"), "max": ms[-1]},
            "received_per_instance": got, "imbalance": max(got.values(), default=0) / mean if mean else None}


@app.command()
def proxy(
    instances: Annotated[int, typer.Option(help="sim instances behind the proxy")] = 4,
    requests: Annotated[int, typer.Option(help="sequential requests for the latency comparison (0 = skip it)")] = 300,
    streams: Annotated[int, typer.Option(help="streams for the throughput run (0 = skip it)")] = 400,
    concurrency: Annotated[int, typer.Option(help="streams open at once")] = 64,
    tokens: Annotated[int, typer.Option(help="output tokens per stream")] = 256,
    short_seconds: Annotated[float, typer.Option(help="seconds of one-token requests per kind, streamed and not (0 = skip; wrk runs whole seconds, at least 1)")] = 5.0,
    short_connections: Annotated[int, typer.Option(help="keep-alive connections of the one-token run", min=1)] = 64,
    short_clients: Annotated[int, typer.Option(help="client processes (or wrk threads) of the one-token run", min=1)] = 2,
    short_client: Annotated[str, typer.Option(metavar="auto|wrk|python", help="auto (wrk if it is on PATH, else the Python client), wrk (status 2 if it is not installed) or python")] = "auto",
    burst_requests: Annotated[int, typer.Option("--burst", help="simultaneous streams of the burst run, spread over the proxies (0 = skip)", min=0)] = 0,
    proxies: Annotated[int, typer.Option(help="proxies of the burst run's cluster; the burst is spread evenly over them", min=1)] = 1,
    burst_tokens: Annotated[int, typer.Option(help="output tokens per burst stream", min=1)] = 32,
    burst_seqs: Annotated[int, typer.Option(help="sim.max_num_seqs of the burst run's instances", min=1)] = 8,
    set_: Annotated[list[str] | None, typer.Option("--set", help="extra setting for every daemon of both clusters, after the bench's own (so it may override them): section.key=value; a bad one fails before anything starts (status 2)")] = None,
    json_: JsonOpt = False,
    budget_s: BudgetOpt = DEFAULT_BUDGET_S,
) -> None:
    """Proxy overhead: added time to first token, tokens/s and CPU per streamed token (sim, zero step time),
    one-token requests/s through one proxy; optionally a burst over several proxies (sim steps of real time).
    A part that would not fit in what is left of --budget-s is skipped (its keys stay null; --json: skipped)."""
    budget = Budget(budget_s)
    extra = list(set_ or [])
    try:
        cfg = load_config(None, extra)  # a bad --set fails here, not in a daemon's log
        client = pick_client(short_client)
    except (ConfigError, ValueError) as exc:
        Console(stderr=True).print(f"llumnixctl: {exc}", markup=False)
        raise typer.Exit(2) from None
    result = {"instances": instances, "cores": psutil.cpu_count(), "settings": extra,
              "dispatch": getattr(cfg.proxy, "dispatch", "manager"),  # before proxy.dispatch: always the manager
              # a part skipped (0) keeps its keys, null: scripts read them whatever ran
              "direct_ttft_ms": None, "proxy_ttft_ms": None, "added_ttft_ms_p50": None, "streams": streams,
              "concurrency": concurrency, "tokens": 0, "expected_tokens": streams * tokens, "tokens_per_s": None,
              "proxy_cpu_us_per_token": None, "short_requests": None, "short_requests_per_s": None, "burst": None}
    progress = Progress(bool(requests) + bool(streams) + (short_seconds > 0) + bool(burst_requests), start=budget.t0)

    def part(unit: str, label: str, estimate_s: float | None = None) -> bool:
        if budget.consider({"part": unit}, estimate_s, STOP_RESERVE_S):
            progress.step(label)
            return True
        progress.skipped(label, budget.skipped[-1]["reason"])
        return False

    try:
        if requests or streams or short_seconds > 0:
            result |= _overhead_run(instances, requests, streams, concurrency, tokens, short_seconds,
                                    short_connections, short_clients, client, extra, part)
        if burst_requests and part("burst", f"burst of {burst_requests} over {proxies} proxies"):
            result["burst"] = _burst_run(instances, proxies, burst_requests, burst_tokens, burst_seqs, extra)
    except RuntimeError as exc:  # a client or the cluster failed mid-run (the cluster is stopped by then)
        Console(stderr=True).print(f"llumnixctl: bench proxy: {exc}", markup=False)
        raise typer.Exit(1) from None
    finally:
        progress.close()
    result.update(budget.fields())
    emit(result, json_, _print_proxy, lambda s: f"the {s['part']} part")


def _overhead_run(instances: int, requests: int, streams: int, concurrency: int, tokens: int, short_seconds: float,
                  short_connections: int, short_clients: int, client: str, extra: list[str],
                  part: Callable[..., bool] = lambda *_: True) -> dict:
    """The zero-step-time cluster with one proxy: TTFT direct vs proxied, streamed tokens/s, one-token rate.
    ``part(unit, label, estimate_s)``: whether to run a part (the budget's say; it prints the progress line)."""
    run_dir = scratch_dir("llumnix-bench-")
    sets = ["sim.time_scale=0", "sim.max_num_seqs=256", "proxy.log_level=warning", "instance.log_level=warning"] + extra
    state = start_cluster(run_dir, instances, "sim", sets)
    out: dict = {}
    try:
        if requests and part("ttft", f"TTFT, {requests} requests direct and through the proxy"):
            out |= _ttft_comparison(state, requests)
        if streams and part("throughput", f"throughput, {streams} streams of {tokens} tokens"):
            out |= _throughput(state, streams, concurrency, tokens)
        if short_seconds > 0 and part("short", f"one-token requests, 2 x {short_seconds:g} s",
                                      2 * max(1.0, short_seconds) + 10):
            kinds = {kind: short_rate(state, run_dir, "llumnix-sim", kind == "stream", short_connections, short_clients,
                                      short_seconds, client) for kind in ("stream", "plain")}
            out["short_requests"] = {"client": client, "connections": short_connections, "seconds": short_seconds,
                                     "max_tokens": 1, "goal_requests_per_s": SHORT_GOAL_RPS, **kinds}
            out["short_requests_per_s"] = kinds["stream"]["requests_per_s"]  # the headline: streamed
    finally:
        localcluster.stop(state)
        shutil.rmtree(run_dir, ignore_errors=True)
    return out


def _ttft_comparison(state, requests: int) -> dict:
    client = AdminClient(state.manager_address)
    try:
        snap = client.status()
    finally:
        client.close()
    prompt = list(range(100, 116))
    direct = direct_ttft(snap.instances[0].request_address, requests, prompt)
    via = proxy_ttft(state.url, "llumnix-sim", requests, prompt)
    return {"direct_ttft_ms": {"p50": percentile(direct, 50, "nearest") * 1e3, "p99": percentile(direct, 99, "nearest") * 1e3},
            "proxy_ttft_ms": {"p50": percentile(via, 50, "nearest") * 1e3, "p99": percentile(via, 99, "nearest") * 1e3},
            "added_ttft_ms_p50": (statistics.median(via) - statistics.median(direct)) * 1e3}


def _throughput(state, streams: int, concurrency: int, tokens: int) -> dict:
    proxy_proc = next(p for p in state.procs if p.name == "proxy").process()
    cpu0 = sum(proxy_proc.cpu_times()[:2])
    t0 = time.perf_counter()
    total = asyncio.run(stream_load(state.url, "llumnix-sim", streams, concurrency, tokens))
    wall = time.perf_counter() - t0
    cpu = sum(proxy_proc.cpu_times()[:2]) - cpu0
    return {"tokens": total, "tokens_per_s": total / wall, "proxy_cpu_us_per_token": cpu / max(total, 1) * 1e6}


def _burst_run(instances: int, proxies: int, k: int, tokens: int, seqs: int, extra: list[str]) -> dict:
    """A cluster of ``proxies`` proxies whose sim steps take model time (sim.time_scale as set, 1 by default),
    batches of ``seqs``: a burst that herds onto few instances queues there, and its TTFT shows it."""
    run_dir = scratch_dir("llumnix-bench-")
    sets = [f"sim.max_num_seqs={seqs}", "proxy.log_level=warning", "instance.log_level=warning"] + extra
    state = start_cluster(run_dir, instances, "sim", sets, timeout_s=120, proxies=proxies)
    try:
        out = burst(state, "llumnix-sim", k, tokens, load_config(None, sets).proxy.snapshot_interval_s)
    finally:
        localcluster.stop(state)
        shutil.rmtree(run_dir, ignore_errors=True)
    # Requests an instance took beyond its batch wait for a slot whatever the machine's speed: a count of
    # the herding that TTFT (noisy where the cores are shared) shows only roughly.
    over = sum(max(0, n - seqs) for n in out["received_per_instance"].values())
    return {**out, "max_num_seqs": seqs, "over_batch": over, "time_scale": load_config(None, sets).sim.time_scale}


def _print_proxy(result: dict) -> None:
    cores = result["cores"]
    table = Table(title=f"proxy overhead · {result['instances']} sim instances · {cores} cores · dispatch {result['dispatch']}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    if result.get("direct_ttft_ms"):
        table.add_row("TTFT direct to instance p50 / p99", f"{result['direct_ttft_ms']['p50']:.3f} / {result['direct_ttft_ms']['p99']:.3f} ms")
        table.add_row("TTFT through proxy p50 / p99", f"{result['proxy_ttft_ms']['p50']:.3f} / {result['proxy_ttft_ms']['p99']:.3f} ms")
        table.add_row("added by proxy p50", f"{result['added_ttft_ms_p50']:.3f} ms")
    if result.get("tokens_per_s"):
        table.add_row(f"throughput ({result['streams']} streams, {result['concurrency']} at once)", f"{result['tokens_per_s']:.0f} tokens/s")
        table.add_row("proxy CPU per streamed token", f"{result['proxy_cpu_us_per_token']:.1f} us")
        table.add_row("tokens received / expected", f"{result['tokens']} / {result['expected_tokens']}")
    short = result.get("short_requests")
    for kind in ("stream", "plain") if short else ():
        r = short[kind]
        label = f"1-token {'streamed' if kind == 'stream' else 'non-streamed'} ({short['client']}, {short['connections']} conns)"
        table.add_row(label, f"{r['requests_per_s']:.0f} req/s, {r['failures']} failed")
        table.add_row("  proxy CPU per request / proxy cores", f"{r['proxy_cpu_us_per_request']:.0f} us / {r['proxy_cores']:.2f}")
        table.add_row("  client cores / machine busy cores", f"{r['client_cores']:.2f}{' (saturated)' if r['client_saturated'] else ''} / {r['machine_busy_cores']:.2f} of {cores}")
    b = result.get("burst")
    if b:
        table.add_row(f"burst of {b['requests']} over {b['proxies']} proxies: TTFT p50 / p99", f"{b['ttft_ms']['p50']:.1f} / {b['ttft_ms']['p99']:.1f} ms")
        table.add_row("  requests per instance", " ".join(f"{i}:{n}" for i, n in b["received_per_instance"].items()))
    Console().print(table)


app.command("engine")(bench_engine.command)
app.command("migration")(bench_migration.command)
app.command("policies")(bench_policies.command)
app.command("serve")(bench_serve.command)
app.command("manager")(bench_manager.command)
app.command("steady")(bench_steady.command)
app.command("cache")(bench_cache.command)
app.command("overload")(bench_overload.command)
app.command("predict")(bench_predict.command)
app.command("disagg")(bench_disagg.command)
app.command("handover")(bench_handover.command)
app.command("lora")(bench_lora.command)
app.command("sessions")(bench_sessions.command)
