"""``llumnixctl bench steady``: the cluster on a busy host, side by side with a plain router.

The same bursty trace (Gamma arrivals) is replayed (``bench serve``) against two vLLM instances behind our proxy
and, with ``--router``, against two vLLM ``api_server``s (same model, KV size and batch) behind a plain router
(``vllm-router``, round robin), in interleaved rounds. Per round and system: failed requests and their first
error, TTFT, and for ours the instances marked dead, failovers, refusals and the llumlets' heartbeat lateness
(P99 and the largest bucket reached), the llumlets' query answer times, and what an operator sees meanwhile:
``llumnixctl requests`` every half second, its round-trip times and answers that left an instance out. The engines share the host's
cores with everything else, which is the point: a saturated 2-core machine.

With ``--smg`` the SGLang model gateway (``cache_aware``, its default) runs the same rounds in front of the same
kind of api_servers; with ``--slo-ttft-ms``/``--slo-tpot-ms`` our cluster serves to the targets ([slo]) and every
system's goodput, attainment, refusals and broken streams are judged against them (the issue's saturating-trace
comparison). Every system gets the same text prompts, since smg takes no token ids.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from llumnixctl.experiments.bench import engine as bench_engine
from llumnixctl.experiments.bench.budget import (DEFAULT_BUDGET_S, Budget, BudgetOpt, JsonOpt, Progress, Rounds,
                                                 ModelOpt, SaveOpt, SmgOpt, skipped_lines)
from llumnixctl.experiments.traces import files as traces, gen as trace_mod, mix as tracemix
from llumnixctl.lab import localcluster
from llumnixctl.lab.scratch import scratch_dir

BYTES_PER_TOKEN = 1024  # the tiny model's KV: 2 layers x (K, V) x 2 heads x 64 x bf16


def _serve(url: str, trace: Path, extra: list[str]) -> dict:
    """``bench serve --json`` in a child process (its own interpreter: the client's CPU is not ours)."""
    argv = [sys.executable, "-m", "llumnixctl.main", "bench", "serve", "--url", url, "--trace", str(trace), "--json",
            "--request-timeout", "600", *extra]
    out = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if not out.stdout.strip():
        raise RuntimeError(f"bench serve failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout)


class OperatorProbe(threading.Thread):
    """``llumnixctl requests`` every ``every`` seconds while the trace runs: how long an operator waits for the
    cluster's request list when every instance is saturated, and how many answers left an instance out (the
    manager asks every instance; a llumlet answers between two engine steps)."""

    def __init__(self, manager: str, every: float = 0.5, timeout_s: float = 30.0):
        super().__init__(name="operator-probe", daemon=True)
        self.manager, self.every, self.timeout_s = manager, every, timeout_s
        self.ms: list[float] = []
        self.incomplete = 0  # answers naming an unreachable instance
        self.failed = 0  # no answer from the manager in timeout_s
        self.done = threading.Event()

    def run(self) -> None:
        from llumnixctl.admin import AdminClient, ManagerUnreachable

        client = AdminClient(self.manager, timeout_s=self.timeout_s)
        try:
            while not self.done.wait(self.every):
                t0 = time.monotonic()
                try:
                    reply = client.requests()
                except ManagerUnreachable:
                    self.failed += 1
                    continue
                self.ms.append((time.monotonic() - t0) * 1000)
                self.incomplete += bool(reply.unreachable)
        finally:
            client.close()

    def summary(self) -> dict:
        ms = sorted(self.ms)

        def q(f: float) -> float | None:
            return round(ms[min(len(ms) - 1, int(f * len(ms)))], 1) if ms else None

        return {"count": len(ms), "p50_ms": q(0.5), "p99_ms": q(0.99), "max_ms": q(1.0),
                "incomplete": self.incomplete, "failed": self.failed}


def _summary(system: str, rnd: int, res: dict) -> dict:
    errors = sorted({e for e in res.get("errors", []) if e})
    row = {"system": system, "round": rnd, "completed": res["completed"], "failed": res["failed"],
           "first_error": errors[0][:300] if errors else "", "duration_s": res["duration"],
           "mean_ttft_ms": res["mean_ttft_ms"], "p99_ttft_ms": res["p99_ttft_ms"], "p99_e2el_ms": res["p99_e2el_ms"]}
    slo = res.get("slo")
    if slo is not None:  # refused at admission (429 with Retry-After) is not a failure; a broken stream is
        counts = {k: sum(c[k] for c in slo["classes"].values()) for k in ("met", "refused", "gave_up", "failed")}
        row.update(goodput_rps=slo["goodput_rps"], attainment=slo["attainment"], met=counts["met"],
                   slo_refused=counts["refused"] + counts["gave_up"], broken=counts["failed"],
                   p99_tpot_ms=res.get("p99_tpot_ms"))
    st = res.get("steadiness")
    if st is not None:
        beats = st["heartbeat_lateness_ms"].values()
        queries = st["query_ms"].values()
        row.update(instances_dead=st["instances_dead"], failovers=st["proxy_failovers"], refused=st["proxy_rejected"],
                   heartbeat_p99_ms=max((v["p99_ms"] for v in beats), default=None),
                   heartbeat_max_ms=max((v["max_ms"] for v in beats), default=None),
                   query_p99_ms=max((v["p99_ms"] for v in queries), default=None),
                   preemptions=res.get("preemptions"), migrations=res.get("migrations"))
    if "operator_requests" in res:
        row["operator_requests"] = res["operator_requests"]
    return row


def ours(model: Path, run_dir: Path, trace: Path, kv_bytes: int, max_num_seqs: int, sets: list[str],
         serve_args: list[str]) -> dict:
    state = localcluster.up(run_dir, 2, "vllm", 0, None,
                            [f"model.path={model}", "model.name=bench", f"vllm.kv_cache_bytes={kv_bytes}",
                             f"vllm.max_num_seqs={max_num_seqs}", "instance.log_level=warning", *sets], timeout_s=300)
    probe = OperatorProbe(state.manager_address)
    try:
        probe.start()
        res = _serve(state.url, trace, ["--run-dir", str(run_dir), *serve_args])
        probe.done.set()
        probe.join(probe.timeout_s + 5)
        res["operator_requests"] = probe.summary()
        return res
    finally:
        probe.done.set()
        localcluster.stop(state)


def plain_router(router: str, model: Path, run_dir: Path, trace: Path, kv_bytes: int, max_num_seqs: int,
                 serve_args: list[str], policy: str = "round_robin") -> dict:
    """Two api_servers behind ``router`` (vllm-router, or smg: its ``launch`` command) with its ``policy``."""
    vllm = {"max_num_seqs": max_num_seqs, "kv_cache_bytes": kv_bytes, "block_size": 128}
    servers = []
    router_proc = None
    try:
        for k in range(2):
            d = run_dir / f"api{k}"
            d.mkdir(parents=True, exist_ok=True)
            servers.append(bench_engine.start_api_server(model, vllm, d))
        port = localcluster.free_port()
        url = f"http://127.0.0.1:{port}"
        router_proc = bench_engine.start_router(bench_engine.router_argv(router, port, policy, [u for _, u in servers]),
                                                url, run_dir / "router.log")
        return _serve(url, trace, ["--model", "bench", *serve_args])
    finally:
        if router_proc is not None:
            bench_engine.stop_api_server(router_proc)  # by pid, then its children
        for proc, _ in servers:
            bench_engine.stop_api_server(proc)


def command(
    requests: Annotated[int, typer.Option(help="requests per round", min=1)] = 300,
    rate: Annotated[float, typer.Option(help="mean arrival rate, requests/s", min=0.01)] = 4.0,
    cv: Annotated[float, typer.Option(help="Gamma arrivals' coefficient of variation (burstiness)", min=0.1)] = 4.0,
    prompt_max: Annotated[int, typer.Option(help="longest prompt, tokens")] = 2048,
    output_max: Annotated[int, typer.Option(help="longest output, tokens")] = 1024,
    kv_tokens: Annotated[int, typer.Option(help="KV cache of each engine, in tokens", min=4096)] = 4096,
    max_num_seqs: Annotated[int, typer.Option(help="batch size of each engine", min=1)] = 64,
    rounds: Annotated[int, typer.Option(help="interleaved rounds", min=1)] = 3,
    router: Annotated[Optional[str], typer.Option(help="a plain router to compare with: the vllm-router binary "
                                                       "(pip install vllm-router, in a venv of its own)")] = None,
    smg: SmgOpt = None,
    slo_ttft_ms: Annotated[float, typer.Option(help="TTFT target, ms: set on our cluster (admission by predicted TTFT) and "
                                                     "every system's goodput (requests/s that met every target), "
                                                     "attainment and refusals reported against it (0: none)", min=0.0)] = 0.0,
    slo_tpot_ms: Annotated[float, typer.Option(help="TPOT target, ms, as --slo-ttft-ms (0: none)", min=0.0)] = 0.0,
    model: ModelOpt = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="a setting for our cluster: section.key=value")] = None,
    seed: Annotated[int, typer.Option(help="trace seed (round k uses seed + k)")] = 0,
    save: SaveOpt = None,
    json_: JsonOpt = False,
    budget_s: BudgetOpt = DEFAULT_BUDGET_S,
) -> None:
    """Our cluster on a saturated host against a plain router (and smg's cache_aware), same engines and trace:
    failures, deaths, lateness; with --slo-ttft-ms, goodput. A system's round that would not fit in --budget-s is
    skipped (--json: skipped)."""
    budget = Budget(budget_s)
    from llumnixctl.lab.model import write_tiny_model

    def interrupted(*_):
        raise KeyboardInterrupt  # SIGTERM too stops the servers started so far (the finally blocks below)

    signal.signal(signal.SIGTERM, interrupted)
    err = Console(stderr=True)
    work = scratch_dir("llumnix-steady-")
    path = (model or write_tiny_model(work / "tiny-llama")).resolve()
    kv_bytes = (kv_tokens + 128) * BYTES_PER_TOKEN  # vLLM keeps one block of 128 tokens back (its null block)
    # Every system gets the same text prompts (smg takes no token ids) and is judged by the same targets.
    serve_args = ["--text-prompts", "--tokenizer", str(path)]
    sets = list(set_ or [])
    for key, ms in (("slo.ttft_ms", slo_ttft_ms), ("slo.tpot_ms", slo_tpot_ms)):
        if ms:
            serve_args += [f"--{key.replace('.', '-').replace('_', '-')}", f"{ms:g}"]
            if not any(s.startswith(key + "=") for s in sets):
                sets.append(f"{key}={ms:g}")
    rows = []
    progress = Progress(rounds * (1 + bool(router) + bool(smg)), start=budget.t0)
    rounds_ = Rounds(budget, progress)
    try:
        for k in range(rounds):
            reqs = trace_mod.generate(requests, rate=rate, arrival="gamma", cv=cv, prompt=(16, prompt_max),
                                      output=(16, output_max), alpha=1.0, seed=seed + k)
            reqs = tracemix.clip(reqs, kv_tokens)
            tfile = work / f"trace{k}.jsonl"
            traces.save_jsonl(reqs, tfile)
            systems = [("llumnix", lambda d: ours(path, d, tfile, kv_bytes, max_num_seqs, sets, serve_args))]
            if router:
                systems.append(("plain router", lambda d: plain_router(router, path, d, tfile, kv_bytes, max_num_seqs,
                                                                       serve_args)))
            if smg:
                systems.append(("smg", lambda d: plain_router(smg, path, d, tfile, kv_bytes, max_num_seqs,
                                                              serve_args, "cache_aware")))
            if k % 2:
                systems.reverse()  # interleaved: no system always runs first
            if not rounds_.begin([({"round": k + 1, "system": name}, f"round {k + 1}/{rounds}: {name}", name)
                                  for name, _ in systems]):
                continue
            for name, run in systems:
                if not rounds_.start({"round": k + 1, "system": name}, f"round {k + 1}/{rounds}: {name}", name):
                    continue
                err.print(f"round {k + 1}/{rounds}: {name} ...")
                d = work / f"r{k}-{name.replace(' ', '-')}"
                d.mkdir()
                rows.append(_summary(name, k + 1, run(d)))
                rounds_.done(name)
                err.print(json.dumps(rows[-1]))
    finally:
        progress.close()
        shutil.rmtree(work, ignore_errors=True)
    res = {"requests": requests, "rate": rate, "cv": cv, "kv_tokens": kv_tokens, "max_num_seqs": max_num_seqs,
           "slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms, "cores": os.cpu_count(), "rounds": rows,
           **budget.fields()}
    if save is not None:
        save.write_text(json.dumps(res, indent=2) + "\n")
    if json_:
        sys.stdout.write(json.dumps(res, indent=2) + "\n")
        return
    table = Table(title=f"{requests} requests, Gamma CV {cv:g} at {rate:g}/s, KV {kv_tokens} tokens per engine")
    for col in ("round", "system", "failed", "dead", "failovers", "refused", "heartbeat P99/max ms", "query P99 ms",
                "llumnixctl requests P99/max ms", "mean TTFT ms", "P99 TTFT ms"):
        table.add_column(col)
    slo = slo_ttft_ms or slo_tpot_ms
    if slo:
        for col in ("met", "refused (429)", "broken", "goodput req/s", "attainment"):
            table.add_column(col)
    for r in rows:
        ours_ = "heartbeat_p99_ms" in r
        judged = [str(r["met"]), str(r["slo_refused"]), str(r["broken"]), f"{r['goodput_rps']:g}",
                  f"{r['attainment']:g}" if r["attainment"] is not None else "-"] if slo else []
        table.add_row(str(r["round"]), r["system"], str(r["failed"]),
                      str(len(r["instances_dead"])) if ours_ else "", f"{r['failovers']:g}" if ours_ else "",
                      f"{r['refused']:g}" if ours_ else "",
                      f"{r['heartbeat_p99_ms']:g}/{r['heartbeat_max_ms']:g}" if ours_ and r["heartbeat_p99_ms"] else "",
                      f"{r['query_p99_ms']:g}" if ours_ and r.get("query_p99_ms") else "",
                      (f"{op['p99_ms']:g}/{op['max_ms']:g}" + (f" ({op['incomplete']} incomplete)" if op["incomplete"] else "")
                       if (op := r.get("operator_requests")) and op["count"] else ""),
                      f"{r['mean_ttft_ms']:.0f}", f"{r['p99_ttft_ms']:.0f}", *judged)
    Console().print(table)
    for line in skipped_lines(res["skipped"], lambda s: f"{s['system']} round {s['round']}"):
        Console().print(line, markup=False)
