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
import shutil
import subprocess
import socket
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Annotated

import psutil
import typer
import zmq
from rich.console import Console
from rich.table import Table

from daemons import runtime, wire
from llumnixctl import bench_manager, bench_migration, bench_policies, bench_serve, localcluster
from llumnixctl.admin import AdminClient

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


def _start(run_dir: Path, instances: int, backend: str, sets: list[str], timeout_s: float = 60.0):
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
    requests: Annotated[int, typer.Option(help="sequential requests for the latency comparison")] = 300,
    streams: Annotated[int, typer.Option(help="streams for the throughput run")] = 400,
    concurrency: Annotated[int, typer.Option(help="streams open at once")] = 64,
    tokens: Annotated[int, typer.Option(help="output tokens per stream")] = 256,
    json_: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Proxy overhead: added time to first token, tokens/s and CPU per streamed token (sim, zero step time)."""
    run_dir = Path(tempfile.mkdtemp(prefix="llumnix-bench-"))
    sets = ["sim.time_scale=0", "sim.max_num_seqs=256", "proxy.log_level=warning", "instance.log_level=warning"]
    state = _start(run_dir, instances, "sim", sets)
    try:
        snap = AdminClient(state.manager_address).status()
        prompt = list(range(100, 116))
        direct = direct_ttft(snap.instances[0].request_address, requests, prompt)
        via = proxy_ttft(state.url, "llumnix-sim", requests, prompt)
        proxy_proc = next(p for p in state.procs if p.name == "proxy").process()
        cpu0 = sum(proxy_proc.cpu_times()[:2])
        t0 = time.perf_counter()
        total = asyncio.run(_load(state.url, "llumnix-sim", streams, concurrency, tokens))
        wall = time.perf_counter() - t0
        cpu = sum(proxy_proc.cpu_times()[:2]) - cpu0
    finally:
        localcluster.stop(state)
        shutil.rmtree(run_dir, ignore_errors=True)
    result = {
        "instances": instances, "cores": psutil.cpu_count(),
        "direct_ttft_ms": {"p50": _pct(direct, 50) * 1e3, "p99": _pct(direct, 99) * 1e3},
        "proxy_ttft_ms": {"p50": _pct(via, 50) * 1e3, "p99": _pct(via, 99) * 1e3},
        "added_ttft_ms_p50": (statistics.median(via) - statistics.median(direct)) * 1e3,
        "streams": streams, "concurrency": concurrency, "tokens": total, "expected_tokens": streams * tokens,
        "tokens_per_s": total / wall, "proxy_cpu_us_per_token": cpu / max(total, 1) * 1e6,
    }
    if json_:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
        return
    table = Table(title=f"proxy overhead · {instances} sim instances (zero step time) · {result['cores']} cores")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("TTFT direct to instance p50 / p99", f"{result['direct_ttft_ms']['p50']:.3f} / {result['direct_ttft_ms']['p99']:.3f} ms")
    table.add_row("TTFT through proxy p50 / p99", f"{result['proxy_ttft_ms']['p50']:.3f} / {result['proxy_ttft_ms']['p99']:.3f} ms")
    table.add_row("added by proxy p50", f"{result['added_ttft_ms_p50']:.3f} ms")
    table.add_row(f"throughput ({streams} streams x {tokens} tokens, {concurrency} at once)", f"{result['tokens_per_s']:.0f} tokens/s")
    table.add_row("proxy CPU per streamed token", f"{result['proxy_cpu_us_per_token']:.1f} us")
    table.add_row("tokens received / expected", f"{total} / {streams * tokens}")
    Console().print(table)


# Offline vLLM in a child process: vLLM sets process-wide state (threads, seeds, torch.distributed).
_OFFLINE = r"""
import json, sys, time
from daemons.config import VllmConfig
from daemons.engine.vllm_internals import apply_workarounds
a = json.loads(sys.argv[1])
cfg = VllmConfig(**a["vllm"])
apply_workarounds(cfg)
from vllm import LLM, SamplingParams
t0 = time.perf_counter()
llm = LLM(model=a["model"], enforce_eager=True, dtype=cfg.dtype, block_size=cfg.block_size, seed=0,
          max_num_seqs=cfg.max_num_seqs, kv_cache_memory_bytes=cfg.kv_cache_bytes or None,
          enable_prefix_caching=cfg.enable_prefix_caching)
start = time.perf_counter() - t0
import os
def rate(n_req, n_tok):
    sp = SamplingParams(temperature=0, max_tokens=n_tok, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(a["prompt"])} for _ in range(n_req)]
    t, c = time.perf_counter(), os.times()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall, c2 = time.perf_counter() - t, os.times()
    return sum(len(o.outputs[0].token_ids) for o in outs) / wall, (c2.user + c2.system - c.user - c.system) / wall
