"""`llumnixctl bench manager` end to end: the real llumnix-manager, 16 emulated instances, 200 dispatches/s."""

from __future__ import annotations

import json

import psutil
import pytest
import typer

from llumnixctl.experiments.bench import manager as bench_manager
from tests.conftest import ctl

pytestmark = pytest.mark.e2e


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_tiny_run_has_the_documented_shape_and_leaves_nothing_behind():
    res = ctl("bench", "manager", "--instances", "16", "--rates", "200", "--seconds", "2", "--json", timeout=60)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["cores"] >= 1 and data["seconds"] == 2.0
    [run] = data["runs"]
    # The manager saw every emulated instance register (its status, through an AdminClient) and kept them alive.
    assert run["instances"] == run["registered"] == run["alive_at_end"] == 16 and run["emulators"] == 1
    assert run["emulated"]["registers"] >= 16 and run["emulated"]["reports"] > 16
    assert set(run["service_us"]) == {"dispatch_1", "dispatch_10", "report", "pairing_round"}
    assert all(v > 0 for v in run["service_us"].values())
    [phase] = run["phases"]
    # Every dispatch answered, by an instance.
    assert phase["rate"] == 200 and phase["sent"] == phase["answered"] == 400, phase
    assert phase["no_instance"] == phase["unanswered"] == 0 and run["dispatched_total"] == 400
    assert 100 < phase["achieved_rate"] < 400
    lat = phase["latency_ms"]
    assert set(lat) == {"mean", "p50", "p99", "p999", "max"}
    assert 0 < lat["p50"] <= lat["p99"] <= lat["max"] < 2000
    # Pairing ran, with work: a quarter of the instances are loaded below the migrate-out threshold.
    rounds = phase["pairing_round"]
    assert rounds["count"] > 0 and 0 < rounds["mean_ms"] and 0 < rounds["p99_ms"] <= rounds["max_ms_le"]
    assert run["emulated"]["migrate_starts"] > 0
    assert phase["manager_cpu_percent"] > 0 and phase["instance_deaths"] == 0
    # Nothing it started is left: manager, emulator and client, each stopped by pid.
    assert len(data["pids"]) == 3
    assert all(_gone(pid) for pid in data["pids"]), data["pids"]


def test_bad_counts_are_usage_errors():
    for text in ("0", "fast", ""):
        with pytest.raises(typer.BadParameter, match="--instances"):
            bench_manager._ints(text, "--instances")
    assert bench_manager._ints("64, 256,1000", "--instances") == [64, 256, 1000]
