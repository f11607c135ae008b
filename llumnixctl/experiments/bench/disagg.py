"""``llumnixctl bench disagg``: prefill/decode disaggregation against mixed serving, on a local cluster.

A trace mixes long prompts (``--long-lengths``, at least 10:1 input:output, Poisson at ``--long-rate``) into
steady decode traffic (``--decode-lengths``: short prompts, long outputs, evenly spaced at ``--decode-rate``) for
``--seconds`` (``--phase-s``: the mix shifts between prompt-heavy and decode-heavy phases). Each configuration of
``--configs`` replays it on a fresh cluster of ``--instances`` instances:

- ``mixed``: every instance mixed, dispatch llumnix (migrations for balance on);
- ``split``: a fixed split, ``--prefill`` prefill instances then decode ones (``instance.role`` per instance);
- ``adaptive``: the split, plus ``disagg.adaptive=true`` and the [slo] targets (``--slo-ttft-ms``, ``--slo-tpot-ms``)
  on the cluster, so that roles may move with the load.

The rounds are interleaved (round 1: mixed, split, adaptive; round 2: ...), each round with its own trace (the seed
plus the round) replayed by every configuration. Per run: the decode traffic's TPOT (P50, P99) and ITL P99, the TTFT
of short and long requests, goodput and attainment under the SLO (the client's, llumnixctl/experiments/bench/
goodput.py: a request meets the SLO when its TTFT and TPOT are within the targets), the handovers committed and
aborted (the manager's ordered migrations of reason "handover"), the TTFT phases' means (the instances'
``llumnix_instance_request_phase_seconds``), the migrations' downtime, the dispatch decisions; over rounds, the
median and range of each. The sanity checks compare each configuration with mixed: P99 TPOT ratio (goal <= 1/2),
the long prompts' TTFT increase against the handover time plus queueing, goodput ratio (goal > 1).

Nothing here asserts a timing; the figures depend on the machine (``cores`` in the JSON).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Annotated, Callable, Optional

import httpx
import psutil
import typer
from rich.console import Console

from daemons.config import ConfigError, load_config
from llumnixctl.admin import AdminClient, ManagerUnreachable
from llumnixctl.experiments.bench.overload import vocab_of
from llumnixctl.experiments.bench import disagg_figures as figs
from llumnixctl.experiments.bench.budget import DEFAULT_BUDGET_S, Budget, BudgetOpt, Progress, Rounds, emit
from llumnixctl.experiments.bench.serve import fetch_metrics, replay, stream_completion
from llumnixctl.lab import localcluster
from llumnixctl.lab.scratch import scratch_dir

QUIET = ["instance.log_level=warning", "proxy.log_level=warning", "manager.log_level=warning", "proxy.access_log=false"]
# A CPU prefill of thousands of tokens holds the GIL for seconds (vLLM's CPU attention op): the watchdog and the
# proxy's liveness wait longer than their defaults (as bench migration's).
VLLM_PATIENCE = ["instance.step_timeout_s=900", "instance.orphan_timeout_s=900"]


def roles_of(config: str, instances: int, prefill: int) -> list[str]:
    """Each instance's role (i0, i1, ... in order) in a configuration."""
    if config == "mixed":
        return ["mixed"] * instances
    return ["prefill"] * prefill + ["decode"] * (instances - prefill)


def roles_label(roles: list[str]) -> str:
    p, d = roles.count("prefill"), roles.count("decode")
    return f"{len(roles)} mixed" if not p and not d else f"{p}P+{d}D"


def config_sets(config: str, ttft_ms: float, tpot_ms: float, slo_everywhere: bool) -> list[str]:
    """A configuration's settings beyond the common ones: [slo] targets on adaptive (and on every configuration
    with ``slo_everywhere``), ``disagg.adaptive`` on adaptive."""
    slo = [f"slo.ttft_ms={ttft_ms:g}"] * bool(ttft_ms) + [f"slo.tpot_ms={tpot_ms:g}"] * bool(tpot_ms)
    if config == "adaptive":
        return ["disagg.adaptive=true", *slo]
    return slo if slo_everywhere else []


def scrape(address: str) -> dict[str, float]:
    """One /metrics page (``host:port`` or a URL), parsed (``figs.parse_metrics``); {} when it cannot be read."""
    return fetch_metrics(address, figs.parse_metrics)


class Counters:
    """What the cluster has counted so far: the manager's ordered migrations, the instances' metrics (added up),
    the proxy's, the instances' roles."""

    def __init__(self, admin: AdminClient, url: str):
        snap = admin.status()
        self.ordered = dict(snap.ordered_migrations)
        self.instances = figs.merged([scrape(v.metrics_address) for v in snap.instances if v.metrics_address])
        self.proxy = scrape(url)
        self.roles = {v.instance_id: getattr(v.load, "role", "mixed") for v in snap.instances}


