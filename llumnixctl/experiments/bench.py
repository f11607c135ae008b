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
import re
import resource
import shutil
import subprocess
import socket
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Annotated, Callable

import psutil
import typer
import zmq
from rich.console import Console
from rich.table import Table

from daemons import runtime, wire
from daemons.config import ConfigError, load_config
from llumnixctl.experiments import (bench_engine, bench_manager, bench_migration, bench_overload, bench_policies,
                                    bench_serve, bench_steady)
from llumnixctl.admin import AdminClient
from llumnixctl.lab import localcluster

app = typer.Typer(no_args_is_help=True, help="Benchmarks that print their figures.")


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


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


_USAGE = re.compile(rb'"completion_tokens":(\d+)')


async def _stream_one(host: str, port: int, body: bytes) -> int:
    """One streamed completion over a raw connection; returns the completion tokens its usage reports."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
    tokens = 0
    async for line in reader:
        if line.startswith(b"data: {") and b'"usage"' in line:
            tokens = int(_USAGE.search(line).group(1))
    writer.close()
    return tokens


async def _load(url: str, model: str, streams: int, concurrency: int, tokens: int,
                prompt: str | list[int] = "benchmark the proxy", temperature: float = 1.0) -> int:
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "stream": True,
                       "temperature": temperature, "stream_options": {"include_usage": True}}).encode()
    sem = asyncio.Semaphore(concurrency)

    async def one() -> int:
        async with sem:
            return await _stream_one(host, int(port), body)

    return sum(await asyncio.gather(*(one() for _ in range(streams))))


# ---------------------------------------------------------------- short requests: requests/s through one proxy

SHORT_GOAL_RPS = 7500  # the rate issue #15 asks of one proxy
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length: *(\d+)", re.IGNORECASE)


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _short_body(model: str, stream: bool) -> bytes:
    """A one-token completion: what the proxy does per request, with the engine's part as small as it gets."""
    return json.dumps({"model": model, "prompt": [100, 101, 102, 103], "max_tokens": 1, "ignore_eos": True,
                       "stream": stream}).encode()


def _keep_alive_request(body: bytes) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


async def _read_response(reader: asyncio.StreamReader) -> tuple[bool, bool]:
    """Read one HTTP/1.1 response (Content-Length or chunked body); (status 200, connection kept)."""
    head = await reader.readuntil(b"\r\n\r\n")
    m = _CONTENT_LENGTH.search(head)
    if m:
        await reader.readexactly(int(m.group(1)))
    else:  # chunked: size lines, each chunk followed by CRLF; a 0 chunk (no trailers) ends it
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    return head.startswith(b"HTTP/1.1 200"), b"connection: close" not in head.lower()


