"""``llumnixctl lora``: the LoRA adapters the cluster serves: load, unload, list (daemons/manager/adapters.py).

Each prints one line per instance (or ``--json``) and exits non-zero when no instance did what was asked."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from daemons import wire
from llumnixctl.common import ConfigOpt, JsonOpt, ManagerOpt, RunDirOpt, admin, ask, die, out, print_json

ORDER_TIMEOUT_S = 70.0  # the manager waits up to 60 s for the instances (daemons/manager/adapters.py)

app = typer.Typer(no_args_is_help=True, help="LoRA adapters: load one on the instances, unload it, list them.")
NameArg = Annotated[str, typer.Argument(help="the adapter's name: requests name it as their model")]
InstancesOpt = Annotated[Optional[list[str]], typer.Option("--instances", "-i", metavar="ID",
                                                            help="only on these instances (repeat the option; default: every instance that serves adapters, up to lora.max_replicas)")]


def _rows_json(rows: list[wire.AdapterRow]) -> list[dict]:
    return [{"name": r.name, "path": r.path, "instances": list(r.instances)} for r in rows]


def _outcomes_json(outcomes: list[wire.AdapterOutcome]) -> list[dict]:
    return [{"instance_id": o.instance_id, "ok": o.ok, "message": o.message} for o in outcomes]


def _report(verb: str, name: str, reply: wire.LoraReply, json_: bool) -> None:
    if json_:
        print_json({"adapter": name, "outcomes": _outcomes_json(reply.outcomes), "adapters": _rows_json(reply.adapters)})
    else:
        for o in reply.outcomes:
            out.print(f"{o.instance_id}: {o.message if o.ok else 'refused: ' + o.message}", highlight=False)
    if reply.outcomes and not any(o.ok for o in reply.outcomes):
        die(f"adapter {name!r} was {verb} nowhere")


@app.command("load")
def load(name: NameArg,
         path: Annotated[Path, typer.Argument(help="the adapter's directory (PEFT: adapter_config.json, adapter_model.safetensors), as the instances see it")],
         instances: InstancesOpt = None, manager: ManagerOpt = None, run_dir: RunDirOpt = None,
         config: ConfigOpt = None, json_: JsonOpt = False) -> None:
    """Load an adapter on the instances: requests with model NAME run with it.

    An instance that does not hold it loads it when a request for it is dispatched there."""
    client = admin(manager, run_dir, config, ORDER_TIMEOUT_S)
    reply = ask(client, lambda c: c.ask(lambda qid: wire.LoraQuery(qid, "load", name, str(path), list(instances or []))))
    _report("loaded", name, reply, json_)


@app.command("unload")
def unload(name: NameArg, instances: InstancesOpt = None, manager: ManagerOpt = None, run_dir: RunDirOpt = None,
           config: ConfigOpt = None, json_: JsonOpt = False) -> None:
    """Unload an adapter: the cluster no longer serves it (with --instances: only those instances drop it).

    Requests running with it finish first."""
    client = admin(manager, run_dir, config, ORDER_TIMEOUT_S)
    reply = ask(client, lambda c: c.ask(lambda qid: wire.LoraQuery(qid, "unload", name, "", list(instances or []))))
    _report("unloaded", name, reply, json_)


@app.command("list")
def list_(manager: ManagerOpt = None, run_dir: RunDirOpt = None, config: ConfigOpt = None, json_: JsonOpt = False) -> None:
    """The adapters the cluster serves, where each loads from and which instances hold it now."""
    client = admin(manager, run_dir, config, 5.0)
    reply = ask(client, lambda c: c.ask(lambda qid: wire.LoraQuery(qid, "list")))
    if json_:
        print_json({"adapters": _rows_json(reply.adapters)})
        return
    if not reply.adapters:
        out.print("no adapters (llumnixctl lora load NAME PATH)")
        return
    table = Table(box=None)
    for col in ("ADAPTER", "PATH", "HELD BY"):
        table.add_column(col)
    for r in reply.adapters:
        table.add_row(r.name, r.path or "(not served: unloaded while running)", ", ".join(r.instances) or "-")
    out.print(table)
