"""``llumnixctl bench sessions``: conversations and agent loops whose KV should follow the session, side by side.

The same session trace (llumnixctl/experiments/traces/sessions.py: closed loop, prompts that grow by the
previous answer and a new message, shared agent system prompts) goes, in interleaved rounds, to N engines
configured alike (the tiny model unless --model; prefix caching on; the same KV size, block size and batch)
behind (bench/cache.py starts them and replays the trace):

- ``llumnix-sessions``: our cluster (``llumnix-cache`` dispatch) with OpenAI's ``prompt_cache_key`` (and the
  session header) on every turn, the host KV tier and prefix pulls on where this build declares them
  (``[kv_tier]``, ``[sessions]``);
- ``llumnix-notier``: the same with ``kv_tier.host_mb=0`` and ``kv_tier.pull=false``;
- ``llumnix-cache``: today's cache-aware dispatch, no session key, no tier, no pulls;
- ``smg``: the SGLang model gateway, policy ``cache_aware``, in front of vLLM's ``api_server``;
- ``vllm-router``: vllm-router's ``consistent_hash`` on the session header (``x-session-id``), in front of
  vLLM's ``api_server``.

A setting this build does not declare is not passed (the bench runs on a build with or without the tier and
session dispatch); the result's ``settings`` say what each system ran with and ``not_declared`` what was left out.

Per round and system: failed requests; TTFT mean, P50, P99; turns/s; prompt tokens served from some cache
(our instances' ``llumnix_prefix_tokens_total{source}`` where they export it, else their prefix-cache counters;
vLLM's ``vllm:prefix_cache_hits`` and ``vllm:external_prefix_cache_hits`` on an api_server) against what a
perfect cache would serve (one infinite cache that has seen every earlier prompt of the trace, in full
blocks); the largest share of turns any instance served, against the fair share (each instance's own
request counter: ``llumnix_instance_requests_total``, ``vllm:request_success_total``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import shutil
import sys
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer
from rich.console import Console
from rich.table import Table

from llumnixctl.experiments.bench import cache as bench_cache, engine as bench_engine, serve as bench_serve
from llumnixctl.experiments.bench.budget import (DEFAULT_BUDGET_S, Budget, BudgetOpt, JsonOpt, Progress, Rounds,
                                                 ModelOpt, SaveOpt, SmgOpt, VllmRouterOpt, emit)
from llumnixctl.experiments.traces import cache as tracecache, sessions as tsessions
from llumnixctl.experiments.traces.words import Words
from llumnixctl.lab.scratch import scratch_dir

OURS = ("llumnix-sessions", "llumnix-notier", "llumnix-cache")
PEERS = {"smg": "cache_aware", "vllm-router": "consistent_hash"}  # each peer's policy
SYSTEMS = OURS + tuple(PEERS)
SESSION_HEADER = "x-session-id"  # what vllm-router's consistent_hash reads, and our proxy's default

# Our instances' counters (daemons/instance/telemetry.py and the tier's), and vLLM's on an api_server.
OUR_TURNS, VLLM_TURNS = "llumnix_instance_requests_total", "vllm:request_success_total"
OUR_QUERIED, OUR_HIT = "llumnix_instance_prefix_cache_queried_tokens_total", "llumnix_instance_prefix_cache_hit_tokens_total"
OUR_SOURCES = "llumnix_prefix_tokens_total"  # {source="engine|host|pulled|recomputed"}
CACHED_SOURCES = ("engine", "host", "pulled")
PROXY_SESSIONS = "llumnix_proxy_session_dispatches_total"  # {how="affinity|spilled|new|pull"}
VLLM_QUERIED, VLLM_HITS = "vllm:prefix_cache_queries_total", ("vllm:prefix_cache_hits_total",
                                                              "vllm:external_prefix_cache_hits_total")


# ---------------------------------------------------------------------- what each system runs with


def declared(key: str) -> bool:
    """Whether this build declares the setting ``section.key`` (daemons/config.py)."""
    from daemons.config import sections

    section, _, name = key.partition(".")
    return any(s == section and name in {f.name for f in dataclasses.fields(t)} for s, t in sections())


def system_settings(name: str, host_mb: int | None) -> tuple[list[str], list[str]]:
    """Our system ``name``'s settings (beyond the engines' and the dispatch policy) and the ones this build does
    not declare, left out."""
    wanted = {"llumnix-sessions": ["sessions.affinity=true", "kv_tier.pull=true"]
                                  + ([f"kv_tier.host_mb={host_mb}"] if host_mb is not None else []),
              "llumnix-notier": ["sessions.affinity=true", "kv_tier.host_mb=0", "kv_tier.pull=false"],
              "llumnix-cache": ["sessions.affinity=false", "kv_tier.host_mb=0", "kv_tier.pull=false"]}[name]
    sets = [s for s in wanted if declared(s.split("=", 1)[0])]
    return sets, [s for s in wanted if s not in sets]


def session_header() -> str:
    if declared("sessions.header"):
        from daemons.config import load_config

        return load_config(None, []).sessions.header  # (declared: the SESSIONS part of the config)
    return SESSION_HEADER


def sender(name: str, words, seed: int) -> bench_cache.Send:
    """How system ``name``'s client sends a turn: ours with sessions, the key in the body and the header;
    vllm-router, the header its consistent hash reads; the others, the prompt alone."""
    key = lambda req: tsessions.session_key(seed, req.session)  # noqa: E731
    if name in ("llumnix-sessions", "llumnix-notier"):
        header = session_header()
        return bench_cache.Send(words, lambda req: {"prompt_cache_key": key(req)}, lambda req: {header: key(req)})
    if name == "vllm-router":
        return bench_cache.Send(words, None, lambda req: {SESSION_HEADER: key(req)})
    return bench_cache.Send(words)


# ---------------------------------------------------------------------- figures from the engines' /metrics


def _samples(address: str) -> list[tuple[str, dict, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    def parse(text: str) -> list:
        return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]

    return bench_serve.fetch_metrics(address, parse) or []


def engine_figures(ours: bool) -> Callable[[list[str], str], dict]:
    """``after(addresses, url)`` for bench/cache.py: ``tally`` of the engines' /metrics (and ours, the proxy's)."""

    def after(addresses: list[str], url: str) -> dict:
        return tally([_samples(a) for a in addresses], _samples(url) if ours else [], ours)

    return after


def tally(engines: list[list[tuple[str, dict, float]]], proxy: list[tuple[str, dict, float]], ours: bool) -> dict:
    """From each engine's samples (name, labels, value): the turns each served, the prompt tokens it was asked for
    and those served from some cache (ours: by source where the instances export it); from our proxy's, how it
    placed the sessions' turns (``llumnix_proxy_session_dispatches_total{how}``, where it exports it)."""
    turns, queried, cached, by_source = [], 0.0, 0.0, {}
    for smp in engines:
        def total(name: str, smp=smp) -> float:
            return sum(v for n, _, v in smp if n == name)

        turns.append(int(total(OUR_TURNS if ours else VLLM_TURNS)))
        if ours:
            queried += total(OUR_QUERIED)
            src = [(lb.get("source", ""), v) for n, lb, v in smp if n == OUR_SOURCES]
            for s, v in src:
                by_source[s] = by_source.get(s, 0.0) + v
            cached += sum(v for s, v in src if s in CACHED_SOURCES) if src else total(OUR_HIT)
        else:
            queried += total(VLLM_QUERIED)
            cached += sum(total(n) for n in VLLM_HITS)
    placed: dict[str, int] = {}
    for n, lb, v in proxy:
        if n == PROXY_SESSIONS:
            placed[lb.get("how", "")] = placed.get(lb.get("how", ""), 0) + int(v)
    fair = sum(turns) / len(turns) if turns else 0.0
    return {"turns_by_instance": turns, "session_dispatches": placed or None,
            "busiest_over_fair": round(max(turns) / fair, 3) if fair else None,
            "cache": {"prompt_tokens": int(queried), "cached_tokens": int(cached),
                      "by_source": {k: int(v) for k, v in sorted(by_source.items())} or None}}


