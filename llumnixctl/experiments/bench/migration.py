"""``llumnixctl bench migration``: the paper's Fig 10 on a local two-instance cluster.

For each request length L (prompt tokens), on instance i0 of a throw-away cluster with a KV-heavy model:

1. A streamed request with an L-token prompt decodes; once it has made a few tokens it is live-migrated
   (multi-stage pre-copy) to the other instance, and back, ``--repeat`` times, with a few tokens of steady
   decoding in between. Figures: the medians of the migrations' downtime and total time (the outcome that
   ``llumnixctl migrate`` prints), and the request's mean decode step time (gaps between its tokens at the
   client) outside the migrations and inside their pre-copy stages; and the client's gap: the longest wait
   between two tokens that overlaps a migration's last stage (downtime plus what the steps around it add).
2. Recomputation, the alternative to moving KV: i1 prefills the request's tokens (prompt plus output so far)
   from scratch: the time to its first token, submitted straight to i1's request socket.
3. Blocking copy, the other alternative: another request of the same length is migrated with
   ``--blocking`` (suspend first, then copy everything): its downtime.

``--shared-prefix P`` (vLLM, prefix caching on) measures what a long shared prefix saves instead: per length
L above P, a request whose prompt is a P-token prefix plus its own tokens decodes on one instance and is
migrated once to the other, first while the destination holds nothing of it ("before": the bytes and
downtime of a migration without prefix caching), then, for a request with a new prefix, after the
destination served a request that starts with that prefix ("after": its prefix cache holds it, and those
blocks stay out of the copy). The JSON's ``shared_prefix`` holds both; ``results`` is then empty.

Nothing here asserts a timing; the figures depend on the machine (see the closing notes in the tracker).

``--netns``: the same across "hosts" (llumnixctl.lab.netns): each instance in its own network namespace, the
manager, the proxy and the benchmark client in a control one, all on a private bridge; ``--rate`` and
``--delay-ms`` shape the instances' links (tc). The command builds the namespaces, measures what one TCP
stream gets from i0 to i1, then runs itself again inside the control namespace; the JSON's ``network``
records all of it. Needs root and iproute2.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Annotated

import psutil
import typer
from rich.console import Console
from rich.table import Table

from daemons import wire
from daemons.config import ConfigError, load_config
from llumnixctl.admin import AdminClient
from llumnixctl.lab import localcluster
from llumnixctl.lab.procs import stop
from llumnixctl.experiments.bench import headroom
from llumnixctl.experiments.bench.streamclock import TimedStream, recompute_ms
from llumnixctl.experiments.bench.budget import (DEFAULT_BUDGET_S, STOP_RESERVE_S, Budget, BudgetOpt, JsonOpt, Progress,
                                                 estimate, skipped_lines)
from llumnixctl.lab.scratch import scratch_dir

DEFAULT_LENGTHS = "256,512,1024,2048,4096,8192"
AUTO_DECODE_TOKENS = 2048  # --decode-tokens 0: the room each request has past its prompt (the context holds it)
LAB_ENV = "LLUMNIX_BENCH_NETNS"  # set for the run inside the control namespace: the lab, as JSON
KV_BYTES_PER_TOKEN = 64 * 1024  # the kv-heavy model: 32 layers x 8 KV heads x 64 x 2 (K, V) x 2 bytes


def _longest(lengths: list[int], decode_tokens: int) -> int:
    """The instances' context length (model.max_model_len)."""
    return max(max(lengths) + decode_tokens + 64, 4096)


def _settings(backend: str, model: Path | None, lengths: list[int], decode_tokens: int,
              prefix_caching: bool = False) -> list[str]:
    longest = _longest(lengths, decode_tokens)
    blocks_tokens = 2 * longest + 1024  # a migrated request and the blocking-copy one may overlap briefly
    common = ["manager.dispatch_policy=flood", f"instance.log_level={os.environ.get('LLUMNIX_BENCH_LOG', 'warning')}", "proxy.log_level=warning",
              f"model.max_model_len={longest}", "migration.timeout_s=60"]
    if backend == "sim":
        return common + ["sim.kv_layers=32", "sim.kv_heads=8", "sim.head_dim=64", "sim.kv_dtype=bfloat16",
                         "sim.block_size=32", f"sim.num_blocks={blocks_tokens // 32 + 1}", "sim.eos_rate=0",
                         f"sim.max_num_batched_tokens={longest}"]
    # A CPU prefill of thousands of tokens holds the GIL for seconds at a time (vLLM's CPU attention op), so
    # the instance's event loop may hear nothing for longer than the watchdog and proxy-liveness defaults.
    return common + ["instance.step_timeout_s=900", "instance.orphan_timeout_s=900",
                     f"model.path={model}", "model.name=bench", "vllm.block_size=32",
                     f"vllm.kv_cache_bytes={blocks_tokens * KV_BYTES_PER_TOKEN}", "vllm.max_num_seqs=8"] + \
        (["vllm.enable_prefix_caching=true"] if prefix_caching else [])


