"""``llumnixctl check migration --backend sim``: a real sim cluster whose migrated requests stream what
unmigrated runs of the same requests do (the comparison itself: tests/unit/test_check_migration.py)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def test_sim_requests_migrate_and_stream_what_unmigrated_runs_do():
    res = cli("check", "migration", "--backend", "sim", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["identical"] is True and out["backend"] == "sim"
    assert [r["kind"] for r in out["requests"]] == ["greedy", "greedy", "seeded", "seeded"]
    assert len({r["seed"] for r in out["requests"][2:]}) == 2
    for r in out["requests"]:
        assert r["migrations"] >= 1 and r["identical"] and r["first_mismatch"] is None, r
        assert r["tokens"] == 48 and r["downtime_ms"] > 0
