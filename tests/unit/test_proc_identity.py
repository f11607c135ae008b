"""A process a local cluster started is recognized by its pid and its start time since boot, so that a
wall-clock step (a virtual machine's clock set after its host paused it) does not make a live daemon look
gone ("manager exited during start-up") nor a reused pid look like ours."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import psutil

from llumnixctl.lab import localcluster


def test_a_stepped_wall_clock_leaves_a_process_recognized(tmp_path, monkeypatch):
    proc = localcluster.spawn(tmp_path, "sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert proc.started > 0 and proc.process() is not None
        wall = psutil.Process.create_time
        monkeypatch.setattr(psutil.Process, "create_time", lambda self: wall(self) + 7.0)  # the clock moved 7 s
        assert proc.process() is not None
        assert replace(proc, started=0.0).process() is None  # by create_time alone it would look gone
        assert replace(proc, started=proc.started + 1.0).process() is None  # another process on this pid
    finally:
        live = psutil.Process(proc.pid)
        live.kill()
        live.wait(10)
    assert proc.process() is None


def test_boot_start_of_a_missing_process_is_none():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(10)
    assert localcluster.boot_start(child.pid) is None