def wait_idle(admin: AdminClient, timeout_s: float = 60.0) -> bool:
    """Wait until no instance runs, queues or migrates anything (their last load reports in); False on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            views = [v for v in admin.status().instances if v.state == "alive"]
        except (ManagerUnreachable, RuntimeError):
            views = None
        if views is not None and all(v.load.running == 0 and v.load.waiting == 0 and v.pending_dispatches == 0
                                     and v.migrations_ordered == 0 and v.load.migrating_out == 0 for v in views):
            return True
        time.sleep(0.2)
    return False


class RoleWatch(threading.Thread):
    """The instances' roles every half second while the trace runs: when adaptive roles moved (the timeline of
    the split, from the trace's start)."""

    def __init__(self, manager: str, args, every: float = 0.5):
        super().__init__(name="role-watch", daemon=True)
        self.manager, self.args, self.every = manager, args, every
        self.timeline: list[tuple[float, str]] = []
        self.done = threading.Event()

    def run(self) -> None:
        client = AdminClient.for_args(self.manager, self.args, timeout_s=10)
        t0, last = time.monotonic(), None
        try:
            while True:
                try:
                    roles = [getattr(v.load, "role", "mixed") for v in client.status().instances if v.state == "alive"]
                except (ManagerUnreachable, RuntimeError):
                    roles = None
                if roles is not None and roles_label(roles) != last:
                    last = roles_label(roles)
                    self.timeline.append((round(time.monotonic() - t0, 1), last))
                if self.done.wait(self.every):
                    return
        finally:
            client.close()


class Target:
    """The served model as the client sends to it: its name and the token ids its prompts may use."""

    def __init__(self, name: str, vocab: int):
        self.name, self.vocab = name, vocab

    def body(self, prompt: list[int], max_tokens: int) -> dict:
        return {"model": self.name, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "temperature": 0}


async def _warm_up(url: str, target: Target, instances: int, long_prompt: int, timeout_s: float) -> None:
    """A few requests of each kind: first requests pay one-time costs, and the step-time models get samples."""
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        bodies = [target.body(figs.prompt_tokens(16, target.vocab, f"warm-{k}"), 8) for k in range(2 * instances)]
        bodies.append(target.body(figs.prompt_tokens(long_prompt, target.vocab, "warm-long"), 8))
        await asyncio.gather(*(stream_completion(client, url, b, None, timeout_s) for b in bodies))


def run_one(backend: str, sets: list[str], roles: list[str], reqs, kinds: list[str], target: Target, round_: int,
            ttft_s: float, tpot_s: float, timeout_s: float, log: Callable[[str], None]) -> dict:
    """One configuration on a fresh cluster: warm up, replay the trace, count. Returns the run's figures."""
    run_dir = scratch_dir("llumnix-bench-disagg-")
    try:
        state = localcluster.up(run_dir, len(roles), backend, 0, None, sets,
                                timeout_s=60 if backend == "sim" else 600, roles=roles)
    except localcluster.ClusterError as exc:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise RuntimeError(str(exc)) from None
    admin = AdminClient.for_args(state.manager_address, state.args, timeout_s=10)
    prompts = {r.index: figs.prompt_tokens(r.prompt_tokens, target.vocab, f"{round_}-{r.index}") for r in reqs}
    try:
        asyncio.run(_warm_up(state.url, target, len(roles), max(r.prompt_tokens for r in reqs), timeout_s))
        wait_idle(admin)
        before = Counters(admin, state.url)
        log(f"  replaying {len(reqs)} requests ...")
        watch = RoleWatch(state.manager_address, state.args)
        watch.start()
        try:
            results, duration = asyncio.run(replay(state.url, reqs,
                                                   lambda r: target.body(prompts[r.index], r.output_tokens),
                                                   timeout_s=timeout_s))
        finally:
            watch.done.set()
            watch.join(15)
        idle = wait_idle(admin)
        after = Counters(admin, state.url)
    finally:
        admin.close()
        localcluster.stop(state)
        shutil.rmtree(run_dir, ignore_errors=True)
    out = figs.run_figures(results, kinds, duration, ttft_s, tpot_s)
    out["duration_s"] = round(duration, 3)
    out["idle_at_end"] = idle
    out["roles_timeline"] = watch.timeline  # [(s since the trace's start, "2P+2D")], each change of the split
    out["cluster"] = figs.cluster_figures(before.ordered, after.ordered, before.instances, after.instances,
                                          before.proxy, after.proxy, after.roles)
    return out