def with_perfect(res: dict, reqs: list, block_size: int) -> dict:
    """The share of what a perfect cache would serve that was served from some cache."""
    perfect = tracecache.sharing(reqs, block_size, res.get("prompt_lead_tokens", 0))["shareable_tokens"]
    c = res.setdefault("cache", {"prompt_tokens": 0, "cached_tokens": 0, "by_source": None})
    c["perfect_tokens"] = perfect
    c["of_perfect"] = round(c["cached_tokens"] / perfect, 4) if perfect else None
    res["turns_per_s"] = round(res["completed"] / res["duration_s"], 3) if res.get("duration_s") else None
    return res


# ---------------------------------------------------------------------- the command


@dataclasses.dataclass
class Shape:
    """The session trace of a round (traces/sessions.py ``sessions``)."""

    sessions: int
    working_set: float  # x the cluster's KV (0: by sessions)
    session_rate: float
    turns: tuple[int, int]
    agents: int
    system_tokens: int
    message: tuple[int, int]
    reply: tuple[int, int]
    think: float
    max_context: int

    def trace(self, kv_total: int, seed: int) -> list:
        return tsessions.sessions(0 if self.working_set > 0 else self.sessions, session_rate=self.session_rate,
                                  turns=self.turns, agents=self.agents, system_tokens=self.system_tokens,
                                  message=self.message, reply=self.reply, think=self.think,
                                  max_context=self.max_context, working_set_tokens=int(self.working_set * kv_total),
                                  seed=seed)


