"""Fixtures that start real daemons on loopback and always stop them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llumnixctl import localcluster
from llumnixctl.admin import AdminClient

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Fast clusters for tests: short heartbeats, steps at a tenth of the default latency model.
FAST = ["manager.heartbeat_interval_s=0.2", "sim.time_scale=0.1", "instance.shutdown_grace_s=1"]


class Cluster:
    def __init__(self, state: localcluster.ClusterState, run_dir: Path):
        self.state = state
        self.run_dir = run_dir
        self.url = state.url
        self.manager = state.manager_address

    def admin(self) -> AdminClient:
        return AdminClient(self.manager, timeout_s=3)

    def status(self) -> dict:
        return ctl_json("status", "--run-dir", str(self.run_dir))

    def proc(self, name: str):
        return next(p for p in self.state.procs if p.name == name)

    def openai(self, **kw):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kw)

    def logs(self) -> str:
        return "\n".join(f"--- {p.log}\n" + Path(p.log).read_text(errors="replace")[-3000:] for p in self.state.procs)


@pytest.fixture
def start_cluster(tmp_path_factory):
    """start_cluster(instances=2, sets=[...]) -> Cluster; every cluster is stopped at teardown."""
    started: list[Cluster] = []

    def start(instances: int = 2, sets: list[str] | None = None) -> Cluster:
        run_dir = tmp_path_factory.mktemp("run")
        state = localcluster.up(run_dir, instances, "sim", 0, None, FAST + (sets or []), timeout_s=60)
        cluster = Cluster(state, run_dir)
        started.append(cluster)
        return cluster

    yield start
    for cluster in started:
        localcluster.stop(cluster.state, timeout_s=10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One shared 2-instance cluster for tests that do not disturb it."""
    run_dir = tmp_path_factory.mktemp("shared")
    state = localcluster.up(run_dir, 2, "sim", 0, None, FAST, timeout_s=60)
    try:
        yield Cluster(state, run_dir)
    finally:
        localcluster.stop(state, timeout_s=10)


def ctl(*args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llumnixctl.main", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def ctl_json(*args: str) -> dict:
    res = ctl(*args, "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)