def backend_sets(backend: str, batch: int, model: Path | None, run_dir: Path) -> tuple[list[str], Target, str]:
    """The settings of every configuration's cluster for the backend, the target, the model's label."""
    if backend == "sim":
        return [f"sim.max_num_seqs={batch}", "sim.eos_rate=0"], Target("llumnix-sim", 32000), "sim"
    from llumnixctl.lab.model import write_tiny_model

    path = (model or write_tiny_model(run_dir / "tiny")).resolve()
    label = "tiny (generated)" if model is None else str(path)
    sets = [f"model.path={path}", "model.name=bench", f"vllm.max_num_seqs={batch}", *VLLM_PATIENCE]
    return sets, Target("bench", vocab_of(path) - 8), label


def command(
    backend: Annotated[str, typer.Option(metavar="sim|vllm", help="engine of the instances (vllm: a tiny random-weight model unless --model)")] = "vllm",
    instances: Annotated[int, typer.Option(help="instances of every configuration's cluster", min=2, max=16)] = 2,
    prefill: Annotated[int, typer.Option(help="prefill instances of the split and adaptive configurations (the rest decode)", min=1)] = 1,
    configs: Annotated[str, typer.Option(help="configurations to run, comma-separated: mixed, split, adaptive")] = "mixed,split,adaptive",
    rounds: Annotated[int, typer.Option(help="interleaved rounds of every configuration", min=1)] = 3,
    seconds: Annotated[float, typer.Option(help="length of the trace, s", min=1.0)] = 30.0,
    decode_rate: Annotated[float, typer.Option(help="decode traffic: requests per second, evenly spaced", min=0.01)] = 2.0,
    decode_lengths: Annotated[str, typer.Option(metavar="PROMPT:OUTPUT", help="decode traffic: prompt and output tokens")] = "32:128",
    long_rate: Annotated[float, typer.Option(help="long prompts: Poisson arrivals per second", min=0.0)] = 0.5,
    long_lengths: Annotated[str, typer.Option(metavar="PROMPT:OUTPUT", help="long prompts: prompt and output tokens (at least 10:1)")] = "2048:100",
    batch: Annotated[int, typer.Option(help="max_num_seqs of each instance", min=1)] = 16,
    slo_ttft_ms: Annotated[Optional[float], typer.Option(help="TTFT target, ms: goodput and attainment count it; set as slo.ttft_ms on the adaptive cluster (admission by predicted TTFT there; 0: none; default: 3000 with vllm, 1000 with sim)", min=0.0)] = None,
    slo_tpot_ms: Annotated[Optional[float], typer.Option(help="TPOT target, ms: goodput and attainment count it; set as slo.tpot_ms on the adaptive cluster (0: none; default: 10 with vllm, 25 with sim)", min=0.0)] = None,
    slo_everywhere: Annotated[bool, typer.Option(help="set the [slo] targets on the mixed and split clusters too (admission by SLO everywhere)")] = False,
    model: Annotated[Optional[Path], typer.Option(metavar="DIR", help="--backend vllm: the checkpoint (default: a tiny random-weight model)")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="a setting of every configuration's cluster, after the bench's own: section.key=value")] = None,
    seed: Annotated[int, typer.Option(help="trace seed (each round adds its number)")] = 0,
    phase_s: Annotated[float, typer.Option(help="shift the mix every this many seconds: prompt-heavy (every long prompt, at twice --long-rate, and half the decode traffic), then decode-heavy (no long prompt, 1.5 times the decode traffic), and back; the same rates on average (0: a stationary mix)", min=0.0)] = 0.0,
    first_round: Annotated[int, typer.Option(help="number of the first round (its trace): split the rounds over several runs of the command, each with --out, then --merge their files", min=0)] = 0,
    merge: Annotated[Optional[list[Path]], typer.Option("--merge", metavar="FILE", help="run nothing: summarize the runs of these --out files (the same trace, instances and SLO), as one result")] = None,
    request_timeout: Annotated[float, typer.Option(help="seconds a request may take before it counts as failed", min=1.0)] = 600.0,
    out: Annotated[Optional[Path], typer.Option("--out", "--save", metavar="FILE", help="write the JSON here")] = None,
    json_: Annotated[bool, typer.Option("--json", help="print JSON instead of the table")] = False,
    budget_s: BudgetOpt = DEFAULT_BUDGET_S,
) -> None:
    """Disaggregated (fixed split, adaptive) against mixed serving on a trace of long prompts in decode traffic:
    decode TPOT, TTFT, goodput, handovers; medians and ranges over interleaved rounds. A configuration's round
    that would not fit in --budget-s is skipped (--json: skipped)."""
    budget = Budget(budget_s)
    err = Console(stderr=True)

    def bad(msg: str) -> None:
        err.print(f"llumnixctl: {msg}", markup=False)
        raise typer.Exit(2)

    if merge:
        try:
            res = figs.merge_results([json.loads(p.read_text()) for p in merge])
        except (OSError, ValueError, KeyError) as exc:
            bad(f"--merge: {exc}")
        return report(res, out, json_, err)
    if slo_ttft_ms is None:
        slo_ttft_ms = 3000.0 if backend == "vllm" else 1000.0
    if slo_tpot_ms is None:
        slo_tpot_ms = 10.0 if backend == "vllm" else 25.0
    names = [c.strip() for c in configs.split(",") if c.strip()]
    if backend not in ("sim", "vllm"):
        bad("--backend is sim or vllm")
    if not names or any(c not in figs.CONFIGS for c in names):
        bad(f"--configs takes {', '.join(figs.CONFIGS)} (got {configs!r})")
    if prefill >= instances:
        bad(f"--prefill {prefill} leaves no decode instance among --instances {instances}")
    try:
        (sp, so), (lp, lo) = figs.parse_lengths(decode_lengths, "--decode-lengths"), figs.parse_lengths(long_lengths, "--long-lengths")
        mix = figs.Mix(seconds, decode_rate, sp, so, long_rate, lp, lo, seed, phase_s)
        mix.check()
        load_config(None, list(set_ or []))  # a bad --set fails here, not in a daemon's log
    except (ValueError, ConfigError) as exc:
        bad(str(exc))
    scratch = scratch_dir("llumnix-bench-disagg-model-")
    runs: list[dict] = []
    progress = Progress(rounds * len(names), start=budget.t0)
    rounds_ = Rounds(budget, progress)
    try:
        common, target, label = backend_sets(backend, batch, model, scratch)
        common += [*QUIET, f"model.max_model_len={max(4096, lp + lo + 64, sp + so + 64)}"]
        for r in range(first_round, first_round + rounds):
            reqs, kinds = figs.mixed_trace(mix, r)
            if not rounds_.begin([({"config": cfg, "round": r}, f"round {r + 1 - first_round}/{rounds}: {cfg}", cfg)
                                  for cfg in names]):
                continue
            for cfg in names:
                roles = roles_of(cfg, instances, prefill)
                sets = common + config_sets(cfg, slo_ttft_ms, slo_tpot_ms, slo_everywhere) + list(set_ or [])
                if not rounds_.start({"config": cfg, "round": r}, f"round {r + 1 - first_round}/{rounds}: {cfg}", cfg):
                    continue
                err.print(f"round {r + 1 - first_round}/{rounds}: {cfg} ({roles_label(roles)}) ...", markup=False)
                f = run_one(backend, sets, roles, reqs, kinds, target, r, slo_ttft_ms / 1000, slo_tpot_ms / 1000,
                            request_timeout, lambda m: err.print(m, markup=False))
                runs.append({"config": cfg, "round": r, "figures": f})
                if len(f.get("roles_timeline", ())) > 1:
                    err.print("  roles: " + ", ".join(f"{label} at {t:g} s" for t, label in f["roles_timeline"]),
                              markup=False)
                rounds_.done(cfg)
    except RuntimeError as exc:
        err.print(f"llumnixctl: bench disagg: {exc}", markup=False)
        raise typer.Exit(1) from None
    finally:
        progress.close()
        shutil.rmtree(scratch, ignore_errors=True)
    res = {"backend": backend, "model": label, "cores": psutil.cpu_count(), "instances": instances,
           "prefill": prefill, "batch": batch, "rounds": rounds, "trace": figs.mix_dict(mix),
           "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms, "on_clusters": "all" if slo_everywhere else "adaptive"},
           "roles": {c: roles_label(roles_of(c, instances, prefill)) for c in names}, "settings": list(set_ or []),
           "runs": runs, **budget.fields()}
    report(figs.with_summary(res), out, json_, err)


def report(res: dict, out: Path | None, json_: bool, err: Console) -> None:
    """Write (--out), print (JSON or the table), and say so when requests failed."""
    emit(res, json_, lambda r: Console().print(figs.summary_table(r)), lambda s: f"{s['config']} round {s['round']}",
         save=out)
    failed = sum(run["figures"]["failed"] for run in res["runs"])
    if failed:
        first = next((e for run in res["runs"] for e in run["figures"].get("errors", [])), "")
        err.print(f"bench disagg: {failed} requests failed or were refused; first error: {first}", markup=False)