def command(
    sessions: Annotated[int, typer.Option(help="sessions per round (unless --working-set)", min=1)] = 16,
    working_set: Annotated[float, typer.Option(help="instead of --sessions: as many sessions as make the working set this many times the cluster's KV (the issue's check: 4)", min=0.0)] = 0.0,
    session_rate: Annotated[float, typer.Option(help="sessions started per second (Poisson)", min=0.001)] = 1.0,
    turns_min: Annotated[int, typer.Option(help="fewest turns of a session", min=1)] = 3,
    turns_max: Annotated[int, typer.Option(help="most turns of a session", min=1)] = 5,
    agents: Annotated[int, typer.Option(help="shared agent system prompts (0: none)", min=0)] = 2,
    system_tokens: Annotated[int, typer.Option(help="tokens of an agent system prompt", min=0)] = 512,
    message_min: Annotated[int, typer.Option(help="shortest new message (a user's reply, a tool's output), tokens", min=1)] = 16,
    message_max: Annotated[int, typer.Option(help="longest new message, tokens", min=1)] = 256,
    reply_min: Annotated[int, typer.Option(help="shortest answer, tokens", min=1)] = 16,
    reply_max: Annotated[int, typer.Option(help="longest answer, tokens", min=1)] = 64,
    think: Annotated[float, typer.Option(help="mean seconds from an answer's end to the next turn (exponential)", min=0.0)] = 0.5,
    max_context: Annotated[int, typer.Option(help="a session ends before its context passes this many tokens", min=64)] = 3072,
    instances: Annotated[int, typer.Option(help="engines per system", min=1)] = 2,
    kv_tokens: Annotated[int, typer.Option(help="KV cache of each engine, in tokens", min=1024)] = 4096,
    max_num_seqs: Annotated[int, typer.Option(help="batch size of each engine", min=1)] = 32,
    rounds: Annotated[int, typer.Option(help="interleaved rounds", min=1)] = 1,
    systems: Annotated[Optional[str], typer.Option(help=f"comma-separated, of {', '.join(SYSTEMS)} (default: ours, and each peer whose binary is given)")] = None,
    engine: Annotated[str, typer.Option(metavar="vllm|sim", help="the engines: vLLM (the peers need it) or the sim engine (ours only; token-id prompts)")] = "vllm",
    host_mb: Annotated[Optional[int], typer.Option(help="llumnix-sessions: kv_tier.host_mb (default: the setting's default)", min=-1)] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="extra setting for our clusters, last: section.key=value")] = None,
    smg: SmgOpt = None,
    vllm_router: VllmRouterOpt = None,
    model: ModelOpt = None,
    seed: Annotated[int, typer.Option(help="trace seed (round k uses seed + k)")] = 0,
    save: SaveOpt = None,
    json_: JsonOpt = False,
    budget_s: BudgetOpt = DEFAULT_BUDGET_S,
) -> None:
    """Multi-turn sessions: ours with session keys (tier on / off) and today's cache-aware dispatch vs smg cache_aware
    and vllm-router consistent hashing. A system's round that would not fit in --budget-s is skipped (--json: skipped)."""
    budget = Budget(budget_s)
    names = [s for s in (systems or "").split(",") if s] or [
        *OURS, *(["smg"] if smg else []), *(["vllm-router"] if vllm_router else [])]
    _check(names, engine, smg, vllm_router, turns_min, turns_max, message_min, message_max, reply_min, reply_max)
    if engine == "vllm" and max_context >= bench_engine.MAX_MODEL_LEN:  # (the engines put a BOS before the prompt)
        raise typer.BadParameter(f"--max-context must be below the engines' context of {bench_engine.MAX_MODEL_LEN} "
                                 "tokens (a BOS comes first)")
    from daemons.config import ConfigError, load_config

    try:
        load_config(None, list(set_ or []))  # a bad --set fails here, not in a daemon's log
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None

    def interrupted(*_):
        raise KeyboardInterrupt  # SIGTERM too stops what was started (the finally blocks)

    signal.signal(signal.SIGTERM, interrupted)
    shape = Shape(sessions, working_set, session_rate, (turns_min, turns_max), agents, system_tokens,
                  (message_min, message_max), (reply_min, reply_max), think, max_context)
    block_size = 128 if engine == "vllm" else 16
    kv_total = instances * kv_tokens
    work = scratch_dir("llumnix-bench-sessions-")
    rows, traces = [], []
    progress = Progress(rounds * len(names), start=budget.t0)
    rounds_ = Rounds(budget, progress)
    try:
        path = words = None
        if engine == "vllm":
            from llumnixctl.lab.model import write_tiny_model

            path = (model or write_tiny_model(work / "tiny-llama")).resolve()
            words = Words(path)
        vllm = {"max_num_seqs": max_num_seqs, "kv_cache_bytes": (kv_tokens + 128) * bench_cache.BYTES_PER_TOKEN,
                "block_size": block_size}
        for k in range(rounds):
            reqs = shape.trace(kv_total, seed + k)
            traces.append({"round": k + 1, **tsessions.describe(reqs, kv_total, block_size)})
            sys.stderr.write(_trace_line(traces[-1]) + "\n")
            for _, name in rounds_.interleaved(k, rounds, names, "system"):
                d = work / f"r{k}-{name}"
                d.mkdir()
                res = _run(name, engine, path, d, reqs, words, seed + k, instances, vllm, kv_tokens, block_size,
                           host_mb, list(set_ or []), smg, vllm_router)
                rows.append({"round": k + 1, "system": name, **with_perfect(res, reqs, block_size)})
                sys.stderr.write(json.dumps(rows[-1]) + "\n")
    finally:
        progress.close()
        shutil.rmtree(work, ignore_errors=True)
    res = {"engine": engine, "instances": instances, "kv_tokens": kv_tokens, "max_num_seqs": max_num_seqs,
           "block_size": block_size, "shape": dataclasses.asdict(shape), "cores": os.cpu_count(),
           "settings": {n: system_settings(n, host_mb)[0] + list(set_ or []) for n in names if n in OURS},
           "not_declared": sorted({s.split("=", 1)[0] for n in names if n in OURS for s in system_settings(n, host_mb)[1]}),
           "traces": traces, "rounds": rows, "summary": summarize(rows), **budget.fields()}
    emit(res, json_, _show, lambda s: f"{s['system']}, round {s['round']}", save)


