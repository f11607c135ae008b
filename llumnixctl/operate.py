"""Operator verbs over the manager: drain, undrain, cordon, uncordon, remove, add, role, policy.

Each one prints one line (or ``--json``) and exits non-zero when it did not happen. ``local-instance`` is
the launcher of ``llumnixctl up`` clusters (what ``add`` and auto-scaling run there), not for operators.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from daemons import wire
from daemons.policy.registry import DISPATCH, PAIRING, SCALING, SELECTION
from llumnixctl.admin import AdminClient
from llumnixctl.common import ConfigOpt, JsonOpt, ManagerOpt, RunDirOpt, admin, ask, die, instance_json, out, print_json

InstanceArg = Annotated[str, typer.Argument(help="instance id (see llumnixctl status)")]


def _call(client: AdminClient, what):
    return ask(client, what)  # the manager's refusal (unknown instance, bad name, key role) is one line


def _left(v: wire.InstanceView) -> int:
    ld = v.load
    return ld.running + ld.waiting + ld.migrating_out + ld.migrating_in + v.pending_dispatches


def drain(instance: InstanceArg, wait: Annotated[bool, typer.Option("--wait", help="wait until no request is left on it")] = False,
          timeout: Annotated[float, typer.Option("--timeout", help="with --wait: seconds to wait")] = 300.0,
          manager: ManagerOpt = None, run_dir: RunDirOpt = None, config: ConfigOpt = None, json_: JsonOpt = False) -> None:
    """Drain an instance: no new requests; running ones migrate out, queued ones are dispatched again.

    With --wait, exit 0 once nothing is left on it (1 on timeout). `undrain` reverses it."""
    client = admin(manager, run_dir, config, 5.0)
    view = _call(client, lambda c: c.drain(instance)).instance
    start = time.monotonic()
    drained_s = None
    if wait:
        last = None
        while True:
            snap = _call(client, AdminClient.status)
            view = next((v for v in snap.instances if v.instance_id == instance), None)
            if view is None or view.state == "dead":
                die(f"instance {instance} went away while draining")
            left = _left(view)
            if left == 0:
                drained_s = round(time.monotonic() - start, 3)
                break
            if not json_ and left != last:
                out.print(f"{instance}: {view.load.running} running, {view.load.waiting} queued, "
                          f"{view.load.migrating_out} migrating out")
                last = left
            if time.monotonic() - start > timeout:
                die(f"instance {instance} still has {left} request(s) after {timeout:g}s; it stays draining "
                    f"(llumnixctl undrain {instance} to cancel)")
            time.sleep(0.1)
    if json_:
        print_json({"instance": instance_json(view), "drained": drained_s is not None, "drained_s": drained_s})
    elif drained_s is not None:
        out.print(f"{instance}: drained in {drained_s:.2f}s; no request left on it")
    else:
        out.print(f"{instance}: draining ({view.load.running} running, {view.load.waiting} queued)")


def _flag(instance: str, drain_: bool, cordon_only: bool, done: str, manager, run_dir, config, json_: bool) -> None:
    client = admin(manager, run_dir, config, 5.0)
    view = _call(client, lambda c: c.drain(instance, drain_, cordon_only)).instance
    if json_:
        print_json({"instance": instance_json(view)})
    else:
        out.print(f"{instance}: {done}")


def undrain(instance: InstanceArg, manager: ManagerOpt = None, run_dir: RunDirOpt = None, config: ConfigOpt = None,
            json_: JsonOpt = False) -> None:
    """Stop draining an instance: it takes new requests again (a pending remove or scale-in gives up)."""
    _flag(instance, False, False, "serving again", manager, run_dir, config, json_)


def cordon(instance: InstanceArg, manager: ManagerOpt = None, run_dir: RunDirOpt = None, config: ConfigOpt = None,
           json_: JsonOpt = False) -> None:
    """No new requests to an instance; what it runs stays (and may still be migrated away to balance)."""
    _flag(instance, True, True, "cordoned: takes no new requests", manager, run_dir, config, json_)


def uncordon(instance: InstanceArg, manager: ManagerOpt = None, run_dir: RunDirOpt = None, config: ConfigOpt = None,
             json_: JsonOpt = False) -> None:
    """Let a cordoned instance take new requests again."""
    _flag(instance, False, True, "uncordoned", manager, run_dir, config, json_)


def remove(instance: InstanceArg,
           timeout: Annotated[float, typer.Option("--timeout", help="seconds the drain may take")] = 300.0,
           manager: ManagerOpt = None, run_dir: RunDirOpt = None, config: ConfigOpt = None, json_: JsonOpt = False) -> None:
    """Drain an instance, then stop it (it exits 0). A dead instance is just forgotten."""
    client = admin(manager, run_dir, config, timeout + 60.0)
    reply = _call(client, lambda c: c.remove(instance, timeout))
    if json_:
        print_json({"id": reply.instance_id, "removed": True, "drained_s": reply.drained_s, "migrated": reply.migrated,
                    "was_dead": reply.was_dead})
    elif reply.was_dead:
        out.print(f"{instance}: it was dead; forgotten")
    else:
        out.print(f"{instance}: drained in {reply.drained_s:.2f}s ({reply.migrated} migrated out) and stopped")


def add(count: Annotated[int, typer.Option("--count", "-n", min=1, help="instances to start")] = 1,
        timeout: Annotated[float, typer.Option("--timeout", help="seconds to wait for them to register (0: scaling.launch_timeout_s)")] = 0.0,
        manager: ManagerOpt = None, run_dir: RunDirOpt = None, config: ConfigOpt = None, json_: JsonOpt = False) -> None:
    """Start instances with the manager's launcher (scaling.launcher) and wait until they registered."""
    client = admin(manager, run_dir, config, (timeout or 3600.0) + 30.0)  # 0: the manager's own limit applies
    reply = _call(client, lambda c: c.add(count, timeout))
    if json_:
        print_json({"added": reply.instance_ids})
    else:
        out.print(f"added {', '.join(reply.instance_ids)}")


