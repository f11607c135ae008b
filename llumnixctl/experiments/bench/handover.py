"""``llumnixctl bench handover``: what a handover costs the client, per prompt length.

On a cluster of one prefill and one decode instance, one streamed request at a time with a prompt of each of
``--lengths`` tokens (``--repeat`` times each) prefills on the prefill instance and is handed over to the decode
instance at its first token (a live migration of reason "handover"). The client records every token's arrival;
the figures per length: TTFT, the longest gap between two tokens after the first (the handover's downtime as the
client sees it: the last stage's copy plus the steps around it) and the median gap (the decode step), and from
the cluster the handovers committed, the handover's time from its order to the commit
(``llumnix_instance_handover_seconds``), the migration's time and downtime (``llumnix_migration_seconds``,
``llumnix_migration_downtime_seconds``) and the gap the proxy measured (``llumnix_proxy_migration_gap_seconds``). With ``--baseline`` (the
default) the same requests also run on one mixed instance: its longest gap is what decoding alone gives.

--backend vllm uses the tiny random-weight model while the lengths fit its context (4096 tokens with the decode
tokens), else the KV-heavy one (context 16384, as ``bench migration``), unless --model-size or --model says.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Annotated, Optional

import httpx
import psutil
import typer
from rich.console import Console

from daemons.config import ConfigError, load_config
from llumnixctl.admin import AdminClient
from llumnixctl.experiments.bench import disagg_figures as figs
from llumnixctl.experiments.bench.budget import (DEFAULT_BUDGET_S, STOP_RESERVE_S, Budget, BudgetOpt, Progress, emit,
                                                 estimate)
from llumnixctl.experiments.bench.disagg import QUIET, VLLM_PATIENCE, Counters, Target, vocab_of, wait_idle
from llumnixctl.experiments.bench.serve import stream_completion
from llumnixctl.lab import localcluster
from llumnixctl.lab.scratch import scratch_dir

TINY_CONTEXT = 4096  # the tiny model's max_position_embeddings (llumnixctl/lab/model.py)
KV_HEAVY_BYTES_PER_TOKEN = 64 * 1024  # 32 layers x 8 KV heads x 64 x 2 (K, V) x 2 bytes
CLUSTERS = {"disagg": ["prefill", "decode"], "mixed": ["mixed"]}


def context_of(lengths: list[int], decode_tokens: int) -> int:
    return max(lengths) + decode_tokens + 64


def model_size(size: str, lengths: list[int], decode_tokens: int) -> str:
    """tiny or kv-heavy: ``auto`` takes tiny while the longest request fits its context. ValueError when an
    explicit tiny cannot hold it (with what it allows)."""
    fits = context_of(lengths, decode_tokens) <= TINY_CONTEXT
    if size == "auto":
        return "tiny" if fits else "kv-heavy"
    if size == "tiny" and not fits:
        raise ValueError(f"the tiny model's context is {TINY_CONTEXT} tokens: prompts of at most "
                         f"{TINY_CONTEXT - decode_tokens - 64} with --decode-tokens {decode_tokens} (got {max(lengths)}); "
                         "use --model-size kv-heavy")
    if size not in ("tiny", "kv-heavy"):
        raise ValueError(f"--model-size is auto, tiny or kv-heavy (got {size!r})")
    return size


def cluster_sets(backend: str, lengths: list[int], decode_tokens: int, size: str, path: Path | None) -> list[str]:
    longest = context_of(lengths, decode_tokens)
    common = [*QUIET, f"model.max_model_len={max(longest, 4096 if backend == 'sim' else 0)}", "migration.timeout_s=60"]
    if backend == "sim":  # the sim's own KV shape (the KV-heavy one costs ~0.5 s of CPU per request here)
        return common + [f"sim.num_blocks={(2 * longest + 1024) // 16 + 1}", "sim.eos_rate=0",
                         f"sim.max_num_batched_tokens={longest}"]
    sets = common + [*VLLM_PATIENCE, f"model.path={path}", "model.name=bench", "vllm.max_num_seqs=8", "vllm.block_size=32"]
    if size == "kv-heavy":
        sets.append(f"vllm.kv_cache_bytes={(2 * longest + 1024) * KV_HEAVY_BYTES_PER_TOKEN}")
    return sets


def sample(admin: AdminClient, url: str, target: Target, prompt: list[int], decode_tokens: int) -> dict:
    """One streamed request on an idle cluster, and what the cluster counted for it."""
    before = Counters(admin, url)

    async def go() -> dict:
        async with httpx.AsyncClient(timeout=900) as client:
            return await stream_completion(client, url, target.body(prompt, decode_tokens), None, 900)

    r = asyncio.run(go())
    wait_idle(admin)
    after = Counters(admin, url)
    committed = after.ordered.get("handover/committed", 0) - before.ordered.get("handover/committed", 0)
    aborted = after.ordered.get("handover/aborted", 0) - before.ordered.get("handover/aborted", 0)
    return {**figs.handover_gap(r["times"]), "tokens_out": len(r["times"]), "error": r["error"],
            "handovers": committed, "handovers_aborted": aborted,
            "handover_ms": figs.phase_mean_ms(before.instances, after.instances, "handover"),
            "proxy_gap_ms": figs.hist_mean_ms(before.proxy, after.proxy, figs.GAP_METRIC, "kind=handover"),
            "migration_ms": figs.hist_mean_ms(before.instances, after.instances, figs.MIGRATION_METRIC),
            "downtime_ms": figs.hist_mean_ms(before.instances, after.instances, figs.DOWNTIME_METRIC)}


def run(backend: str, lengths: list[int], repeat: int, decode_tokens: int, baseline: bool, sets: list[str],
        target: Target, log, budget: Budget | None = None, progress: Progress | None = None) -> list[dict]:
    """``budget``: a (cluster, length) whose estimate does not fit is skipped (``budget.skipped``). On the
    handover cluster a length must leave room for the same length on the baseline one (and its start, as long
    as the first took); the baseline runs only the lengths the handover cluster ran."""
    budget = budget or Budget(None)
    clusters = ["disagg"] + ["mixed"] * baseline
    progress = progress or Progress(len(clusters) * len(lengths), heartbeat_s=None)
    samples = []
    measured: list[tuple[int, float]] = []  # (length, seconds), both clusters: their lengths cost alike
    ran: set[int] = set()
    up_s = 0.0
    for cluster in clusters:
        roles = CLUSTERS[cluster]
        t_up = time.monotonic()
        run_dir = scratch_dir("llumnix-bench-handover-")
        log(f"{cluster}: starting {len(roles)} instance(s) ...")
        progress.update(f"{cluster}: starting {len(roles)} instance(s)")
        try:
            state = localcluster.up(run_dir, len(roles), backend, 0, None, sets, timeout_s=600,
                                    roles=roles)
        except localcluster.ClusterError as exc:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise RuntimeError(str(exc)) from None
        admin = AdminClient.for_args(state.manager_address, state.args, timeout_s=10)
        try:
            sample(admin, state.url, target, figs.prompt_tokens(min(lengths), target.vocab, "warm"), 8)  # one-time costs
            up_s = max(up_s, time.monotonic() - t_up)
            for n in lengths:
                label = f"{cluster}, length {n}"
                if cluster == "mixed" and n not in ran:
                    progress.skipped(label, budget.skip({"cluster": cluster, "tokens": n},
                                                        "not run on the handover cluster")["reason"])
                    continue
                est = estimate(measured, n)
                later = (est or 0.0) + up_s if cluster == "disagg" and baseline else 0.0  # its baseline's share
                if not budget.consider({"cluster": cluster, "tokens": n}, est, STOP_RESERVE_S + later):
                    progress.skipped(label, budget.skipped[-1]["reason"])
                    continue
                progress.step(label)
                ran.add(n)
                t_len = time.monotonic()
                for k in range(repeat):
                    progress.update(f"{label}, request {k + 1}/{repeat}")
                    log(f"{cluster}: {n} tokens, {k + 1}/{repeat} ...")
                    s = sample(admin, state.url, target, figs.prompt_tokens(n, target.vocab, f"{cluster}-{n}-{k}"),
                               decode_tokens)
                    samples.append({"tokens": n, "cluster": cluster, "repeat": k, **s})
                measured.append((n, time.monotonic() - t_len))
        finally:
            admin.close()
            localcluster.stop(state)
            shutil.rmtree(run_dir, ignore_errors=True)
    return samples


def command(
    backend: Annotated[str, typer.Option(metavar="sim|vllm", help="engine of the instances (vllm: a generated model, see --model-size, unless --model)")] = "vllm",
    lengths: Annotated[str, typer.Option(help="prompt lengths, tokens, comma-separated")] = "256,1024,4096,8192",
    repeat: Annotated[int, typer.Option(help="requests per length", min=1)] = 3,
    decode_tokens: Annotated[int, typer.Option(help="output tokens of each request (the handover must end before them)", min=2)] = 64,
    baseline: Annotated[bool, typer.Option(help="also run the requests on one mixed instance (no handover): its longest gap")] = True,
    model_size_: Annotated[str, typer.Option("--model-size", metavar="auto|tiny|kv-heavy", help="--backend vllm without --model: the generated model (auto: tiny while the lengths fit its 4096-token context, else kv-heavy)")] = "auto",
    model: Annotated[Optional[Path], typer.Option(metavar="DIR", help="--backend vllm: the checkpoint (its context must hold the longest prompt and the decode tokens)")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="a setting of the clusters, after the bench's own: section.key=value")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "--save", metavar="FILE", help="write the JSON here")] = None,
    json_: Annotated[bool, typer.Option("--json", help="print JSON instead of the table")] = False,
    budget_s: BudgetOpt = DEFAULT_BUDGET_S,
) -> None:
    """The client's longest gap between tokens at the handover (prefill instance to decode instance), per prompt
    length, against one mixed instance's. Lengths that would not fit in --budget-s are skipped (--json: skipped)."""
    budget = Budget(budget_s)
    err = Console(stderr=True)
    try:
        if backend not in ("sim", "vllm"):
            raise ValueError("--backend is sim or vllm")
        ns = figs.parse_list(lengths, "--lengths")
        if any(n < 1 for n in ns):
            raise ValueError("--lengths must be positive")
        size = model_size(model_size_, ns, decode_tokens) if backend == "vllm" and model is None else "given"
        load_config(None, list(set_ or []))
    except (ValueError, ConfigError) as exc:
        err.print(f"llumnixctl: {exc}", markup=False)
        raise typer.Exit(2) from None
    scratch = scratch_dir("llumnix-bench-handover-model-")
    try:
        path, target, label = None, Target("llumnix-sim", 32000), "sim"
        if backend == "vllm":
            from llumnixctl.lab.model import write_tiny_model

            if model is None:
                err.print(f"writing the {size} test model ...", markup=False)
            path = (model or write_tiny_model(scratch / size, size=size)).resolve()
            target, label = Target("bench", vocab_of(path) - 8), f"{size} (generated)" if model is None else str(path)
        sets = cluster_sets(backend, ns, decode_tokens, size, path) + list(set_ or [])
        with Progress((1 + baseline) * len(ns), start=budget.t0) as progress:
            samples = run(backend, ns, repeat, decode_tokens, baseline, sets, target,
                          lambda m: err.print(m, markup=False), budget, progress)
    except RuntimeError as exc:
        err.print(f"llumnixctl: bench handover: {exc}", markup=False)
        raise typer.Exit(1) from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    res = {"backend": backend, "model": label, "cores": psutil.cpu_count(), "repeat": repeat,
           "decode_tokens": decode_tokens, "settings": list(set_ or []), "results": figs.handover_rows(samples),
           "samples": samples, **budget.fields()}
    emit(res, json_, lambda r: Console().print(figs.handover_table(r)), lambda s: f"{s['cluster']} length {s['tokens']}",
         save=out)
    failed = [s for s in samples if s["error"]]
    if failed:
        err.print(f"bench handover: {len(failed)} requests failed; first error: {failed[0]['error']}", markup=False)
        raise typer.Exit(1)