def _check(names, engine, smg, vllm_router, *bounds) -> None:
    if engine not in ("vllm", "sim"):
        raise typer.BadParameter(f"--engine takes vllm or sim, not {engine!r}")
    for s in names:
        if s not in SYSTEMS:
            raise typer.BadParameter(f"unknown system {s!r} (known: {', '.join(SYSTEMS)})")
        if s in PEERS and engine != "vllm":
            raise typer.BadParameter(f"{s} runs in front of vLLM's api_server: it needs --engine vllm")
        if (s == "smg" and not smg) or (s == "vllm-router" and not vllm_router):
            raise typer.BadParameter(f"--systems has {s}: give its binary with --{s}")
    pairs = {"turns": bounds[0:2], "message": bounds[2:4], "reply": bounds[4:6]}
    for what, (lo, hi) in pairs.items():
        if lo > hi:
            raise typer.BadParameter(f"--{what}-min ({lo}) is past --{what}-max ({hi})")


def _run(name: str, engine: str, path, d: Path, reqs: list, words, seed: int, instances: int, vllm: dict,
         kv_tokens: int, block_size: int, host_mb, extra: list[str], smg, vllm_router) -> dict:
    send = sender(name, words, seed)
    if name in PEERS:
        return bench_cache.peer(smg if name == "smg" else vllm_router, path, d, reqs, send, instances, vllm,
                                policy=PEERS[name], after=engine_figures(False))
    sets = system_settings(name, host_mb)[0]
    if engine == "sim":
        sets = ["sim.prefix_caching=true", f"sim.block_size={block_size}", f"sim.num_blocks={kv_tokens // block_size}",
                f"sim.max_num_seqs={vllm['max_num_seqs']}", *sets]
    return bench_cache.ours("llumnix-cache", path, d, reqs, send, instances, vllm, backend=engine,
                            sets=[*sets, *extra], after=engine_figures(True))


