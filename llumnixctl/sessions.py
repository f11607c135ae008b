"""``llumnixctl sessions``: the operator's view of the sessions (conversations, agents' loops) the cluster placed
turns of: where each one's last turn went, where its KV is now (per instance, its last prompt's leading blocks in
the engine and in the host tier, by the manager's prefix index), its size, turns and age (daemons/sessions.py)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from daemons import wire
from llumnixctl.common import ConfigOpt, JsonOpt, ManagerOpt, RunDirOpt, TimeoutOpt, admin, ask, out, print_json


def session_json(r: wire.SessionRow) -> dict:
    holders = sorted(set(r.engine_blocks) | set(r.host_blocks),
                     key=lambda i: (-(r.engine_blocks.get(i, 0) + r.host_blocks.get(i, 0)), i))
    return {"session": r.session, "instance": r.instance_id, "instances": holders, "turns": r.turns,
            "prompt_tokens": r.prompt_tokens, "blocks": r.blocks, "engine_blocks": dict(r.engine_blocks),
            "host_blocks": dict(r.host_blocks), "age_s": round(r.age_s, 3), "idle_s": round(r.idle_s, 3)}


def _where(row: dict) -> str:
    """Each holder with its engine blocks, and its host-tier blocks after a +."""
    parts = []
    for iid in row["instances"]:
        e, h = row["engine_blocks"].get(iid, 0), row["host_blocks"].get(iid, 0)
        parts.append(f"{iid} {e}" + (f"+{h} host" if h else ""))
    return ", ".join(parts) or "evicted"


def command(manager: ManagerOpt = None, run_dir: RunDirOpt = None, config: ConfigOpt = None,
            timeout: TimeoutOpt = 3.0, json_: JsonOpt = False,
            limit: Annotated[int, typer.Option("--limit", "-n", min=0, help="at most this many, most recently seen first (0: all)")] = 50) -> None:
    """Sessions: each one's last instance, where its KV is now (engine and host-tier blocks), tokens, turns, age."""
    client = admin(manager, run_dir, config, timeout)
    reply = ask(client, lambda c: c.sessions(limit))
    rows = [session_json(r) for r in reply.sessions]
    if json_:
        print_json({"sessions": rows, "known": reply.known})
        return
    table = Table()
    for col in ("SESSION", "INSTANCE", "KV (ENGINE+HOST BLOCKS OF ITS PROMPT)", "PROMPT TOKENS", "TURNS", "AGE", "IDLE"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["session"], r["instance"], f"{_where(r)} / {r['blocks']}", str(r["prompt_tokens"]),
                      str(r["turns"]), f"{r['age_s']:.0f}s", f"{r['idle_s']:.0f}s")
    out.print(table)
    out.print(f"{len(rows)} of {reply.known} session(s)")

