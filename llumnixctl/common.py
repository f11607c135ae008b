"""What every llumnixctl command shares: finding the manager, one-line errors, JSON output, options."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from daemons import wire
from daemons.config import ConfigError, load_config
from daemons.policy import slo
from llumnixctl import rundir
from llumnixctl.admin import AdminClient, ManagerUnreachable

out = Console(width=None if sys.stdout.isatty() else 160)  # piped: never squeeze the table

RunDirOpt = Annotated[Optional[Path], typer.Option("--run-dir", envvar="LLUMNIX_RUN_DIR", show_envvar=True,
                                                   help="run directory of a local cluster: its cluster.json and logs (default $XDG_STATE_HOME/llumnix, else ~/.local/state/llumnix)")]
ManagerOpt = Annotated[Optional[str], typer.Option("--manager", help="manager address, e.g. tcp://10.0.0.5:7100 (default: $LLUMNIX_MANAGER)")]
ConfigOpt = Annotated[Optional[str], typer.Option("--config", "-c", envvar="LLUMNIX_CONFIG", show_envvar=True, metavar="FILE", help="settings file (llumnix.toml)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON for scripts")]
TimeoutOpt = Annotated[float, typer.Option("--timeout", help="seconds to wait for the manager")]


def sse_chunks(resp):
    """The JSON chunks of an OpenAI-style event stream (its ``data: {...}`` lines), in order."""
    for line in resp.iter_lines():
        if line.startswith("data: {"):
            yield json.loads(line[6:])


def die(message: str, code: int = 1) -> None:
    sys.stderr.write(f"llumnixctl: {message}\n")  # one line, never wrapped: scripts grep it
    raise typer.Exit(code)


def manager_source(manager: str | None, run_dir: Path | None, config: str | None) -> tuple[str, str]:
    """The manager's address and where it came from: --manager, else $LLUMNIX_MANAGER, else the named run
    dir, else the named config, else the default run dir, else the default config file, else defaults."""
    if manager:
        return manager, "--manager"
    if os.environ.get("LLUMNIX_MANAGER"):
        return os.environ["LLUMNIX_MANAGER"], "$LLUMNIX_MANAGER"
    if run_dir is not None:
        state = rundir.ClusterState.load(run_dir)
        if state is None:
            die(f"no local cluster in {run_dir} (no {rundir.STATE_FILE}); start one with `llumnixctl up --run-dir {run_dir}`")
        return state.manager_address, f"the local cluster in {run_dir}"
    if config is None:
        state = rundir.ClusterState.load(rundir.default_run_dir())
        if state is not None:
            return state.manager_address, f"the local cluster in {rundir.default_run_dir()}"
    try:
        cfg = load_config(config)
    except ConfigError as exc:
        die(str(exc), 2)
    return cfg.manager.address, f"manager.address of {cfg.source}" if cfg.source != "defaults" else "the default manager.address"


def manager_address(manager: str | None, run_dir: Path | None, config: str | None) -> str:
    """--manager, else $LLUMNIX_MANAGER, else the named run dir, else the named config, else the default run
    dir, else the default config file (/etc/llumnix/llumnix.toml), else defaults."""
    return manager_source(manager, run_dir, config)[0]


def security_for(config: str | None):
    """This host's keys for the cluster's sockets (security.keys_dir of the config), or None."""
    from daemons.runtime import StartupError
    from daemons.security import Security

    try:
        cfg = load_config(config)
    except ConfigError as exc:
        die(str(exc), 2)
    if not cfg.security.keys_dir:
        return None
    try:
        return Security(cfg.security, "llumnixctl")
    except StartupError as exc:
        die(str(exc), 2)


def admin(manager: str | None, run_dir: Path | None, config: str | None, timeout: float) -> AdminClient:
    address, source = manager_source(manager, run_dir, config)
    state = None
    if source.startswith("the local cluster in ") and config is None:  # its keys, if it was started with some
        state = rundir.ClusterState.load(Path(source[len("the local cluster in "):]))
    if state is not None:
        try:
            client = AdminClient.for_args(address, state.args, timeout)
        except ConfigError as exc:
            die(str(exc), 2)
    else:
        client = AdminClient(address, timeout, sec=security_for(config))
    client.source = source  # where the address came from, for the one-line error
    return client


def unreachable_message(client: AdminClient, exc: ManagerUnreachable) -> str:
    if getattr(exc, "refused", False):  # it is up, and said no to our key
        return str(exc)
    source = getattr(client, "source", "")
    source = "" if source == "--manager" else source
    return (f"{exc}{f' (address from {source})' if source else ''}. Is the cluster up? Start one with "
            f"`llumnixctl up`, or point at it with --manager, $LLUMNIX_MANAGER or --run-dir.")


def ask(client: AdminClient, what):
    try:
        return what(client)
    except ManagerUnreachable as exc:
        die(unreachable_message(client, exc))
    except RuntimeError as exc:  # the manager's ErrorReply: a refused verb (key role), an unknown instance
        die(str(exc))


def print_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def finite(x: float) -> float | None:
    """JSON has no infinity: a draining instance's usage and freeness are null."""
    return None if math.isinf(x) or math.isnan(x) else x