def _trace_line(t: dict) -> str:
    return (f"round {t['round']}: {t['sessions']} sessions, {t['turns']} turns (mean {t['mean_turns']}), prompts mean "
            f"{t['prompt_tokens_mean']:.0f} / max {t['prompt_tokens_max']} tokens; working set {t['working_set_tokens']} "
            f"tokens = {t['working_set_over_kv']}x the cluster's KV ({t['kv_tokens']}); a perfect cache serves "
            f"{100 * t['shareable_fraction']:.1f}% of prompt tokens")


def summarize(rows: list[dict]) -> dict:
    """Per system: the median and range over rounds of each figure; failures summed."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["system"], []).append(r)
    figures = {"p99_ttft_ms": lambda r: r["p99_ttft_ms"], "mean_ttft_ms": lambda r: r["mean_ttft_ms"],
               "p50_ttft_ms": lambda r: r["p50_ttft_ms"], "turns_per_s": lambda r: r["turns_per_s"],
               "of_perfect": lambda r: r["cache"]["of_perfect"], "busiest_over_fair": lambda r: r["busiest_over_fair"]}
    out = {}
    for name, rs in by.items():
        entry: dict = {"failed": sum(r["failed"] for r in rs), "rounds": len(rs)}
        for key, get in figures.items():
            xs = sorted(x for x in (get(r) for r in rs) if x is not None)
            entry[key] = {"median": xs[len(xs) // 2], "min": xs[0], "max": xs[-1]} if xs else None
        out[name] = entry
    return out


def _show(res: dict) -> None:
    for t in res["traces"]:
        Console().print(_trace_line(t), markup=False, highlight=False)
    table = Table(title=f"bench sessions · {res['instances']} {res['engine']} engines of {res['kv_tokens']} KV tokens · "
                        f"{res['cores']} cores")
    for col in ("round", "system", "failed", "TTFT ms mean/P50/P99", "of perfect cache", "busiest/fair", "turns/s"):
        table.add_column(col, justify="left" if col == "system" else "right", no_wrap=True)
    for r in res["rounds"]:
        c = r["cache"]
        ttft = "-" if r["mean_ttft_ms"] is None else f"{r['mean_ttft_ms']:.0f}/{r['p50_ttft_ms']:.0f}/{r['p99_ttft_ms']:.0f}"
        table.add_row(str(r["round"]), r["system"], str(r["failed"]), ttft,
                      "-" if c["of_perfect"] is None else f"{100 * c['of_perfect']:.1f}%",
                      "-" if r["busiest_over_fair"] is None else f"{r['busiest_over_fair']:.2f}x",
                      "-" if r["turns_per_s"] is None else f"{r['turns_per_s']:.2f}")
    Console(width=max(Console().width, 110)).print(table)  # (a pipe's 80 columns would cut the figures)
    if res["not_declared"]:
        Console().print(f"not on this build, not passed: {', '.join(res['not_declared'])}", markup=False)
