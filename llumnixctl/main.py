"""llumnixctl: inspect and operate a Llumnix cluster.

Every command finds the manager from --manager, else $LLUMNIX_MANAGER, else the run directory named by
--run-dir (or $LLUMNIX_RUN_DIR), else manager.address of the config named by --config (or $LLUMNIX_CONFIG),
else the default run directory's local cluster, else manager.address of /etc/llumnix/llumnix.toml if it
exists, else the default manager address. Read commands take --json; its shape is a contract for scripts
(fields are added, never renamed).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from daemons import wire
from daemons.cli import version_callback
from daemons.config import ConfigError, load_config
from daemons.config_text import as_dict, render_example
from llumnixctl import lora, operate, sessions
from llumnixctl.admin import AdminClient, ManagerUnreachable
from llumnixctl.common import (ConfigOpt, JsonOpt, ManagerOpt, RunDirOpt, TimeoutOpt, admin, ask, die, instance_json,
                               out, print_json, unreachable_message)
from llumnixctl.commands import Commands
from llumnixctl.statusview import flags_text, number_text, render_status, status_json  # noqa: F401  (status_json: for scripts)

# add_completion: --install-completion / --show-completion (bash, zsh, fish, PowerShell)
app = typer.Typer(cls=Commands, add_completion=True, no_args_is_help=True,
                  help="Operate a Llumnix cluster: local clusters, status, requests, benchmarks.")
config_app = typer.Typer(no_args_is_help=True, help="Settings: the example file, the effective values.")
app.add_typer(config_app, name="config")
app.add_typer(lora.app, name="lora")


@app.callback()
def _options(
    version: Annotated[bool, typer.Option("--version", is_eager=True, callback=version_callback("llumnixctl"),
                                          help="Print the version and exit.")] = False,
) -> None:
    pass

# ---------------------------------------------------------------------- local cluster


@app.command()
def up(
    instances: Annotated[int, typer.Option("--instances", "-n", min=1, help="number of instances")] = 2,
    backend: Annotated[str, typer.Option(metavar="sim|vllm", help="engine backend of the instances: sim or vllm")] = "sim",
    model: Annotated[Optional[Path], typer.Option(metavar="DIR", help="checkpoint directory for the vllm backend (default: model.path, else a tiny random model in the run dir)")] = None,
    port: Annotated[int, typer.Option(help="proxy HTTP port on 127.0.0.1 (0 = any free port)")] = 8000,
    proxies: Annotated[int, typer.Option("--proxies", min=1, help="number of proxies: the first on --port, the others on free ports; every URL is printed")] = 1,
    config: Annotated[Optional[str], typer.Option("--config", "-c", envvar="LLUMNIX_CONFIG", show_envvar=True, metavar="FILE",
                                                  help="settings file (llumnix.toml), passed to every daemon")] = None,
    run_dir: RunDirOpt = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="setting for every daemon: section.key=value")] = None,
    timeout: Annotated[float, typer.Option(help="seconds to wait for the cluster to serve (a large model on the vllm backend may need more)")] = 60.0,
    roles: Annotated[Optional[str], typer.Option("--roles", metavar="ROLE,...", help="the instances' roles in order (instance.role: mixed, prefill or decode; those not named are mixed), e.g. prefill,decode: prefill/decode disaggregation")] = None,
    json_: JsonOpt = False,
) -> None:
    """Start a local cluster in the background (manager, instances, proxy) and wait until it serves.

    To serve to an SLO, give its targets: --set slo.ttft_ms=MS --set slo.tpot_ms=MS (admission by predicted
    time to first token, 429 with Retry-After past it; llumnixctl status shows predictions and attainment).

    To disaggregate prefill and decode, give roles: --roles prefill,decode (long prompts prefill on i0 and are
    handed over to i1 by live migration at their first token; llumnixctl role changes them at run time)."""
    from llumnixctl.lab import localcluster  # the lab's: operator commands run without it

    run_dir = run_dir or localcluster.default_run_dir()
    sets = list(set_ or [])
    role_list = [r.strip() for r in roles.split(",")] if roles else []
    bad = [r for r in role_list if r not in ("mixed", "prefill", "decode")]
    if bad or len(role_list) > instances:
        die(f"--roles {roles!r}: " + (f"unknown role {bad[0]!r} (mixed, prefill or decode)" if bad else
                                      f"{len(role_list)} roles for {instances} instance(s)"), 2)
    try:
        cfg = load_config(config, sets, {"instance.backend": backend})  # fail here, not in a child's log
        if backend == "vllm":
            sets += model_settings(cfg, model, run_dir)
        elif model is not None:
            die("--model is for --backend vllm: the sim engine has no model", 2)
        state = localcluster.up(run_dir, instances, backend, port, config, sets, timeout, proxies=proxies,
                                roles=role_list)
    except (ConfigError, localcluster.ClusterError) as exc:
        die(str(exc), 2 if isinstance(exc, ConfigError) else 1)
    if json_:
        print_json({"url": state.url, "urls": state.urls, "manager": state.manager_address, "run_dir": str(run_dir),
                    "processes": [{"name": p.name, "pid": p.pid, "log": p.log} for p in state.procs]})
        return
    out.print(f"cluster up: {instances} {backend} instance(s)" + (f", {proxies} proxies" if proxies > 1 else "")
              + (f"; roles {', '.join(f'i{i} {r}' for i, r in enumerate(role_list))}" if role_list else ""))
    for url in state.urls:
        out.print(f"  OpenAI API  {url}/v1")
    out.print(f"  manager     {state.manager_address}")
    out.print(f"  run dir     {run_dir} (logs: *.log)")
    if not (cfg.slo.ttft_ms or cfg.slo.tpot_ms):
        out.print("  SLO         off (serve to one: --set slo.ttft_ms=2000 --set slo.tpot_ms=100, in ms)")
    else:
        out.print(f"  SLO         TTFT {cfg.slo.ttft_ms:g} ms, TPOT {cfg.slo.tpot_ms:g} ms (0: none); attainment in "
                  "llumnixctl status")
    out.print("stop it with: llumnixctl down" + ("" if run_dir == localcluster.default_run_dir() else f" --run-dir {run_dir}"))


@app.command()
def down(run_dir: RunDirOpt = None, json_: JsonOpt = False) -> None:
    """Stop the processes that `up` started from this run directory (SIGTERM, then SIGKILL)."""
    from llumnixctl.lab import localcluster

    run_dir = run_dir or localcluster.default_run_dir()
    try:
        stopped = localcluster.down(run_dir)
    except localcluster.ClusterError as exc:
        die(str(exc))
    if json_:
        print_json({"stopped": [{"name": p.name, "pid": p.pid} for p in stopped]})
    else:
        out.print(f"stopped {len(stopped)} process(es) from {run_dir}")


# ---------------------------------------------------------------------- inspection


@app.command()
def status(manager: ManagerOpt = None, run_dir: RunDirOpt = None, config: ConfigOpt = None,
           timeout: TimeoutOpt = 2.0, json_: JsonOpt = False,
           watch: Annotated[bool, typer.Option("--watch", "-w", help="refresh every --interval seconds until Ctrl-C; with --json, one JSON object per line")] = False,
           interval: Annotated[float, typer.Option("--interval", min=0.05, help="with --watch: seconds between refreshes (an answer slower than that delays the next one)")] = 1.0) -> None:
    """Per instance: state and flags, blocks, running, waiting, virtual usage, freeness, migrations; totals.

    With --watch, a live view refreshed every --interval seconds until Ctrl-C (exit 0); with --json as well,
    one status object per line per interval (JSON lines)."""
    client = admin(manager, run_dir, config, timeout)
    data = status_json(ask(client, AdminClient.status), client.address)
    if watch:
        try:
            (_watch_json if json_ else _watch_table)(client, data, interval)
        except KeyboardInterrupt:
            pass  # Ctrl-C is how a watch ends: exit 0
        except BrokenPipeError:  # `status --watch --json | head -3`: the reader has had enough
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return
    if json_:
        print_json(data)
        return
    out.print(render_status(data))


def _ticks(interval: float):
    """Yield once every ``interval`` seconds (a slow answer delays the next tick; ticks never bunch up)."""
    due = time.monotonic()
    while True:
        due += interval
        time.sleep(max(0.0, due - time.monotonic()))
        due = max(due, time.monotonic())
        yield


def _poll(client: AdminClient) -> tuple[dict | None, str]:
    """(status data, "") or (None, the one-line reason) when the manager did not answer this time."""
    try:
        return status_json(client.status(), client.address), ""
    except ManagerUnreachable as exc:
        return None, unreachable_message(client, exc)


def _watch_json(client: AdminClient, data: dict, interval: float) -> None:
    def emit(data: dict) -> None:
        sys.stdout.write(json.dumps(data) + "\n")
        sys.stdout.flush()

    emit(data)
    for _ in _ticks(interval):
        data, error = _poll(client)
        if data is not None:
            emit(data)
        else:  # this interval has no line; the watch goes on
            sys.stderr.write(f"llumnixctl: {error}\n")
            sys.stderr.flush()


def _watch_table(client: AdminClient, data: dict, interval: float) -> None:
    def frame(error: str = "") -> Group:
        note = f"{time.strftime('%H:%M:%S')} · every {interval:g}s · Ctrl-C to stop"
        parts = [render_status(data), Text(note, style="dim")]
        if error:  # the last answer stays on screen, with why it is not fresh
            parts.append(Text(f"no answer now (retrying): {error}", style="red"))
        return Group(*parts)

    def frames():
        nonlocal data
        for _ in _ticks(interval):
            fresh, error = _poll(client)
            data = fresh or data
            yield frame(error)

    if not out.is_terminal:  # piped: one frame after another, not a screen redrawn in place
        out.print(frame())
        for f in frames():
            out.print()
            out.print(f)
        return
    with Live(frame(), console=out, auto_refresh=False, transient=False) as live:
        for f in frames():
            live.update(f, refresh=True)


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def outcome_json(o: wire.MigrationOutcome) -> dict:
    return {"outcome": o.outcome, "reason": o.reason, "stages": o.stages, "blocks": o.blocks, "bytes": o.bytes,
            "downtime_ms": round(o.downtime_ms, 3), "total_ms": round(o.total_ms, 3), "request_id": o.request_id,
            "from": o.src, "to": o.dst, "resumed_at": o.resumed_at, "cached_blocks": o.cached_blocks,
            "last_stage_blocks": o.last_stage_blocks, "ended": o.ended}


@app.command()
def migrate(
    request_id: Annotated[Optional[str], typer.Argument(help="the request to move: the id of the proxy's response (see llumnixctl requests)")] = None,
    to: Annotated[str, typer.Option("--to", metavar="INSTANCE", help="destination instance id; it must be alive (a draining or cordoned one is accepted)")] = ...,
    from_: Annotated[Optional[str], typer.Option("--from", metavar="INSTANCE", help="source instance: move --count of its running requests")] = None,
    count: Annotated[int, typer.Option("--count", min=1, help="with --from: how many requests (lower priority, shorter first)")] = 1,
    blocking: Annotated[bool, typer.Option("--blocking", help="stop-and-copy: suspend the request first, then copy all its blocks in one stage; its downtime grows with its length (the baseline bench migration compares with, not for production)")] = False,
    manager: ManagerOpt = None, run_dir: RunDirOpt = None, config: ConfigOpt = None,
    timeout: Annotated[float, typer.Option("--timeout", help="seconds to wait for the outcome")] = 120.0,
    json_: JsonOpt = False,
) -> None:
    """Live-migrate a running request (or --count requests of --from) to --to; waits and prints the outcome.

    Exit status 0 when every migration committed, 1 when one aborted or none could start."""
    if (request_id is None) == (from_ is None):
        die("give either REQUEST_ID or --from INSTANCE (with --count N)", 2)
    client = admin(manager, run_dir, config, timeout)
    reply = ask(client, lambda c: c.migrate(to, request_id=request_id or "", src=from_ or "", count=count,
                                            blocking=blocking))  # a refusal (unknown instance) is one line
    outcomes = [outcome_json(o) for o in reply.outcomes]
    if json_:
        print_json(outcomes[0] if request_id is not None and outcomes else outcomes)
    elif not outcomes:
        out.print(f"nothing to migrate: {from_} has no running request that can move")
    else:
        for o in outcomes:
            if o["outcome"] == "committed":
                cached = f" ({o['cached_blocks']} already there)" if o["cached_blocks"] else ""
                out.print(f"{o['request_id']}: {o['from']} -> {o['to']} committed: {o['stages']} stages, {o['blocks']} blocks"
                          f"{cached}, {_size(o['bytes'])}, downtime {o['downtime_ms']:.2f} ms, total {o['total_ms']:.1f} ms")
            else:
                out.print(f"{o['request_id']}: {o['from']} -> {o['to']} aborted: {o['reason']}")
    if not outcomes or any(o["outcome"] != "committed" for o in outcomes):
        raise typer.Exit(1)


def request_json(r: wire.RequestInfo) -> dict:
    return {"id": r.request_id, "instance": r.instance_id, "state": r.state, "output_tokens": r.output_tokens,
            "prompt_tokens": r.prompt_tokens, "blocks": r.blocks, "priority": r.priority}


@app.command()
def requests(manager: ManagerOpt = None, run_dir: RunDirOpt = None, config: ConfigOpt = None,
             timeout: TimeoutOpt = 3.0, json_: JsonOpt = False) -> None:
    """Requests in the cluster: id, instance, state, output tokens."""
    client = admin(manager, run_dir, config, timeout)
    reply = ask(client, AdminClient.requests)
    rows = [request_json(r) for r in reply.requests]
    if json_:
        print_json({"requests": rows, "unreachable": reply.unreachable})
        return
    table = Table()
    for col in ("ID", "INSTANCE", "STATE", "OUTPUT TOKENS", "PROMPT TOKENS", "BLOCKS"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["id"], r["instance"], r["state"], str(r["output_tokens"]), str(r["prompt_tokens"]), str(r["blocks"]))
    out.print(table)
    out.print(f"{len(rows)} request(s)")
    if reply.unreachable:
        sys.stderr.write(f"llumnixctl: no answer from {', '.join(reply.unreachable)}\n")


def describe_json(view: wire.InstanceView, reply: wire.RequestsReply) -> dict:
    row = instance_json(view)
    return {
        "instance": row,  # the status row
        "registered": {k: row[k] for k in ("host", "pid", "request_address", "metrics_address", "backend", "model",
                                           "max_model_len", "block_size", "blocks_total", "max_batch_size")},
        "migrations": {"out": row["migrating_out"], "in": row["migrating_in"],
                       "committed": row["migrations_committed"], "aborted": row["migrations_aborted"],
                       "ordered": row["migrations_ordered"]},
        "requests": [request_json(r) for r in reply.requests if r.instance_id == view.instance_id],
        # False when the instance is dead or did not answer the manager's query: its requests are unknown
        "requests_answered": view.state != "dead" and view.instance_id not in reply.unreachable,
    }


app.command("sessions")(sessions.command)


@app.command()
def describe(instance: Annotated[str, typer.Argument(help="instance id (see llumnixctl status)")],
             manager: ManagerOpt = None, run_dir: RunDirOpt = None, config: ConfigOpt = None,
             timeout: TimeoutOpt = 3.0, json_: JsonOpt = False) -> None:
    """One instance: what it registered, its state, load and last report, its migrations, its requests."""
    client = admin(manager, run_dir, config, timeout)
    snap = ask(client, AdminClient.status)
    view = next((v for v in snap.instances if v.instance_id == instance), None)
    if view is None:
        die(f"no instance {instance!r} in the cluster (instances: {', '.join(v.instance_id for v in snap.instances) or 'none'})")
    data = describe_json(view, ask(client, AdminClient.requests))
    if json_:
        print_json(data)
        return
    r, reg, mig = data["instance"], data["registered"], data["migrations"]
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    notes = ["stalled (an engine step is stuck)"] if r["stalled"] else []
    grid.add_row("state", flags_text(r) + (f", {', '.join(notes)}" if notes else ""))
    grid.add_row("host", f"{reg['host']}, pid {reg['pid']}")
    grid.add_row("requests at", reg["request_address"])
    grid.add_row("metrics", reg["metrics_address"] or "off")
    grid.add_row("engine", f"{reg['backend']}, model {reg['model']}, max_model_len {reg['max_model_len']}, "
                           f"{reg['blocks_total']} blocks of {reg['block_size']} tokens, batch up to {reg['max_batch_size']}")
    grid.add_row("last report", f"{r['last_report_age_s']:.1f}s ago")
    grid.add_row("load", f"{r['blocks_used']}/{r['blocks_total']} blocks used, {r['running']} running "
                         f"({r['high_priority']} high priority), {r['waiting']} waiting, {r['preemptions']} preemptions")
    grid.add_row("", f"virtual usage {number_text(r['virtual_usage'], 'inf')}, freeness {number_text(r['freeness'], '-inf')}"
                     + (f", new-instance credit {r['credit']:.1f} blocks" if r["credit"] else ""))
    grid.add_row("", f"head-of-line request needs {r['hol_demand_blocks']} blocks; "
                     f"{r['pending_dispatches']} dispatched, not yet in its reports")
    grid.add_row("migrations", f"{mig['out']} out, {mig['in']} in now ({mig['ordered']} ordered by the manager); "
                               f"as source {mig['committed']} committed, {mig['aborted']} aborted")
    out.print(Text(f"instance {r['id']}", style="bold"))
    out.print(grid)
    if not data["requests_answered"]:
        out.print(f"requests: unknown ({'it is dead' if r['state'] == 'dead' else 'it did not answer the manager'})")
        return
    if not data["requests"]:
        out.print("requests: none")
        return
    table = Table(title=f"requests: {len(data['requests'])}", title_justify="left")
    for col in ("ID", "STATE", "PRIORITY", "OUTPUT TOKENS", "PROMPT TOKENS", "BLOCKS"):
        table.add_column(col, justify="left" if col in ("ID", "STATE", "PRIORITY") else "right")
    for q in data["requests"]:
        table.add_row(q["id"], q["state"], "high" if q["priority"] else "normal", str(q["output_tokens"]),
                      str(q["prompt_tokens"]), str(q["blocks"]))
    out.print(table)


# ---------------------------------------------------------------------- config


@config_app.command("example")
def config_example() -> None:
    """Print llumnix.toml.example: every setting at its default, with its meaning."""
    sys.stdout.write(render_example())


@config_app.command("show")
def config_show(config: ConfigOpt = None,
                set_: Annotated[Optional[list[str]], typer.Option("--set", help="override a setting: section.key=value")] = None) -> None:
    """Print the effective settings (defaults, file, overrides) as JSON; exits 2 on a bad setting."""
    try:
        print_json(as_dict(load_config(config, set_ or [])))
    except ConfigError as exc:
        die(str(exc), 2)


def model_settings(cfg, model: Path | None, run_dir: Path) -> list[str]:
    """--set lines that point a vllm cluster at its checkpoint: --model, else model.path, else a tiny model."""
    from llumnixctl.lab.model import write_tiny_model

    path = model or (Path(cfg.model.path) if cfg.model.path else None)
    if path is None:
        path = run_dir / "model-tiny"
        if not (path / "config.json").exists():
            out.print(f"no --model given: writing a tiny random-weight model to {path}")
            write_tiny_model(path)
    if not (path / "config.json").exists():
        die(f"{path} is not a model checkpoint (no config.json)")
    sets = [f"model.path={path.resolve()}"]
    if cfg.model.name == "llumnix-sim":  # the sim's default name: serve the checkpoint by its directory name
        sets.append(f"model.name={path.resolve().name}")
    return sets


operate.register(app)


def entry() -> None:
    app(prog_name="llumnixctl")  # also under `python -m llumnixctl.main`: usage lines, completion


if __name__ == "__main__":
    entry()