def instance_json(v: wire.InstanceView) -> dict:
    ld = v.load
    ttft, tpot = slo.reference_prediction(v.instance_id, ld)
    return {
        "id": v.instance_id, "host": v.host, "pid": v.pid, "state": v.state, "draining": v.draining,
        "blocks_total": ld.blocks_total, "blocks_used": ld.blocks_used, "running": ld.running,
        "waiting": ld.waiting, "freeness": finite(v.freeness), "max_batch_size": ld.batch_size,
        "preemptions": ld.preemptions, "pending_dispatches": v.pending_dispatches, "backend": v.backend,
        "model": v.model, "request_address": v.request_address, "metrics_address": v.metrics_address,
        "last_report_age_s": v.last_report_age_s,
        "migrating_out": ld.migrating_out, "migrating_in": ld.migrating_in,
        "migrations_committed": ld.migrations_committed, "migrations_aborted": ld.migrations_aborted,
        "virtual_usage": finite(v.virtual_usage), "cordoned": v.cordoned, "drain_reason": v.drain_reason,
        "migrations_ordered": v.migrations_ordered, "credit": v.credit, "high_priority": ld.high_priority,
        "hol_demand_blocks": ld.hol_demand_blocks, "max_model_len": v.max_model_len, "block_size": ld.block_size,
        "stalled": ld.stalled, "scale_in_protected": v.scale_in_protected,
        "prefix_query_tokens": ld.prefix_query_tokens, "prefix_hit_tokens": ld.prefix_hit_tokens,
        "prefix_hit_rate": round(ld.prefix_hit_tokens / ld.prefix_query_tokens, 4) if ld.prefix_query_tokens else None,
        # SLO (llumnixctl/statusview.py): predicted for a new request of slo.REFERENCE_PROMPT_TOKENS (None: no model
        # yet), and the attainment over the last slo.window_s (None: nothing judged)
        "predicted_ttft_s": _round(ttft), "predicted_tpot_s": _round(tpot),
        "slo_met": ld.slo_met, "slo_judged": ld.slo_judged,
        "slo_attainment": round(ld.slo_met / ld.slo_judged, 4) if ld.slo_judged else None,
        # The proxies' TTFT predictions for requests placed here against the actual TTFTs, over slo.window_s:
        # |predicted - actual| / actual, median and 90th percentile (None: none judged).
        "ttft_error_p50": round(ld.ttft_error_p50, 4) if ld.ttft_error_judged else None,
        "ttft_error_p90": round(ld.ttft_error_p90, 4) if ld.ttft_error_judged else None,
        "ttft_error_judged": ld.ttft_error_judged,
        "role": ld.role or "mixed",
        # LoRA: the adapters it holds, most recently used first, and its open adapter slots (free, or idle)
        "adapters": list(ld.adapters), "adapter_slots": ld.adapter_slots,
        # The host KV tier (kv_tier.host_mb): blocks held, its size in blocks, the measured restore time per block;
        # and the blocks retained for sessions within their TTL (engine and tier; free, reclaimable)
        "tier_blocks": ld.tier_blocks, "tier_capacity": ld.tier_capacity,
        "restore_ms_per_block": round(ld.restore_ms_per_block, 4), "retained_blocks": ld.retained_blocks,
    }


def _round(x: float | None) -> float | None:
    return None if x is None or math.isinf(x) or math.isnan(x) else round(x, 6)
