"""`llumnixctl bench sessions` end to end: a tiny session trace through real 2-instance sim clusters, with and
without session keys."""

from __future__ import annotations

import json

import pytest

from llumnixctl.experiments.traces import cache as tracecache, sessions as tsessions
from tests.conftest import ctl

pytestmark = pytest.mark.e2e


def test_a_tiny_session_trace_runs_on_our_systems_with_the_documented_shape():
    res = ctl("bench", "sessions", "--engine", "sim", "--systems", "llumnix-sessions,llumnix-cache", "--sessions", "3",
              "--turns-min", "2", "--turns-max", "3", "--session-rate", "10", "--think", "0.05", "--agents", "1",
              "--system-tokens", "64", "--message-max", "48", "--reply-max", "24", "--kv-tokens", "2048",
              "--set", "sim.time_scale=0.1", "--set", "instance.shutdown_grace_s=1", "--json", timeout=120)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert "[1/2] round 1/1: llumnix-sessions" in res.stderr  # the progress line
    reqs = tsessions.sessions(3, session_rate=10, turns=(2, 3), agents=1, system_tokens=64, message=(16, 48),
                              reply=(16, 24), think=0.05, max_context=3072, seed=0)
    (trace,) = data["traces"]
    assert trace["kv_tokens"] == 2 * 2048 and trace["working_set_over_kv"] == round(trace["working_set_tokens"] / 4096, 2)
    assert [r["system"] for r in data["rounds"]] == ["llumnix-sessions", "llumnix-cache"]
    for r in data["rounds"]:
        assert (r["completed"], r["failed"]) == (trace["turns"], 0), r["first_error"]
        assert sum(r["turns_by_instance"]) == trace["turns"] and len(r["turns_by_instance"]) == 2
        assert r["busiest_over_fair"] >= 1.0 and r["turns_per_s"] > 0
        assert 0 < r["p50_ttft_ms"] <= r["p99_ttft_ms"]
        c = r["cache"]
        # the perfect cache of the trace that ran, in the sim engine's 16-token blocks
        assert c["perfect_tokens"] == tracecache.sharing(reqs, 16)["shareable_tokens"] > 0
        assert 0 < c["cached_tokens"] <= c["prompt_tokens"] and c["of_perfect"] > 0.5
    placed = {r["system"]: r["session_dispatches"] for r in data["rounds"]}
    if placed["llumnix-sessions"] is not None:  # a proxy that names sessions placed every turn as one's
        assert sum(placed["llumnix-sessions"].values()) == trace["turns"]
        assert not any((placed["llumnix-cache"] or {}).values())  # no key, no session
    assert set(data["summary"]) == {"llumnix-sessions", "llumnix-cache"}
    assert data["summary"]["llumnix-cache"]["failed"] == 0
    assert data["settings"]["llumnix-sessions"][-2:] == ["sim.time_scale=0.1", "instance.shutdown_grace_s=1"]


def test_bad_arguments_fail_before_any_cluster_starts():
    res = ctl("bench", "sessions", "--systems", "llumnix-sessions,smg", "--json")
    assert res.returncode == 2 and "--smg" in res.stderr
    res = ctl("bench", "sessions", "--engine", "sim", "--systems", "vllm-router", "--vllm-router", "/bin/true")
    assert res.returncode == 2 and "api_server" in res.stderr
    res = ctl("bench", "sessions", "--turns-min", "5", "--turns-max", "2")
    assert res.returncode == 2 and "--turns-min" in res.stderr
    res = ctl("bench", "sessions", "--max-context", "4096")
    assert res.returncode == 2 and "BOS" in res.stderr
