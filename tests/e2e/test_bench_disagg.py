"""`llumnixctl bench disagg` end to end on a small sim cluster (one prefill, one decode instance): the long prompts
are handed over to the decode instance (every one committed, counted by the manager), nothing fails, and the
handover's figures come from the cluster's own metrics. Fails if handovers break. (`bench handover` shares its
cluster and counting code; its own parts are unit-tested in tests/unit/test_bench_disagg.py.)"""

from __future__ import annotations

import json

import pytest

from tests.conftest import ctl

pytestmark = pytest.mark.e2e

QUICK = ["--set", "instance.shutdown_grace_s=1", "--set", "sim.time_scale=0.5"]


def test_a_split_cluster_hands_every_long_prompt_over():
    res = ctl("bench", "disagg", "--backend", "sim", "--configs", "split", "--instances", "2", "--rounds", "1",
              "--seconds", "3", "--decode-rate", "4", "--long-rate", "2", "--decode-lengths", "16:48",
              "--long-lengths", "1024:32", "--seed", "1", *QUICK, "--json", timeout=90)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    run = doc["runs"][0]["figures"]
    longs = run["kinds"]["long"]["requests"]
    assert longs >= 2 and run["failed"] == 0, run["errors"]
    cluster = run["cluster"]
    assert cluster["handovers"] == {"committed": longs, "aborted": 0}, cluster["ordered_migrations"]
    assert cluster["roles_at_end"] == {"i0": "prefill", "i1": "decode"}
    assert cluster["decisions"].get("remote") == longs and cluster["migration_downtime_mean_ms"] > 0
    assert doc["summary"]["split"]["handovers_committed"]["median"] == longs