def _placement(lab: dict):
    """localcluster.up's place and manager_host for a lab (Lab.describe()): instance iK on host iK, the
    manager and the proxy here (the control host), every socket on the lab's addresses."""
    hosts = lab["hosts"]
    ctl = hosts["ctl"]["address"]
    common = ["security.trusted_network=true"]  # no keys: the lab's bridge reaches nobody else

    def place(name: str) -> tuple[list[str], list[str]]:
        if name.startswith("instance-"):
            iid = name.split("-", 1)[1]
            h = hosts[iid]
            return (["ip", "netns", "exec", h["netns"]],
                    common + [f"instance.request_address=tcp://{h['address']}:0", f"migration.kv_host={h['address']}",
                              f"instance.host={iid}"])
        if name == "proxy":
            return [], common + [f"proxy.token_address=tcp://{ctl}:0"]
        return [], common

    return place, ctl


def run(backend: str, model: Path | None, lengths: list[int], decode_tokens: int, log, repeat: int = 4,
        gap_tokens: int = 8, lab: dict | None = None, extra: list[str] | None = None, shared_prefix: int = 0,
        budget: Budget | None = None, progress: Progress | None = None) -> dict:
    """The benchmark; ``lab``: run across the hosts of a llumnixctl.lab.netns lab (Lab.describe() plus what
    --netns measured), from inside its control host; ``extra``: settings after the benchmark's own (--set);
    ``shared_prefix``: measure a shared prefix of this many tokens instead (vLLM); ``budget``: lengths whose
    estimate (from the lengths measured before, ``budget.estimate``) does not fit in what is left are skipped
    (JSON ``skipped``); ``progress``: a line per length and migration on stderr."""
    budget = budget or Budget(None)
    progress = progress or Progress(len(lengths), heartbeat_s=None)
    measured: list[tuple[int, float]] = []  # (length, seconds) of the lengths run so far

    def consider(n: int) -> bool:
        est = estimate(measured, n)
        if budget.consider({"tokens": n}, est, STOP_RESERVE_S):
            progress.step(f"length {n}")
            return True
        progress.skipped(f"length {n}", budget.skipped[-1]["reason"])
        return False
    run_dir = scratch_dir("llumnix-bench-mig-")
    place, manager_host = _placement(lab) if lab else (None, "127.0.0.1")
    generated = backend == "vllm" and model is None
    try:
        if generated:
            from llumnixctl.lab.model import write_tiny_model

            log("writing the kv-heavy test model ...")
            model = write_tiny_model(run_dir / "kv-heavy", size="kv-heavy")
        log("starting two instances ...")
        progress.update("starting two instances")
        state = localcluster.up(run_dir, 2, backend, 0, None,
                                _settings(backend, model, lengths, decode_tokens, shared_prefix > 0) + list(extra or []),
                                timeout_s=600, place=place, manager_host=manager_host)
    except localcluster.ClusterError as exc:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise RuntimeError(str(exc)) from None
    admin = AdminClient(state.manager_address, timeout_s=600)
    results, prefix_rows = [], []
    try:
        addresses = {v.instance_id: v.request_address for v in admin.status().instances}
        rng = random.Random(0)
        model_name = "bench" if backend == "vllm" else "llumnix-sim"
        for n in lengths if shared_prefix else []:
            if n <= shared_prefix:
                log(f"{n} tokens: not longer than the shared prefix ({shared_prefix}); skipped")
                progress.skipped(f"length {n}", budget.skip({"tokens": n}, "not longer than the shared prefix")["reason"])
                continue
            if not consider(n):
                continue
            t_len = time.monotonic()
            log(f"{n} tokens, {shared_prefix} of them a shared prefix ...")
            row = {"tokens": n}
            for when in ("before", "after"):
                prefix = [rng.randrange(10, 1000) for _ in range(shared_prefix)]  # new each time: cached nowhere
                s = TimedStream(state.url, model_name, prefix + [rng.randrange(10, 1000) for _ in range(n - shared_prefix)],
                            decode_tokens)
                s.wait(8, timeout=900)
                there = _other(_where(admin, s.rid), addresses)
                if when == "after":  # the destination serves another request with the same prefix first
                    recompute_ms(addresses[there], prefix + [rng.randrange(10, 1000) for _ in range(32)],
                                  timeout_s=900, reply_host=manager_host)
                out = admin.migrate(there, request_id=s.rid).outcomes[0]
                s.end()
                if out.outcome != "committed":
                    raise RuntimeError(f"the {n}-token migration ({when} the shared prefix) aborted: {out.reason}")
                row[when] = {"bytes": out.bytes, "blocks": out.blocks, "cached_blocks": out.cached_blocks,
                             "downtime_ms": out.downtime_ms, "migration_ms": out.total_ms}
                wait_idle(admin)
            prefix_rows.append(row)
            measured.append((n, time.monotonic() - t_len))
        for n in [] if shared_prefix else lengths:
            if not consider(n):
                continue
            t_len = time.monotonic()
            log(f"{n} tokens ...")
            prompt = [rng.randrange(10, 1000) for _ in range(n)]
            # (1) live migrations with pre-copy, back and forth, and the decode step time around them. The
            # request may run to the context's end: it is ended after its last move. Before each move it must
            # have the tokens the moves left need (a pre-copy that outlasts them would find it finished), from
            # what the moves so far took: else the benchmark stops with the --decode-tokens that would do.
            room = max(decode_tokens, _longest(lengths, decode_tokens) - n - 64)
            s = TimedStream(state.url, model_name, prompt, room)
            s.wait(8, timeout=900)
            here = _where(admin, s.rid)
            outs, windows = [], []
            for k in range(repeat):
                progress.update(f"length {n}, migration {k + 1}/{repeat}")
                there = _other(here, addresses)
                step_ms = headroom.step_ms(s.times)
                if outs:
                    need = headroom.moves_need(max(o.total_ms for o in outs), step_ms, repeat - k, gap_tokens)
                    if room - len(s.ids) < need:
                        raise RuntimeError(headroom.hint(n, room - len(s.ids), max(o.total_ms for o in outs), step_ms,
                                                      repeat, gap_tokens))
                t0 = time.perf_counter()
                try:
                    out = admin.migrate(there, request_id=s.rid).outcomes[0]
                except RuntimeError as exc:  # the manager's answer: not found (it finished), or busy
                    out = wire.MigrationOutcome(s.rid, here, there, "aborted", str(exc))
                if out.outcome != "committed":
                    ended = len(s.ids) >= room or not s.is_alive()
                    hint = "" if not ended else " (it ended: " + headroom.hint(
                        n, 0, (time.perf_counter() - t0) * 1e3, step_ms, repeat, gap_tokens) + ")"
                    raise RuntimeError(f"the {n}-token migration aborted: {out.reason}{hint}")
                outs.append(out)
                windows.append((t0, t0 + (out.total_ms - out.downtime_ms) / 1e3, t0 + out.total_ms / 1e3))
                s.wait(min(len(s.ids) + gap_tokens, s.max_tokens), timeout=300)  # steady decoding in between
                here = there
            s.end()
            gaps = list(zip(s.times, s.times[1:]))
            quiet = [(b - a) * 1e3 for a, b in gaps if not any(a < end and b > t0 for t0, _, end in windows)]
            during = [(b - a) * 1e3 for a, b in gaps for t0, precopy_end, _ in windows if t0 <= a and b <= precopy_end]
            # What the client sees of the last stage: the longest gap between tokens that overlaps it
            stalls = [max([(b - a) * 1e3 for a, b in gaps if a < end and b > last], default=0.0)
                      for _, last, end in windows]
            # (2) recomputation: an instance prefills what the request had when it first moved
            progress.update(f"length {n}, recomputation and blocking copy")
            recompute = recompute_ms(addresses[here], prompt + s.ids[:outs[0].resumed_at], timeout_s=900,
                                      reply_host=manager_host)
            # (3) blocking stop-and-copy of a request of the same length
            b = TimedStream(state.url, model_name, prompt, room)  # ended once it moved
            b.wait(8, timeout=900)
            blocking = admin.migrate(_other(_where(admin, b.rid), addresses), request_id=b.rid, blocking=True).outcomes[0]
            b.end()
            if blocking.outcome != "committed":
                raise RuntimeError(f"the {n}-token blocking copy aborted: {blocking.reason}")
            results.append({
                "tokens": n,
                "downtime_ms": statistics.median(o.downtime_ms for o in outs),
                "migration_ms": statistics.median(o.total_ms for o in outs),
                "stages": outs[0].stages, "bytes": outs[0].bytes, "migrations": len(outs),
                "downtime_ms_all": [round(o.downtime_ms, 3) for o in outs],
                # Of each downtime, the destination's wait for its step boundary and the commit (the rest: the copy).
                "downtime_join_ms": statistics.median(o.join_ms for o in outs),
                "downtime_copy_ms": statistics.median(o.downtime_ms - o.join_ms for o in outs),
                "blocking_copy_ms": blocking.downtime_ms, "recompute_ms": recompute,
                "decode_step_ms": statistics.mean(quiet) if quiet else None,
                "decode_step_migrating_ms": statistics.mean(during) if during else None,
                "decode_steps": len(quiet), "decode_steps_during_migration": len(during),
                "client_gap_ms": statistics.median(stalls),
                "decode_slowdown_pct": (statistics.mean(during) / statistics.mean(quiet) - 1) * 100
                if quiet and during else None,
            })
            wait_idle(admin)
            measured.append((n, time.monotonic() - t_len))
    finally:
        admin.close()
        localcluster.stop(state)
        shutil.rmtree(run_dir, ignore_errors=True)
    if backend == "sim":
        label = "sim (kv-heavy shape)"
    else:
        label = "kv-heavy (generated)" if generated else str(model)
    network = {"netns": False}
    if lab:
        network = {"netns": True, "rate": lab.get("rate") or None, "delay_ms": lab.get("delay_ms", 0.0),
                   "link_gbps_measured": lab.get("link_gbps_measured"), "delay_available": lab.get("delay_available"),
                   "hosts": {n: h["address"] for n, h in lab["hosts"].items()}}
    result = {"backend": backend, "model": label, "cores": psutil.cpu_count(), "network": network, "results": results,
              **budget.fields()}
    if shared_prefix:
        result["shared_prefix"] = {"tokens": shared_prefix, "results": prefix_rows}
    return result


