"""Stopping the processes a benchmark or a lab started (servers, daemons, child commands): by their Popen,
so that it is them and their exit status that are collected, never a process found by name."""

from __future__ import annotations

import subprocess
import time
from typing import Iterable

import psutil


def stop(procs: Iterable[subprocess.Popen], grace_s: float = 15.0,
         children: Iterable[psutil.Process] = ()) -> None:
    """SIGTERM each of ``procs`` still running, SIGKILL those left after ``grace_s`` (one deadline for all);
    reap them all. Then ``children`` (a server's engine processes, noted while it ran) that outlived their
    parent get 10 s more, then SIGKILL."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
    _, alive = psutil.wait_procs(list(children), timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
