"""Command-line plumbing shared by the daemons."""

from __future__ import annotations

from typing import Any

import typer

from daemons.config import Config, ConfigError, load_config


def load_or_exit(prog: str, path: str | None, overrides: list[str] | None, flags: dict[str, Any]) -> Config:
    """Load the config or exit 2 with one line that names the key and the file."""
    try:
        return load_config(path, overrides, flags)
    except ConfigError as exc:
        typer.echo(f"{prog}: error: {exc}", err=True)
        raise typer.Exit(2) from None
