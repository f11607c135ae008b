"""Command-line plumbing shared by the daemons."""

from __future__ import annotations

from typing import Any

import typer

from daemons import runtime
from daemons.config import Config, ConfigError, load_config


def load_or_exit(prog: str, path: str | None, overrides: list[str] | None, flags: dict[str, Any]) -> Config:
    """Load the config or exit 2 with one line that names the key and the file.

    Also hands the daemon's ``log_format`` (``[manager]``, ``[instance]`` or ``[proxy]`` by ``prog``) to
    ``runtime.setup_logging``, which the daemon calls next."""
    try:
        cfg = load_config(path, overrides, flags)
    except ConfigError as exc:
        typer.echo(f"{prog}: error: {exc}", err=True)
        raise typer.Exit(2) from None
    section = getattr(cfg, prog.removeprefix("llumnix-"), None)
    runtime.set_log_format(getattr(section, "log_format", "text"))
    return cfg