def role(instance: InstanceArg,
         new_role: Annotated[Optional[str], typer.Argument(metavar="ROLE", help="mixed, prefill or decode (omit: show the current role)")] = None,
         wait: Annotated[bool, typer.Option("--wait", help="wait until the instance reports the new role")] = False,
         timeout: Annotated[float, typer.Option("--timeout", help="with --wait: seconds to wait")] = 30.0,
         manager: ManagerOpt = None, run_dir: RunDirOpt = None, config: ConfigOpt = None, json_: JsonOpt = False) -> None:
    """Show or change an instance's role (prefill/decode disaggregation). A request decoding on an instance that
    becomes prefill moves to a decode instance by live migration at its next token, never by abort; a prefill
    instance hands each request over at its first token. With no decode instance, prefill ones serve whole requests."""
    if new_role is not None and new_role not in ("mixed", "prefill", "decode"):
        die(f"unknown role {new_role!r} (mixed, prefill or decode)", code=2)
    client = admin(manager, run_dir, config, 5.0)
    reply = _call(client, lambda c: c.role(instance, new_role or ""))
    confirmed = None
    if wait and new_role:
        start = time.monotonic()
        while True:
            snap = _call(client, AdminClient.status)
            view = next((v for v in snap.instances if v.instance_id == instance), None)
            if view is None or view.state == "dead":
                die(f"instance {instance} went away")
            if view.last_report_age_s < time.monotonic() - start and (view.load.role or "mixed") == new_role:
                confirmed = round(time.monotonic() - start, 3)
                break
            if time.monotonic() - start > timeout:
                die(f"instance {instance} did not report role {new_role} within {timeout:g}s")
            time.sleep(0.05)
    data = {"id": reply.instance_id, "role": reply.role, "previous": reply.previous, "moving": reply.moving}
    if confirmed is not None:
        data["confirmed_s"] = confirmed
    if json_:
        print_json(data)
    elif not new_role:
        out.print(f"{instance}: {reply.role}")
    else:
        moving = f"; {reply.moving} running request(s) move to decode instances" if reply.moving else ""
        out.print(f"{instance}: {reply.previous} -> {reply.role}{moving}")


def policy(dispatch: Annotated[Optional[str], typer.Option("--dispatch", metavar="POLICY", help=f"{DISPATCH.listing()} ({DISPATCH.setting})")] = None,
           pairing: Annotated[Optional[str], typer.Option("--pairing", metavar="POLICY", help=f"{PAIRING.listing()} ({PAIRING.setting})")] = None,
           selection: Annotated[Optional[str], typer.Option("--selection", metavar="POLICY", help=f"{SELECTION.listing()} ({SELECTION.setting})")] = None,
           scaling: Annotated[Optional[str], typer.Option("--scaling", metavar="POLICY", help=f"{SCALING.listing()} ({SCALING.setting})")] = None,
           manager: ManagerOpt = None, run_dir: RunDirOpt = None, config: ConfigOpt = None, json_: JsonOpt = False) -> None:
    """Show the manager's policies, or change them while it runs (until it restarts: then the config rules)."""
    client = admin(manager, run_dir, config, 5.0)
    reply = _call(client, lambda c: c.policy(dispatch_policy=dispatch or "", pairing_policy=pairing or "",
                                             request_selection=selection or "", scaling_policy=scaling or ""))
    data = {"dispatch_policy": reply.dispatch_policy, "pairing_policy": reply.pairing_policy,
            "request_selection": reply.request_selection, "scaling_policy": reply.scaling_policy,
            "migrating": reply.migrating}
    if json_:
        print_json(data)
    else:
        out.print(f"dispatch {data['dispatch_policy']} · migration "
                  f"{data['pairing_policy'] if data['migrating'] else 'drains only'} · selection "
                  f"{data['request_selection']} · scaling {data['scaling_policy']}")


def local_instance(instance: InstanceArg,
                   run_dir: Annotated[Path, typer.Option("--run-dir", help="the local cluster's run directory")] = ...,
                   timeout: Annotated[float, typer.Option("--timeout", help="seconds to wait for it to register")] = 120.0) -> None:
    """Start one more instance of a local cluster (the launcher of `llumnixctl up` clusters)."""
    from llumnixctl.lab import localcluster  # the lab's: operator commands run without it

    state = localcluster.ClusterState.load(run_dir)
    if state is None:
        die(f"no local cluster in {run_dir} (no {localcluster.STATE_FILE})")
    try:
        proc = localcluster.add_instance(run_dir, state, instance, timeout_s=timeout)
    except localcluster.ClusterError as exc:
        die(str(exc))
    out.print(f"instance {instance} started (pid {proc.pid}, log {proc.log})")


def register(app: typer.Typer) -> None:
    for fn in (drain, undrain, cordon, uncordon, remove, add, role, policy):
        app.command()(fn)
    app.command("local-instance", hidden=True)(local_instance)
