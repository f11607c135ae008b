"""The manager weighs a balancing move to another host against recomputing on the source, with real daemons
(the cost check's arithmetic and pairing: tests/unit/test_crossnode_policy.py)."""

from __future__ import annotations

import re

import httpx

import pytest

from llumnixctl.admin import AdminClient
from llumnixctl.lab import localcluster
from llumnixctl.main import status_json
from tests.conftest import FAST, UP_TIMEOUT_S, ctl_json
from tests.load import Load, Spec, failures
from tests.streams import metric, samples, wait_for

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("pays", [False, True], ids=["recompute-cheaper", "move-cheaper"])
def test_manager_weighs_moves_between_hosts(tmp_path, pays):
    """Two instances that report different hosts (localcluster's place; both on loopback here), one
    loaded by flood, then balancing switched on: with 1 Gbit/s between hosts and requests of ~100 tokens
    of 64 KiB each, a move takes longer than recomputing them at 0.1 ms/token: no order at all. At 10 ms a
    token of recompute (a slow engine) the same moves pay, and happen."""
    sets = FAST + ["instance.min_step_s=0.02", "scheduling.migration_interval_s=0.2", "manager.dispatch_policy=flood",
                   "sim.num_blocks=512", "scheduling.migrate_out_threshold=inf", "scheduling.migrate_in_threshold=-inf",
                   "scheduling.cross_node_bandwidth_gbps=1", "scheduling.cross_node_kv_bytes_per_token=65536",
                   f"scheduling.cross_node_recompute_ms_per_token={10.0 if pays else 0.1}"]

    def place(name: str) -> tuple[list[str], list[str]]:
        return [], [f"instance.host=host-{name}"] if name.startswith("instance-") else []

    state = localcluster.up(tmp_path, 2, "sim", 0, None, sets, timeout_s=UP_TIMEOUT_S, place=place)
    admin = AdminClient(state.manager_address, timeout_s=3)
    try:
        def status() -> dict:
            return status_json(admin.status(), state.manager_address)

        log = open(next(p.log for p in state.procs if p.name == "manager")).read()
        metrics = re.search(r"metrics (127\.0\.0\.1:\d+)", log).group(1)
        assert sorted(i["host"] for i in status()["instances"]) == ["host-instance-i0", "host-instance-i1"]
        load = Load(state.url, [Spec(0.0, 200, prompt_tokens=64) for _ in range(8)])
        wait_for(lambda: load.started() == 8, 30, message="the streams did not start")
        ctl_json("policy", "--dispatch", "llumnix", "--run-dir", str(tmp_path))
        ordered = lambda: status()["totals"]["ordered_migrations"]  # noqa: E731
        if pays:
            wait_for(lambda: ordered().get("balance/committed", 0) >= 1, 10, "no move across hosts", every=0.1)
        else:
            # Ten pairing rounds counted by the manager itself after balancing was on, whatever the
            # machine's speed, and none of them ordered a move.
            rounds = lambda: metric(samples(httpx.get(f"http://{metrics}/metrics", timeout=10).text),  # noqa: E731
                                    "llumnix_manager_pairing_round_seconds_count", default=0.0)
            after = rounds() + 10
            wait_for(lambda: rounds() >= after, 60, "the manager stopped pairing", every=0.1)
            assert ordered() == {}, ordered()
        results = load.wait()
        assert not failures(results), failures(results)
    finally:
        admin.close()
        localcluster.stop(state)
