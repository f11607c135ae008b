"""``llumnixctl bench cache``: prefix-cache-aware routing side by side, on vLLM engines with prefix caching.

The same traces go, in interleaved rounds, to N vLLM engines (the tiny model unless --model; prefix
caching on in every engine; the same KV size, block size and batch) behind:

- ``llumnix-cache``: our cluster with ``manager.dispatch_policy = llumnix-cache`` (the instances publish
  vLLM's cache events; the proxy dispatches by the cluster prefix index and virtual usage);
- ``llumnix``: our cluster, cache-blind;
- ``smg`` / ``vllm-router``: the SGLang model gateway / vllm-router with their ``cache_aware`` policy in
  front of vLLM's own ``api_server``s (each from its own venv: --smg, --vllm-router).

Traces (llumnixctl/experiments/traces/cache.py): ``shared-prefix`` (24 system prompts of 384 tokens, zipf
popularity; together about twice one engine's KV at the default 4096 tokens), ``multi-turn`` (sessions that
resend their history, a closed loop per session) and ``hotspot`` (one system prompt is 80% of the
requests). Prompts are text of single-token words, so a router that hashes text and one that hashes
tokens see the same sharing. Per round and system: failed requests, TTFT (mean, P99), the engines' own
prefix-cache hit rate (vLLM's counters: ``vllm:prefix_cache_*`` on an api_server, our instances' copies of
them), and the largest share of the running requests any one engine held (sampled twice a second).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Callable, Optional

import httpx
import typer

from llumnixctl.experiments.bench import engine as bench_engine, serve as bench_serve
from llumnixctl.experiments.bench.budget import (DEFAULT_BUDGET_S, Budget, BudgetOpt, JsonOpt, Progress, Rounds,
                                                 ModelOpt, SaveOpt, SmgOpt, VllmRouterOpt, skipped_lines)
from llumnixctl.experiments.traces import cache as tracecache
from llumnixctl.experiments.traces.words import Words
from llumnixctl.experiments.bench.serve_figures import stats_ms, tpot_s
from llumnixctl.lab import localcluster
from llumnixctl.lab.scratch import scratch_dir

SYSTEMS = ("llumnix-cache", "llumnix", "smg", "vllm-router")
TRACES = ("shared-prefix", "multi-turn", "hotspot")
BYTES_PER_TOKEN = 1024  # the tiny model's KV: 2 layers x (K, V) x 2 heads x 64 x bf16
def make_trace(kind: str, n: int, rate: float, seed: int) -> list:
    if kind in ("shared-prefix", "hotspot"):
        return tracecache.shared_prefix(n, rate=rate, prefixes=24, prefix_tokens=384, skew=1.0,
                                        hot=0.8 if kind == "hotspot" else 0.0, suffix=(16, 128), output=(16, 128),
                                        seed=seed)
    if kind == "multi-turn":
        return tracecache.multi_turn(n, rate=rate, turns=(2, 6), system_prompts=8, system_tokens=256,
                                     message=(16, 96), reply=(16, 128), think=2.0, max_context=2048, seed=seed)
    raise ValueError(f"unknown trace {kind!r} (known: {', '.join(TRACES)})")


class Shares(threading.Thread):
    """Twice a second: each engine's running requests (a gauge on its /metrics), and the busiest one's share
    of them whenever at least 4 run: its largest, and its mean over those samples (weighted by how many ran)."""

    def __init__(self, addresses: list[str], gauge: str):
        super().__init__(daemon=True)
        self.addresses, self.gauge = addresses, gauge
        self.worst = 0.0
        self.busiest = self.total = 0.0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            running = [bench_serve._scrape(a).get(self.gauge, 0.0) for a in self.addresses]
            if sum(running) >= 4:
                self.worst = max(self.worst, max(running) / sum(running))
                self.busiest += max(running)
                self.total += sum(running)

    def mean(self) -> float | None:
        return round(self.busiest / self.total, 3) if self.total else None


def _hits(addresses: list[str], queried: str, hit: str) -> dict:
    q = h = 0.0
    for a in addresses:
        m = bench_serve._scrape(a)
        q += m.get(queried, 0.0)
        h += m.get(hit, 0.0)
    return {"queried_tokens": q, "hit_tokens": h, "hit_rate": h / q if q else None}


class Send:
    """What the client sends for a trace request: a streamed completion of its prompt (text of single-token
    words, or with no ``words`` the token ids themselves, for an engine without a tokenizer), ``fields(req)``
    added to the body and ``headers(req)`` as its headers (a session's key, for ``bench sessions``)."""

    def __init__(self, words: "Words | None", fields: Callable[[object], dict] | None = None,
                 headers: Callable[[object], dict] | None = None):
        self.words, self._fields, self.headers = words, fields, headers

    def body(self, req) -> dict:
        prompt = self.words.text(req) if self.words is not None else tracecache.prompt_ids(req, VOCAB, 3)
        return {"model": "bench", "prompt": prompt, "max_tokens": req.output_tokens, "ignore_eos": True,
                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
                **(self._fields(req) if self._fields is not None else {})}


VOCAB = 32000  # token-id prompts (an engine without a tokenizer: sim) are drawn from [3, VOCAB)


def _replay(url: str, reqs: list, send: Send, addresses: list[str], gauge: str) -> dict:
    shares = Shares(addresses, gauge)
    shares.start()
    try:
        results, duration = asyncio.run(bench_serve.replay(url, reqs, send.body, timeout_s=600.0,
                                                           headers_of=send.headers))
    finally:
        shares.stop.set()
        shares.join(5)
    ok = [r for r in results if r["error"] is None]
    errors = sorted({r["error"][:200] for r in results if r["error"]})
    ttft = stats_ms([r["times"][0] for r in ok]) if ok else {}
    tpots = [t for t in (tpot_s(r) for r in ok) if t is not None]
    lead = sorted(r["prompt_tokens"] - q.prompt_tokens for q, r in zip(reqs, results)
                  if r["error"] is None and r["prompt_tokens"] is not None)
    return {"completed": len(ok), "failed": len(results) - len(ok), "first_error": errors[0] if errors else "",
            "duration_s": duration, "mean_ttft_ms": ttft.get("mean"), "p50_ttft_ms": ttft.get("median"),
            "p99_ttft_ms": ttft.get("p99"), "mean_tpot_ms": stats_ms(tpots)["mean"] if tpots else None,
            "max_running_share": round(shares.worst, 3),
            "mean_running_share": shares.mean(), "prompt_lead_tokens": lead[len(lead) // 2] if lead else 0}


class Restart(threading.Thread):
    """Half way through the trace: kill -9 the daemon ``name`` (proxy or manager) and start it again with the
    same command line; the instances' hit counters are read when it is killed and one heartbeat after it is
    back, so that the hit rate before and after can be told apart."""

    def __init__(self, state, run_dir: Path, name: str, at_s: float, addresses: list[str], url: str):
        super().__init__(daemon=True)
        self.state, self.run_dir, self.name, self.at_s = state, run_dir, name, at_s
        self.addresses, self.url = addresses, url
        self.marks: dict = {}
        self.stop = threading.Event()

    def counters(self) -> dict:
        return _hits(self.addresses, "llumnix_instance_prefix_cache_queried_tokens_total",
                     "llumnix_instance_prefix_cache_hit_tokens_total")

    def run(self) -> None:
        import psutil

        if self.stop.wait(self.at_s):
            return
        old = next(p for p in self.state.procs if p.name == self.name and p.process() is not None)
        self.marks["killed"] = self.counters()
        t = time.monotonic()
        old.process().kill()
        try:
            psutil.Process(old.pid).wait(10)
        except psutil.Error:
            pass
        new = localcluster.spawn(self.run_dir, self.name, old.argv)
        localcluster.record(self.run_dir, self.state, [new])
        while self.name == "proxy" and time.monotonic() - t < 60:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.marks["down_s"] = time.monotonic() - t
        time.sleep(0.5)  # one heartbeat interval (manager.heartbeat_interval_s)
        self.marks["relearned"] = self.counters()

    def figures(self, end: dict) -> dict:
        k, r = self.marks.get("killed"), self.marks.get("relearned")
        if not k or not r:
            return {"restarted": self.name, "error": "the restart did not happen before the trace ended"}

        def rate(a: dict, b: dict) -> float | None:
            q = b["queried_tokens"] - a["queried_tokens"]
            return (b["hit_tokens"] - a["hit_tokens"]) / q if q else None

        zero = {"queried_tokens": 0.0, "hit_tokens": 0.0}
        return {"restarted": self.name, "down_s": round(self.marks["down_s"], 2),
                "hit_rate_before": rate(zero, k), "hit_rate_after": rate(r, end)}


def vllm_sets(model: Path, vllm: dict) -> list[str]:
    """Our instances' settings for vLLM engines configured as ``vllm`` (the peers' api_servers get the same)."""
    return [f"model.path={model}", "model.name=bench", f"vllm.kv_cache_bytes={vllm['kv_cache_bytes']}",
            f"vllm.max_num_seqs={vllm['max_num_seqs']}", f"vllm.block_size={vllm['block_size']}",
            "vllm.enable_prefix_caching=true"]


def ours(policy: str, model: Path | None, run_dir: Path, reqs: list, send: Send, n: int, vllm: dict,
         restart: str | None = None, *, backend: str = "vllm", sets: list[str] = (),
         after: Callable[[list[str], str], dict] | None = None, place: localcluster.Placement | None = None) -> dict:
    """Our cluster of ``n`` instances (``backend`` vllm: configured as ``vllm``; sim: by ``sets``), dispatching by
    ``policy``, with ``sets`` last (and ``place``'s settings per daemon: localcluster.up); the trace replayed with
    ``send``; ``after(addresses, url)``: figures of the instances' /metrics (and the proxy's at ``url``) once it
    ended (merged into the result)."""
    from llumnixctl.admin import AdminClient

    base = vllm_sets(model, vllm) if backend == "vllm" else ["model.name=bench"]
    state = localcluster.up(run_dir, n, backend, 0, None,
                            [*base, f"manager.dispatch_policy={policy}", "instance.log_level=warning",
                             "proxy.log_level=warning", *sets], timeout_s=300, place=place)
    try:
        snap = AdminClient(state.manager_address).status()
        addresses = [v.metrics_address for v in snap.instances if v.metrics_address]
        chaos = Restart(state, run_dir, restart, reqs[-1].arrival_s / 2, addresses, state.url) if restart else None
        if chaos is not None:
            chaos.start()
        res = _replay(state.url, reqs, send, addresses, "llumnix_instance_running_requests")
        time.sleep(1.5)  # the instances' counters are copied from the engines at each load report
        res["prefix_cache"] = _hits(addresses, "llumnix_instance_prefix_cache_queried_tokens_total",
                                    "llumnix_instance_prefix_cache_hit_tokens_total")
        if after is not None:
            res.update(after(addresses, state.url))
        if chaos is not None:
            chaos.stop.set()
            chaos.join(90)
            res["restart"] = chaos.figures(res["prefix_cache"])
        return res
    finally:
        localcluster.stop(state)


def peer(binary: str, model: Path, run_dir: Path, reqs: list, send: Send, n: int, vllm: dict,
         *, policy: str = "cache_aware", after: Callable[[list[str], str], dict] | None = None) -> dict:
    """``n`` vLLM api_servers configured as ``vllm`` (prefix caching on) behind the router ``binary`` (smg,
    vllm-router) with its ``policy``; the trace replayed with ``send``; ``after(urls, router_url)``: figures of
    the servers' /metrics once it ended."""
    from concurrent.futures import ThreadPoolExecutor


    servers, router = [], None

    def start(k: int):
        d = run_dir / f"api{k}"
        d.mkdir(parents=True, exist_ok=True)
        return bench_engine.start_api_server(model, {**vllm, "enable_prefix_caching": True}, d)

    try:
        with ThreadPoolExecutor(n) as pool:  # together, as our cluster's instances start
            futures = [pool.submit(start, k) for k in range(n)]
        for f in futures:
            if f.exception() is None:
                servers.append(f.result())
        for f in futures:
            if f.exception() is not None:
                raise f.exception()
        port = localcluster.free_port()
        url = f"http://127.0.0.1:{port}"
        router = bench_engine.start_router(bench_engine.router_argv(binary, port, policy, [u for _, u in servers]),
                                           url, run_dir / "router.log")
        addresses = [u for _, u in servers]
        res = _replay(url, reqs, send, addresses, "vllm:num_requests_running")
        res["prefix_cache"] = _hits(addresses, "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
        if after is not None:
            res.update(after(addresses, url))
        return res
    finally:
        if router is not None:
            bench_engine.stop_api_server(router)
        for proc, _ in servers:
            bench_engine.stop_api_server(proc)


def command(
    requests: Annotated[int, typer.Option(help="requests per trace and round", min=1)] = 300,
    rate: Annotated[float, typer.Option(help="mean arrival rate, requests/s (multi-turn: nominal)", min=0.01)] = 4.0,
    instances: Annotated[int, typer.Option(help="engines per system", min=1)] = 4,
    kv_tokens: Annotated[int, typer.Option(help="KV cache of each engine, in tokens", min=2048)] = 4096,
    max_num_seqs: Annotated[int, typer.Option(help="batch size of each engine", min=1)] = 32,
    rounds: Annotated[int, typer.Option(help="interleaved rounds", min=1)] = 3,
    traces: Annotated[str, typer.Option(help="comma-separated: shared-prefix, multi-turn, hotspot")] = "shared-prefix,multi-turn",
    systems: Annotated[str, typer.Option(help="comma-separated: llumnix-cache, llumnix, smg, vllm-router")] = "llumnix-cache,llumnix,smg,vllm-router",
    restart: Annotated[Optional[str], typer.Option(metavar="proxy|manager", help="kill -9 and restart this daemon of our llumnix-cache cluster half way through each trace: hit rates before and after")] = None,
    smg: SmgOpt = None,
    vllm_router: VllmRouterOpt = None,
    model: ModelOpt = None,
    seed: Annotated[int, typer.Option(help="trace seed (round k uses seed + k)")] = 0,
    save: SaveOpt = None,
    json_: JsonOpt = False,
    budget_s: BudgetOpt = DEFAULT_BUDGET_S,
) -> None:
    """Prefix-cache-aware routing on vLLM engines: ours (cache-aware and cache-blind) vs smg and vllm-router cache_aware.
    A system's run of a trace that would not fit in --budget-s is skipped (--json: skipped)."""
    budget = Budget(budget_s)
    from llumnixctl.lab.model import write_tiny_model

    def interrupted(*_):
        raise KeyboardInterrupt  # SIGTERM too stops what was started (the finally blocks)

    signal.signal(signal.SIGTERM, interrupted)
    names = [s for s in systems.split(",") if s]
    kinds = [t for t in traces.split(",") if t]
    for s in names:
        if s not in SYSTEMS:
            raise typer.BadParameter(f"unknown system {s!r} (known: {', '.join(SYSTEMS)})")
        if (s == "smg" and not smg) or (s == "vllm-router" and not vllm_router):
            raise typer.BadParameter(f"--systems has {s}: give its binary with --{s}")
    if restart not in (None, "proxy", "manager"):
        raise typer.BadParameter(f"--restart takes proxy or manager, not {restart!r}")
    for t in kinds:
        if t not in TRACES:
            raise typer.BadParameter(f"unknown trace {t!r} (known: {', '.join(TRACES)})")
    work = scratch_dir("llumnix-bench-cache-")
    path = (model or write_tiny_model(work / "tiny-llama")).resolve()
    words = Words(path)
    vllm = {"max_num_seqs": max_num_seqs, "kv_cache_bytes": (kv_tokens + 128) * BYTES_PER_TOKEN, "block_size": 128}
    rows = []
    progress = Progress(rounds * len(kinds) * len(names), start=budget.t0)
    rounds_ = Rounds(budget, progress)
    try:
        for k in range(rounds):
            if not rounds_.begin([({"round": k + 1, "trace": kind, "system": name},
                                   f"round {k + 1}/{rounds}, {kind}: {name}", (kind, name))
                                  for kind in kinds for name in (names if k % 2 == 0 else list(reversed(names)))]):
                continue
            for kind in kinds:
                reqs = make_trace(kind, requests, rate, seed + k)
                order = names if k % 2 == 0 else list(reversed(names))  # interleaved: nobody always first
                for name in order:
                    if not rounds_.start({"round": k + 1, "trace": kind, "system": name},
                                         f"round {k + 1}/{rounds}, {kind}: {name}", (kind, name)):
                        continue
                    d = work / f"r{k}-{kind}-{name}"
                    d.mkdir()
                    sys.stderr.write(f"round {k + 1}/{rounds}, {kind}: {name} ...\n")
                    if name in ("llumnix-cache", "llumnix"):
                        res = ours(name, path, d, reqs, Send(words), instances, vllm,
                                   restart if name == "llumnix-cache" else None)
                    else:
                        res = peer(smg if name == "smg" else vllm_router, path, d, reqs, Send(words), instances,
                                   vllm)
                    rows.append({"round": k + 1, "trace": kind, "system": name, **res})
                    rounds_.done((kind, name))
                    sys.stderr.write(json.dumps(rows[-1]) + "\n")
    finally:
        progress.close()
        shutil.rmtree(work, ignore_errors=True)
    res = {"requests": requests, "rate": rate, "instances": instances, "kv_tokens": kv_tokens,
           "max_num_seqs": max_num_seqs, "cores": os.cpu_count(), "rounds": rows, "summary": summarize(rows),
           **budget.fields()}
    if save is not None:
        save.write_text(json.dumps(res, indent=2) + "\n")
    sys.stdout.write(json.dumps(res if json_ else res["summary"], indent=2) + "\n")
    if not json_:
        for line in skipped_lines(res["skipped"], lambda s: f"{s['system']} on {s['trace']}, round {s['round']}"):
            sys.stderr.write(line + "\n")


def summarize(rows: list[dict]) -> dict:
    """Per trace and system: the median and range over rounds of P99 and mean TTFT, hit rate, failures."""
    out: dict = {}
    for r in rows:
        out.setdefault(r["trace"], {}).setdefault(r["system"], []).append(r)
    table: dict = {}
    for kind, systems in out.items():
        table[kind] = {}
        for name, rs in systems.items():
            def med(key, rs=rs):
                xs = sorted(x for x in (key(r) for r in rs) if x is not None)
                return {"median": xs[len(xs) // 2], "min": xs[0], "max": xs[-1]} if xs else None

            table[kind][name] = {"p99_ttft_ms": med(lambda r: r["p99_ttft_ms"]), "mean_ttft_ms": med(lambda r: r["mean_ttft_ms"]),
                                 "hit_rate": med(lambda r: r["prefix_cache"]["hit_rate"]),
                                 "max_running_share": med(lambda r: r["max_running_share"]),
                                 "mean_running_share": med(lambda r: r.get("mean_running_share")),
                                 "failed": sum(r["failed"] for r in rs), "rounds": len(rs)}
    return table