def _where(admin: AdminClient, request_id: str) -> str:
    for _ in range(100):
        found = [r.instance_id for r in admin.requests().requests if r.request_id == request_id]
        if found:
            return found[0]
        time.sleep(0.05)
    raise RuntimeError(f"request {request_id} is on no instance")


def _other(instance_id: str, addresses: dict[str, str]) -> str:
    return next(i for i in sorted(addresses) if i != instance_id)


def wait_idle(admin: AdminClient, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while any(v.load.running or v.load.waiting or v.load.blocks_used for v in admin.status().instances):
        if time.monotonic() > deadline:
            raise RuntimeError("the instances did not go idle between lengths")
        time.sleep(0.1)


def command(
    backend: Annotated[str, typer.Option(metavar="vllm|sim", help="vllm (a generated KV-heavy model, or --model) or sim (same KV shape); another value gives status 2")] = "vllm",
    lengths: Annotated[str, typer.Option(metavar="N,N...", help="comma-separated prompt lengths, in tokens; anything but positive integers gives status 2")] = DEFAULT_LENGTHS,
    model: Annotated[Path | None, typer.Option(metavar="DIR", help="vllm: checkpoint directory (default: generate the kv-heavy model)")] = None,
    decode_tokens: Annotated[int, typer.Option(help=f"room past the prompt for each benchmark request's output (raised to 8 + 24 per repetition if less); 0: {AUTO_DECODE_TOKENS}. Requests are ended once measured; before each move the benchmark checks, from what the moves so far took, that the request cannot finish during the moves left, else it stops with the value that would do", min=0)] = 0,
    repeat: Annotated[int, typer.Option(help="live migrations per length (back and forth)", min=1)] = 4,
    json_: JsonOpt = False,
    netns: Annotated[bool, typer.Option("--netns", help="each instance on its own network namespace (\"host\"); manager, proxy and client on a control one (root)")] = False,
    rate: Annotated[str, typer.Option(metavar="RATE", help="with --netns: limit each instance's link, both ways (tc rate: 10gbit, 1gbit; empty = no limit)")] = "",
    delay_ms: Annotated[float, typer.Option(help="with --netns: added one-way latency between the instances (half on each instance's link, each way)", min=0.0)] = 0.0,
    set_: Annotated[list[str] | None, typer.Option("--set", help="setting for every daemon, after the benchmark's own (so it wins over them): section.key=value; on a GPU node e.g. vllm.gpu_memory_utilization=0.4 (the two instances share the GPU) and vllm.omp_threads=0 (leave OpenMP alone); a bad one gives status 2")] = None,
    shared_prefix: Annotated[int, typer.Option(help="vllm: measure instead what prefix caching saves a migration whose prompt starts with a prefix of this many tokens that the destination served before (bytes, cached blocks, downtime; before/after); lengths up to it are skipped", min=0)] = 0,
    budget_s: BudgetOpt = DEFAULT_BUDGET_S,
) -> None:
    """Live-migration downtime against blocking copy and recomputation, per request length (the paper's Fig 10).

    Lengths run shortest first; a length whose estimate (from the lengths measured before it) does not fit in
    what is left of --budget-s is skipped, and the output says so (--json: skipped)."""
    budget = Budget(budget_s)
    err = Console(stderr=True)
    if backend not in ("vllm", "sim"):
        err.print(f"llumnixctl: unknown --backend {backend!r}; choose vllm or sim", markup=False)
        raise typer.Exit(2)
    try:
        sizes = sorted({int(x) for x in lengths.split(",") if x.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        err.print(f"llumnixctl: --lengths must be positive integers separated by commas; got {lengths!r}", markup=False)
        raise typer.Exit(2)
    if shared_prefix and backend != "vllm":
        err.print("llumnixctl: --shared-prefix needs --backend vllm (the sim has no prefix cache)", markup=False)
        raise typer.Exit(2)
    if shared_prefix and sizes[-1] <= shared_prefix:
        err.print(f"llumnixctl: --shared-prefix {shared_prefix} leaves no length to measure: give --lengths longer "
                  "than it", markup=False)
        raise typer.Exit(2)
    if (rate or delay_ms) and not netns:
        err.print("llumnixctl: --rate and --delay-ms shape the links between namespaces: add --netns", markup=False)
        raise typer.Exit(2)
    extra = list(set_ or [])
    decode_tokens = max(decode_tokens or AUTO_DECODE_TOKENS, 8 + repeat * 24)
    try:  # a bad setting fails here, not in a daemon's log
        load_config(None, _settings(backend, model, sizes, decode_tokens, shared_prefix > 0) + extra,
                    {"instance.backend": backend})
    except ConfigError as exc:
        sys.stderr.write(f"llumnixctl: {exc}\n")  # one line, never wrapped
        raise typer.Exit(2)
    lab = json.loads(os.environ[LAB_ENV]) if netns and os.environ.get(LAB_ENV) else None
    if netns and lab is None:  # build the hosts, then run again inside the control one
        argv = ["bench", "migration", "--backend", backend, "--lengths", lengths, "--decode-tokens", str(decode_tokens),
                "--repeat", str(repeat), "--netns", "--rate", rate, "--delay-ms", str(delay_ms),
                "--budget-s", str(max(1.0, budget.left()) if budget.budget_s else 0)]
        argv += (["--model", str(model.resolve())] if model else []) + (["--json"] if json_ else [])
        argv += [a for x in extra for a in ("--set", x)] + (["--shared-prefix", str(shared_prefix)] if shared_prefix else [])
        raise typer.Exit(_in_lab(argv, rate, delay_ms, err))
    try:
        with Progress(len(sizes), start=budget.t0) as progress:
            result = run(backend, model.resolve() if model else None, sizes,
                         decode_tokens, lambda m: err.print(m, markup=False), repeat=repeat, lab=lab,
                         extra=extra, shared_prefix=shared_prefix, budget=budget, progress=progress)
    except RuntimeError as exc:
        err.print(f"llumnixctl: {exc}", markup=False)
        raise typer.Exit(1) from None
    if json_:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
        return
    title = f"live migration · backend {backend} · {result['model']} · {result['cores']} cores"
    if result["network"]["netns"]:
        net = result["network"]
        title += (f" · across namespaces, link {net['rate'] or 'unshaped'}"
                  + (f" + {net['delay_ms']:g} ms" if net["delay_ms"] else "")
                  + (f" (one TCP stream: {net['link_gbps_measured']:.1f} Gbit/s)" if net.get("link_gbps_measured") else ""))
    console = Console(width=None if sys.stdout.isatty() else 160)  # piped: never squeeze the table

    def ms(x):
        return "-" if x is None else f"{x:.2f}"

    if shared_prefix:
        table = Table(title=f"{title} · shared prefix of {shared_prefix} tokens, prefix caching on")
        for col in ("tokens", "before: MB moved", "downtime ms", "after: MB moved", "cached blocks", "downtime ms"):
            table.add_column(col, justify="right")
        for r in result["shared_prefix"]["results"]:
            b, a = r["before"], r["after"]
            table.add_row(str(r["tokens"]), f"{b['bytes'] / 1e6:.1f}", ms(b["downtime_ms"]), f"{a['bytes'] / 1e6:.1f}",
                          str(a["cached_blocks"]), ms(a["downtime_ms"]))
        console.print(table)
        _print_skipped(console, result)
        return
    table = Table(title=title)
    for col in ("tokens", "MB moved", "stages", "downtime ms (median)", "copy / join ms", "migration ms (median)",
                "blocking copy ms",
                "recompute ms", "decode step ms", "while migrating", "slowdown %", "client gap ms"):
        table.add_column(col, justify="right")
    for r in result["results"]:
        slowdown = r.get("decode_slowdown_pct")
        table.add_row(str(r["tokens"]), f"{r['bytes'] / 1e6:.1f}", str(r["stages"]), ms(r["downtime_ms"]),
                      f"{ms(r.get('downtime_copy_ms'))} / {ms(r.get('downtime_join_ms'))}", ms(r["migration_ms"]), ms(r["blocking_copy_ms"]), ms(r["recompute_ms"]),
                      ms(r["decode_step_ms"]), ms(r["decode_step_migrating_ms"]),
                      "-" if slowdown is None else f"{slowdown:+.1f}", ms(r["client_gap_ms"]))
    console.print(table)
    _print_skipped(console, result)


def _print_skipped(console: Console, result: dict) -> None:
    for line in skipped_lines(result.get("skipped", []), lambda s: f"length {s['tokens']}"):
        console.print(line, markup=False)


def _in_lab(argv: list[str], rate: str, delay_ms: float, err: Console) -> int:
    """Build a lab (ctl, i0, i1), shape the instances' links, measure i0 -> i1, and run ``llumnixctl argv``
    inside ctl with the lab in $LLUMNIX_BENCH_NETNS. The namespaces and whatever runs in them are gone
    when this returns (also on Ctrl-C or SIGTERM). Returns the inner run's exit status."""
    from llumnixctl.lab.netns import Lab, LabError, parse_rate

    why = Lab.unavailable()
    if why:
        err.print(f"llumnixctl: --netns: {why}", markup=False)
        return 2
    old = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # leave through the with: the lab is removed
    try:
        with Lab(["ctl", "i0", "i1"]) as lab:
            try:
                bps = parse_rate(rate)
                for host in ("i0", "i1"):
                    if bps or delay_ms:
                        lab.shape(host, rate=bps or None, delay_ms=delay_ms / 2)
            except LabError as exc:
                err.print(f"llumnixctl: --netns: {exc}", markup=False)
                return 2
            probe = min(256 << 20, max(16 << 20, bps // 8)) if bps else 256 << 20  # about a second at the rate
            link = lab.throughput("i0", "i1", probe, timeout_s=60)
            err.print(f"lab {lab.run_id}: instances at {lab.address('i0')}, {lab.address('i1')}; link "
                      f"{rate or 'unshaped'}{f' + {delay_ms:g} ms' if delay_ms else ''}: one TCP stream "
                      f"{link / 1e9:.2f} Gbit/s", markup=False)
            desc = dict(lab.describe(), rate=rate, delay_ms=delay_ms, link_gbps_measured=round(link / 1e9, 3),
                        delay_available=lab.can_delay())
            env = dict(os.environ, **{LAB_ENV: json.dumps(desc)})
            child = subprocess.Popen(lab.prefix("ctl") + [sys.executable, "-m", "llumnixctl.main"] + argv, env=env)
            try:
                return child.wait(timeout=6 * 3600)
            except subprocess.TimeoutExpired:
                err.print("llumnixctl: the benchmark ran for 6 hours; stopping it", markup=False)
                return 1
            finally:
                stop([child], 30)
    finally:
        signal.signal(signal.SIGTERM, old)
