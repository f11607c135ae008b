"""``llumnixctl bench proxy``'s short requests (llumnixctl/experiments/bench/cli.py): requests/s through one proxy,
from Python client processes on keep-alive connections or from wrk, and the CPU each role spent."""

from __future__ import annotations

import asyncio
import json
import re
import resource
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from llumnixctl.stats import percentile


_USAGE = re.compile(rb'"completion_tokens":(\d+)')


SHORT_GOAL_RPS = 7500  # the rate issue #15 asks of one proxy
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length: *(\d+)", re.IGNORECASE)


def host_port(url: str) -> tuple[str, int]:
    """(host, port) of an http:// URL."""
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


async def open_nodelay(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A TCP connection with Nagle off (a request goes out as soon as it is written)."""
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
            reader, writer = await open_nodelay(host, port)
    writer.close()
    return failures


async def _short_client(args: dict) -> dict:
    """One client process: open its connections, say ready, wait for a line on stdin, run for the time."""
    host, port = args["host"], args["port"]
    request = _keep_alive_request(args["body"].encode())
    conns = await asyncio.gather(*(open_nodelay(host, port) for _ in range(args["connections"])))  # before the start
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
        host, port = host_port(url)
        self.procs = []
        for n in [n for n in _split(connections, procs) if n]:
            args = {"host": host, "port": port, "connections": n, "seconds": seconds, "body": body.decode()}
            self.procs.append(subprocess.Popen(
                [sys.executable, "-c", "from llumnixctl.experiments.bench.proxy_short import short_client_main; short_client_main()",
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
                "latency_ms": {"p50": percentile(latencies, 50, "nearest"), "p99": percentile(latencies, 99, "nearest")}}

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


# ---------------------------------------------------------------- streamed completions (bench proxy, bench engine)


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


async def stream_load(url: str, model: str, streams: int, concurrency: int, tokens: int,
                      prompt: str | list[int] = "benchmark the proxy", temperature: float = 1.0) -> int:
    """``streams`` streamed completions, ``concurrency`` at a time; the completion tokens their usage reports."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "stream": True,
                       "temperature": temperature, "stream_options": {"include_usage": True}}).encode()
    sem = asyncio.Semaphore(concurrency)

    async def one() -> int:
        async with sem:
            return await _stream_one(host, int(port), body)

    return sum(await asyncio.gather(*(one() for _ in range(streams))))
