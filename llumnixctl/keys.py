"""``llumnixctl keys``: the CURVE key pairs of a cluster's roles (see daemons/security.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from daemons import security
from llumnixctl.common import JsonOpt, die, out, print_json

app = typer.Typer(no_args_is_help=True, help="Cluster keys (ZeroMQ CURVE): generate and list.")


@app.command("generate")
def generate(
    keys_dir: Annotated[Path, typer.Argument(metavar="dir", help="directory to create the keys in (public/ and secret/)")],
    name: Annotated[Optional[list[str]], typer.Option("--name", metavar="NAME", help="a key to add, named ROLE or ROLE-SUFFIX (e.g. operator-alice, instance-gpu3); repeatable (default: one key per role)")] = None,
    force: Annotated[bool, typer.Option("--force", help="replace keys that exist (every host then needs the new public keys)")] = False,
    json_: JsonOpt = False,
) -> None:
    """Create key pairs: one per role (manager, instance, proxy, operator, reader), or the named ones.

    Give every host the public/ directory; give each host only the secrets of the roles it runs
    (manager host: manager; GPU nodes: instance; proxies: proxy; operators: operator or reader).
    """
    names = list(name) if name else list(security.ROLES)
    try:
        written = security.generate(keys_dir, names, force=force)
    except FileExistsError as exc:
        die(f"keys already exist in {keys_dir}: {exc} (use --force to replace them)")
    except ValueError as exc:
        die(str(exc), 2)
    except OSError as exc:
        die(f"cannot write keys in {keys_dir}: {exc.strerror or exc}")
    if json_:
        print_json({"keys_dir": str(keys_dir), "written": written})
        return
    for n in written:
        out.print(f"{n}: {keys_dir / 'public' / (n + '.key')} (public), {keys_dir / 'secret' / (n + '.key_secret')} (secret)",
                  markup=False, highlight=False)
    out.print(f"Set security.keys_dir = \"{keys_dir.resolve()}\" on every host.", markup=False, highlight=False)


@app.command("list")
def list_(
    keys_dir: Annotated[Path, typer.Argument(metavar="dir", help="a keys directory (security.keys_dir)")],
    json_: JsonOpt = False,
) -> None:
    """The keys the cluster admits (public/), their roles, and which secrets this host holds."""
    if not (keys_dir / "public").is_dir():
        die(f"{keys_dir} has no public/ directory (make keys with `llumnixctl keys generate {keys_dir}`)")
    keys = security.list_keys(keys_dir)
    if json_:
        print_json(keys)
        return
    table = Table(title=f"keys in {keys_dir}")
    for col in ("name", "role", "secret here", "public key"):
        table.add_column(col)
    for k in keys:
        table.add_row(k["name"], k["role"] or "(none: ignored)", "yes" if k["secret"] else "no",
                      k["public_key"] or k.get("error", ""))
    out.print(table)
