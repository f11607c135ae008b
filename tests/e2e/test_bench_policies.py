"""`llumnixctl bench policies` end to end: a tiny trace through a real 2-instance sim cluster."""

from __future__ import annotations

import json

import pytest

from tests.conftest import ctl

pytestmark = pytest.mark.e2e


def test_tiny_trace_completes_with_the_documented_shape():
    res = ctl("bench", "policies", "--instances", "2", "--requests", "12", "--rate", "8", "--policies", "rr",
              "--prompt-max", "64", "--output-max", "24", "--high-fraction", "0.5", "--seed", "3",
              "--set", "sim.time_scale=0.1", "--set", "instance.shutdown_grace_s=1", "--json", "--per-request",
              timeout=90)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["trace"]["requests"] == 12 and data["instances"] == 2
    assert set(data["policies"]) == {"rr"}
    r = data["policies"]["rr"]
    # Every request streamed exactly its max_tokens, and nothing failed.
    assert (r["requests"], r["completed"], r["errors"], r["short_streams"]) == (12, 12, 0, 0), r["first_errors"]
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert set(r[key]) == {"mean", "p50", "p99"} and 0 < r[key]["p50"] <= r[key]["p99"]
    assert r["ttft_ms"]["p99"] <= r["e2e_ms"]["p99"]
    assert r["migrations"] == {"committed": 0, "aborted": 0, "total": 0}  # rr never migrates
    assert r["manager"]["dispatch_policy"] == "rr" and isinstance(r["preemptions"], int)
    high = data["trace"]["summary"]["high_priority"]
    assert 0 < high < 12  # seed 3 draws both classes
    assert r["high"]["requests"] == high and r["normal"]["requests"] == 12 - high
    assert r["high"]["completed"] + r["normal"]["completed"] == 12
    rows = r["per_request"]
    assert [row["index"] for row in rows] == list(range(12))
    assert all(row["tokens"] == row["expected"] and row["id"] for row in rows)
    assert sum(row["priority"] == "high" for row in rows) == high


def test_bad_arguments_fail_before_any_cluster_starts():
    res = ctl("bench", "policies", "--policies", "rr,bogus", "--json")
    assert res.returncode == 2 and "bogus" in res.stderr
    res = ctl("bench", "policies", "--prompt-max", "4000", "--output-max", "4000")
    assert res.returncode == 2 and "does not fit" in res.stderr
