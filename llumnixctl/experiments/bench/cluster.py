"""The throw-away local cluster a benchmark runs on: ``bench proxy`` (cli.py), ``bench engine``'s cluster run
(engine.py) and ``bench policies`` (policies.py) start theirs here."""

from __future__ import annotations

import shutil
from pathlib import Path

import typer
from rich.console import Console

from llumnixctl.lab import localcluster


def start_cluster(run_dir: Path, instances: int, backend: str, sets: list[str], timeout_s: float = 60.0,
                  proxies: int = 1):
    """A throw-away local cluster for one benchmark; on failure, one line, exit 1, and no leftovers."""
    try:
        return localcluster.up(run_dir, instances, backend, 0, None, sets, timeout_s=timeout_s, proxies=proxies)
    except localcluster.ClusterError as exc:
        Console(stderr=True).print(f"llumnixctl: {exc}", markup=False)
        shutil.rmtree(run_dir, ignore_errors=True)
        raise typer.Exit(1) from None