rate(1, 8)
single, _ = rate(1, a["tokens"])
batched, cores = rate(a["batch"], a["batch_tokens"])
print(json.dumps({"start_s": start, "single": single, "batched": batched, "cores": cores}))
"""


@app.command()
def engine(
    model: Annotated[Path | None, typer.Option(help="checkpoint directory (default: a tiny random model)")] = None,
    tokens: Annotated[int, typer.Option(help="output tokens of the single stream")] = 256,
    batch: Annotated[int, typer.Option(help="concurrent streams of the batched run")] = 32,
    batch_tokens: Annotated[int, typer.Option(help="output tokens per batched stream")] = 256,
    json_: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """vLLM through the whole cluster (proxy, manager, one instance) against vLLM's own offline run."""
    from daemons.config import VllmConfig
    from llumnixctl.model import write_tiny_model

    run_dir = Path(tempfile.mkdtemp(prefix="llumnix-bench-"))
    path = model or write_tiny_model(run_dir / "tiny-llama")
    vcfg = VllmConfig(max_num_seqs=max(batch, 1), kv_cache_bytes=256 << 20)  # prefix caching off on both sides
    prompt = [5, 17, 300, 42, 7, 99, 12, 8]
    sets = [f"model.path={path.resolve()}", "model.name=bench", f"vllm.max_num_seqs={vcfg.max_num_seqs}",
            f"vllm.kv_cache_bytes={vcfg.kv_cache_bytes}", "instance.log_level=warning", "proxy.log_level=warning"]
    err = Console(stderr=True)
    err.print("offline vLLM run ...")
    args = {"model": str(path), "vllm": {"max_num_seqs": vcfg.max_num_seqs, "kv_cache_bytes": vcfg.kv_cache_bytes},
            "prompt": prompt, "tokens": tokens, "batch": batch, "batch_tokens": batch_tokens}
    child = subprocess.run([sys.executable, "-c", _OFFLINE, json.dumps(args)], capture_output=True, text=True)
    if child.returncode != 0:
        err.print(f"llumnixctl: the offline vLLM run failed:\n{child.stderr[-2000:]}", markup=False)
        raise typer.Exit(1)
    offline = json.loads(child.stdout.strip().splitlines()[-1])
    err.print("cluster run ...")
    t0 = time.perf_counter()
    state = _start(run_dir, 1, "vllm", sets, timeout_s=300)
    up_s = time.perf_counter() - t0
    try:
        asyncio.run(_load(state.url, "bench", 1, 1, 8, prompt, 0.0))  # warm-up
        t = time.perf_counter()
        single = asyncio.run(_load(state.url, "bench", 1, 1, tokens, prompt, 0.0)) / (time.perf_counter() - t)
        inst = next(p for p in state.procs if p.name.startswith("instance")).process()
        t, cpu = time.perf_counter(), sum(inst.cpu_times()[:2])
        batched_tokens = asyncio.run(_load(state.url, "bench", batch, batch, batch_tokens, prompt, 0.0))  # greedy, as offline
        wall = time.perf_counter() - t
        batched, cores = batched_tokens / wall, (sum(inst.cpu_times()[:2]) - cpu) / wall
        rss = inst.memory_info().rss
    finally:
        localcluster.stop(state)
        shutil.rmtree(run_dir, ignore_errors=True)
    result = {
        "offline_engine_start_s": offline["start_s"], "cluster_up_s": up_s, "instance_rss_mib": rss / 2**20,
        "single_stream_tokens_per_s": {"cluster": single, "offline": offline["single"], "ratio": single / offline["single"]},
        "batched_tokens_per_s": {"cluster": batched, "offline": offline["batched"], "ratio": batched / offline["batched"]},
        "batched_cores_used": {"instance": cores, "offline": offline["cores"]},
        "batch": batch, "tokens": tokens, "batch_tokens": batch_tokens, "model": str(model or "tiny (random)"),
    }
    if json_:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
        return
    table = Table(title=f"vLLM through the cluster vs offline · {psutil.cpu_count()} cores · model {result['model']}")
    for col in ("measure", "cluster", "offline vLLM", "ratio"):
        table.add_column(col, justify="left" if col == "measure" else "right")
    s, b = result["single_stream_tokens_per_s"], result["batched_tokens_per_s"]
    table.add_row(f"single stream ({tokens} tokens), tokens/s", f"{s['cluster']:.0f}", f"{s['offline']:.0f}", f"{s['ratio']:.2f}")
    table.add_row(f"batched ({batch} x {batch_tokens} tokens), tokens/s", f"{b['cluster']:.0f}", f"{b['offline']:.0f}", f"{b['ratio']:.2f}")
    table.add_row("start (cluster up / offline engine), s", f"{up_s:.1f}", f"{offline['start_s']:.1f}", "")
    table.add_row("cores busy during the batched run", f"{cores:.2f}", f"{offline['cores']:.2f}", "")
    table.add_row("instance RSS, MiB", f"{result['instance_rss_mib']:.0f}", "", "")
    Console().print(table)



app.command("migration")(bench_migration.command)
app.command("policies")(bench_policies.command)
app.command("serve")(bench_serve.command)
app.command("manager")(bench_manager.command)