async def _open(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(host, port)
    writer.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return reader, writer


async def _short_connection(host: str, port: int, conn, request: bytes, stop_at: float,
                            latencies: list[float]) -> int:
    """Send requests back to back on one keep-alive connection until ``stop_at``; returns the failures."""
    reader, writer = conn
    failures = 0
    clock = time.perf_counter
    while clock() < stop_at:
        t0 = clock()
        writer.write(request)
        try:
            ok, kept = await _read_response(reader)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            ok, kept = False, False
        if ok:
            latencies.append(clock() - t0)
        else:
            failures += 1
        if not kept:  # the server closed it (or it broke): go on with a new one
            writer.close()
            reader, writer = await _open(host, port)
    writer.close()
    return failures


async def _short_client(args: dict) -> dict:
    """One client process: open its connections, say ready, wait for a line on stdin, run for the time."""
    host, port = args["host"], args["port"]
    request = _keep_alive_request(args["body"].encode())
    conns = await asyncio.gather(*(_open(host, port) for _ in range(args["connections"])))  # before the start
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    cpu0, t0 = time.process_time(), time.perf_counter()
    latencies: list[float] = []
    failures = sum(await asyncio.gather(*(_short_connection(host, port, c, request, t0 + args["seconds"], latencies)
                                          for c in conns)))
    return {"completed": len(latencies), "failures": failures, "wall_s": time.perf_counter() - t0,
            "cpu_s": time.process_time() - cpu0, "latencies_ms": [round(x * 1e3, 3) for x in latencies]}


def short_client_main() -> None:
    """Entry point of a client process (``python -c``): one JSON argument, JSON result on stdout."""
    args = json.loads(sys.argv[1])
    try:
        import uvloop  # the client must not be the bottleneck: uvloop's loop costs less per request
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    sys.stdout.write(json.dumps(run(_short_client(args))) + "\n")


def _split(total: int, parts: int) -> list[int]:
    """``total`` spread over ``parts`` as evenly as it goes (the first ones get the remainder)."""
    return [total // parts + (1 if k < total % parts else 0) for k in range(parts)]


class _PythonClients:
    """Client processes (``short_client_main``), each with its share of the keep-alive connections: one
    Python process tops out near a core, so several keep the client from being what saturates first."""

    name = "python"

    def __init__(self, url: str, body: bytes, connections: int, procs: int, seconds: float):
        host, port = _host_port(url)
        self.procs = []
        for n in [n for n in _split(connections, procs) if n]:
            args = {"host": host, "port": port, "connections": n, "seconds": seconds, "body": body.decode()}
            self.procs.append(subprocess.Popen(
                [sys.executable, "-c", "from llumnixctl.experiments.bench import short_client_main; short_client_main()",
                 json.dumps(args)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        self.parallelism = len(self.procs)

    def ready(self) -> None:
        for proc in self.procs:
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a bench client (pid {proc.pid}) failed before it was ready")

    def go(self) -> None:
        for proc in self.procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()

    def finish(self) -> dict:
        results = []
        for proc in self.procs:
            out, _ = proc.communicate(timeout=120)
            if proc.returncode != 0:
                raise RuntimeError(f"a bench client (pid {proc.pid}) exited with status {proc.returncode}")
            results.append(json.loads(out.strip().splitlines()[-1]))
        latencies = [x for r in results for x in r["latencies_ms"]] or [float("nan")]
        return {"completed": sum(r["completed"] for r in results), "failures": sum(r["failures"] for r in results),
                "wall_s": max(r["wall_s"] for r in results), "client_cpu_s": sum(r["cpu_s"] for r in results),
                "latency_ms": {"p50": _pct(latencies, 50), "p99": _pct(latencies, 99)}}

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


_WRK_SCRIPT = """wrk.method = "POST"
wrk.body = [[%s]]
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('WRKJSON {"completed":%%d,"failures":%%d,"wall_s":%%f,"p50_ms":%%f,"p99_ms":%%f}\\n',
    summary.requests - e.status, e.connect + e.read + e.write + e.timeout + e.status, summary.duration / 1e6,
    latency:percentile(50) / 1e3, latency:percentile(99) / 1e3))
end
"""


class _Wrk:
    """wrk (C, epoll, keep-alive HTTP/1.1): a client that costs the proxy's cores far less than ours."""

    name = "wrk"

    def __init__(self, url: str, body: bytes, connections: int, threads: int, seconds: float, run_dir: Path):
        self.script = run_dir / "short.lua"
        self.script.write_text(_WRK_SCRIPT % body.decode())
        self.parallelism = max(1, min(threads, connections))
        self.argv = ["wrk", f"-t{self.parallelism}", f"-c{max(connections, self.parallelism)}",
                     f"-d{max(1, round(seconds))}s", "--timeout", "10s", "-s", str(self.script), url + "/v1/completions"]
        self.proc = None

    def ready(self) -> None:
        pass  # wrk opens its connections as it starts: its first requests are the run's

    def go(self) -> None:
        self.cpu0 = _children_cpu()
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def finish(self) -> dict:
        out, _ = self.proc.communicate(timeout=120)
        line = next((ln for ln in out.splitlines() if ln.startswith("WRKJSON ")), None)
        if self.proc.returncode != 0 or line is None:
            raise RuntimeError(f"wrk failed (status {self.proc.returncode}):\n{out[-2000:]}")
        r = json.loads(line.removeprefix("WRKJSON "))
        return {"completed": r["completed"], "failures": r["failures"], "wall_s": r["wall_s"],
                "client_cpu_s": _children_cpu() - self.cpu0, "latency_ms": {"p50": r["p50_ms"], "p99": r["p99_ms"]}}

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _children_cpu() -> float:
    """CPU seconds of our children that have exited and been waited for (wrk's own, once it is done)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _cpu_by_role(state) -> dict[str, float]:
    """CPU seconds so far of the cluster's proxy (the first one), manager and instances."""
    out = {"proxy": 0.0, "manager": 0.0, "instances": 0.0}
    for p in state.procs:
        live = p.process()
        role = {"proxy": "proxy", "manager": "manager"}.get(p.name, "instances" if p.name.startswith("instance") else "")
        if live is not None and role:
            try:
                out[role] += sum(live.cpu_times()[:2])
            except psutil.NoSuchProcess:
                pass  # exited meanwhile: its share is lost, which the figures then understate
    return out


def _busy_cpu() -> float:
    """CPU seconds the whole machine spent busy (not idle, not waiting on I/O): who else ran shows here."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def short_rate(state, run_dir: Path, model: str, stream: bool, connections: int, clients: int, seconds: float,
               client: str) -> dict:
    """Back-to-back one-token requests through the first proxy for ``seconds``: requests/s and who spent
    the CPU (proxy, manager, instances, the client itself, the whole machine)."""
    body = _short_body(model, stream)
    if client == "wrk":
        runner = _Wrk(state.url, body, connections, clients, seconds, run_dir)
    else:
        runner = _PythonClients(state.url, body, connections, clients, seconds)
    try:
        runner.ready()
        cpu0, busy0, t0 = _cpu_by_role(state), _busy_cpu(), time.perf_counter()
        runner.go()
        r = runner.finish()
        wall = time.perf_counter() - t0
        cpu, busy = _cpu_by_role(state), _busy_cpu() - busy0
    finally:
        runner.kill()
    done = max(r["completed"], 1)
    client_cores = r["client_cpu_s"] / wall
    return {
        "stream": stream, "requests": r["completed"], "failures": r["failures"],
        "requests_per_s": r["completed"] / r["wall_s"], "latency_ms": r["latency_ms"],
        "proxy_cpu_us_per_request": (cpu["proxy"] - cpu0["proxy"]) / done * 1e6,
        "proxy_cores": (cpu["proxy"] - cpu0["proxy"]) / wall,
        "manager_cores": (cpu["manager"] - cpu0["manager"]) / wall,
        "instance_cores": (cpu["instances"] - cpu0["instances"]) / wall,
        "client_cores": client_cores, "client_parallelism": runner.parallelism,
        # a client using ~all the cores it may run on is at its limit: the rate is then the client's
        "client_saturated": client_cores >= 0.9 * runner.parallelism,
        "machine_busy_cores": busy / wall,
    }


def pick_client(client: str) -> str:
    """``auto``: wrk if it is installed (a C client leaves the proxy more of the cores), else ours."""
    if client == "auto":
        return "wrk" if shutil.which("wrk") else "python"
    if client not in ("wrk", "python"):
        raise ValueError(f"--short-client {client}: expected auto, wrk or python")
    if client == "wrk" and not shutil.which("wrk"):
        raise ValueError("--short-client wrk: wrk is not installed (apt-get install wrk), or use python")
    return client


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
    targets = [_host_port(urls[i % len(urls)]) for i in range(k)]
    conns = await asyncio.gather(*(_open(h, p) for h, p in targets))
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
            "ttft_ms": {"p50": _pct(ms, 50), "p99": _pct(ms, 99), "max": ms[-1]},
            "received_per_instance": got, "imbalance": max(got.values(), default=0) / mean if mean else None}


def start_cluster(run_dir: Path, instances: int, backend: str, sets: list[str], timeout_s: float = 60.0):
    """A throw-away local cluster for one benchmark; on failure, one line, exit 1, and no leftovers."""
    try:
        return localcluster.up(run_dir, instances, backend, 0, None, sets, timeout_s=timeout_s)
    except localcluster.ClusterError as exc:
        Console(stderr=True).print(f"llumnixctl: {exc}", markup=False)
        shutil.rmtree(run_dir, ignore_errors=True)
        raise typer.Exit(1) from None


@app.command()
def proxy(
    instances: Annotated[int, typer.Option(help="sim instances behind the proxy")] = 4,
    requests: Annotated[int, typer.Option(help="sequential requests for the latency comparison (0 = skip it)")] = 300,
    streams: Annotated[int, typer.Option(help="streams for the throughput run (0 = skip it)")] = 400,
    concurrency: Annotated[int, typer.Option(help="streams open at once")] = 64,
    tokens: Annotated[int, typer.Option(help="output tokens per stream")] = 256,
    short_seconds: Annotated[float, typer.Option(help="seconds of one-token requests per kind, streamed and not (0 = skip)")] = 5.0,
    short_connections: Annotated[int, typer.Option(help="keep-alive connections of the one-token run", min=1)] = 64,
    short_clients: Annotated[int, typer.Option(help="client processes (or wrk threads) of the one-token run", min=1)] = 2,
    short_client: Annotated[str, typer.Option(help="auto (wrk if installed), wrk or python")] = "auto",
    burst_requests: Annotated[int, typer.Option("--burst", help="simultaneous streams of the burst run, spread over the proxies (0 = skip)", min=0)] = 0,
    proxies: Annotated[int, typer.Option(help="proxies of the burst run's cluster", min=1)] = 1,
    burst_tokens: Annotated[int, typer.Option(help="output tokens per burst stream", min=1)] = 32,
    burst_seqs: Annotated[int, typer.Option(help="sim.max_num_seqs of the burst run's instances", min=1)] = 8,
    set_: Annotated[list[str] | None, typer.Option("--set", help="extra setting for every daemon: section.key=value (after the bench's own)")] = None,
    json_: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Proxy overhead: added time to first token, tokens/s and CPU per streamed token (sim, zero step time),
    one-token requests/s through one proxy; optionally a burst over several proxies (sim steps of real time)."""
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
    try:
        if requests or streams or short_seconds > 0:
            result |= _overhead_run(instances, requests, streams, concurrency, tokens, short_seconds,
                                    short_connections, short_clients, client, extra)
        if burst_requests:
            result["burst"] = _burst_run(instances, proxies, burst_requests, burst_tokens, burst_seqs, extra)
    except RuntimeError as exc:  # a client or the cluster failed mid-run (the cluster is stopped by then)
        Console(stderr=True).print(f"llumnixctl: bench proxy: {exc}", markup=False)
        raise typer.Exit(1) from None
    if json_:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
        return
    _print_proxy(result)


def _overhead_run(instances: int, requests: int, streams: int, concurrency: int, tokens: int, short_seconds: float,
                  short_connections: int, short_clients: int, client: str, extra: list[str]) -> dict:
    """The zero-step-time cluster with one proxy: TTFT direct vs proxied, streamed tokens/s, one-token rate."""
    run_dir = Path(tempfile.mkdtemp(prefix="llumnix-bench-"))
    sets = ["sim.time_scale=0", "sim.max_num_seqs=256", "proxy.log_level=warning", "instance.log_level=warning"] + extra
    state = start_cluster(run_dir, instances, "sim", sets)
    out: dict = {}
    try:
        if requests:
            out |= _ttft_comparison(state, requests)
        if streams:
            out |= _throughput(state, streams, concurrency, tokens)
        if short_seconds > 0:
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
    return {"direct_ttft_ms": {"p50": _pct(direct, 50) * 1e3, "p99": _pct(direct, 99) * 1e3},
            "proxy_ttft_ms": {"p50": _pct(via, 50) * 1e3, "p99": _pct(via, 99) * 1e3},
            "added_ttft_ms_p50": (statistics.median(via) - statistics.median(direct)) * 1e3}


def _throughput(state, streams: int, concurrency: int, tokens: int) -> dict:
    proxy_proc = next(p for p in state.procs if p.name == "proxy").process()
    cpu0 = sum(proxy_proc.cpu_times()[:2])
    t0 = time.perf_counter()
    total = asyncio.run(_load(state.url, "llumnix-sim", streams, concurrency, tokens))
    wall = time.perf_counter() - t0
    cpu = sum(proxy_proc.cpu_times()[:2]) - cpu0
    return {"tokens": total, "tokens_per_s": total / wall, "proxy_cpu_us_per_token": cpu / max(total, 1) * 1e6}


def _burst_run(instances: int, proxies: int, k: int, tokens: int, seqs: int, extra: list[str]) -> dict:
    """A cluster of ``proxies`` proxies whose sim steps take model time (sim.time_scale as set, 1 by default),
    batches of ``seqs``: a burst that herds onto few instances queues there, and its TTFT shows it."""
    run_dir = Path(tempfile.mkdtemp(prefix="llumnix-bench-"))
    sets = [f"sim.max_num_seqs={seqs}", "proxy.log_level=warning", "instance.log_level=warning"] + extra
    try:
        state = localcluster.up(run_dir, instances, "sim", 0, None, sets, timeout_s=120, proxies=proxies)
    except localcluster.ClusterError as exc:
        Console(stderr=True).print(f"llumnixctl: {exc}", markup=False)
        shutil.rmtree(run_dir, ignore_errors=True)
        raise typer.Exit(1) from None
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
app.command("overload")(bench_overload.command)
