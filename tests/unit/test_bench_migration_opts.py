"""``llumnixctl bench migration``'s options and output without a cluster (``run`` replaced): --shared-prefix's
checks and its before/after table, and the decode slowdown column. The benchmark itself runs in
tests/e2e/test_e2e_migration.py (sim) and scripts/fig10.sh."""

from __future__ import annotations

import json

import pytest

from llumnixctl.experiments.bench import headroom, migration as bench_migration
from tests.conftest import cli


def test_shared_prefix_needs_vllm_and_a_longer_length():
    res = cli("bench", "migration", "--backend", "sim", "--shared-prefix", "64")
    assert res.returncode == 2 and "--shared-prefix needs --backend vllm" in res.stderr
    res = cli("bench", "migration", "--shared-prefix", "4096", "--lengths", "256,2048")
    assert res.returncode == 2 and "leaves no length" in res.stderr


def test_prefix_caching_is_on_only_for_the_shared_prefix_run():
    on = bench_migration._settings("vllm", None, [2048], 160, prefix_caching=True)
    off = bench_migration._settings("vllm", None, [2048], 160)
    assert "vllm.enable_prefix_caching=true" in on and not any("prefix_caching" in s for s in off)


def _fake(monkeypatch, result: dict) -> dict:
    seen = {}

    def run(*args, **kwargs):
        seen.update(kwargs)
        return result

    monkeypatch.setattr(bench_migration, "run", run)
    return seen


def test_shared_prefix_prints_before_and_after(monkeypatch):
    row = {"tokens": 2048, "before": {"bytes": 136_000_000, "blocks": 65, "cached_blocks": 0, "downtime_ms": 9.5,
                                      "migration_ms": 600.0},
           "after": {"bytes": 34_000_000, "blocks": 65, "cached_blocks": 48, "downtime_ms": 8.25, "migration_ms": 200.0}}
    result = {"backend": "vllm", "model": "kv-heavy (generated)", "cores": 2, "network": {"netns": False},
              "results": [], "shared_prefix": {"tokens": 1536, "results": [row]}}
    seen = _fake(monkeypatch, result)
    res = cli("bench", "migration", "--lengths", "2048", "--shared-prefix", "1536")
    assert res.returncode == 0, res.stderr
    assert seen["shared_prefix"] == 1536
    line = next(x for x in res.stdout.splitlines() if "2048" in x)
    for cell in ("136.0", "9.50", "34.0", "48", "8.25"):
        assert cell in line, line
    res = cli("bench", "migration", "--lengths", "2048", "--shared-prefix", "1536", "--json")
    assert json.loads(res.stdout)["shared_prefix"]["results"][0]["after"]["cached_blocks"] == 48


def test_the_table_shows_the_decode_slowdown(monkeypatch):
    row = {"tokens": 256, "bytes": 18_900_000, "stages": 2, "downtime_ms": 8.0, "migration_ms": 300.0,
           "blocking_copy_ms": 50.0, "recompute_ms": 900.0, "decode_step_ms": 80.0, "decode_step_migrating_ms": 90.0,
           "client_gap_ms": 100.0, "decode_slowdown_pct": 12.5}
    _fake(monkeypatch, {"backend": "sim", "model": "sim (kv-heavy shape)", "cores": 2, "network": {"netns": False},
                        "results": [row]})
    res = cli("bench", "migration", "--backend", "sim", "--lengths", "256")
    assert res.returncode == 0, res.stderr
    assert "slowdown %" in res.stdout and "+12.5" in next(x for x in res.stdout.splitlines() if "256" in x)


def test_requests_get_room_for_their_moves_by_default(monkeypatch):
    """--decode-tokens 0 (the default) gives each request AUTO_DECODE_TOKENS of room past its prompt (a default of
    160 let an 8k-token request finish during its moves: "not on any instance", "finished during pre-copy")."""
    seen = []
    monkeypatch.setattr(bench_migration, "run", lambda *args, **kwargs: seen.append(args) or
                        {"backend": "sim", "model": "sim", "cores": 2, "network": {"netns": False}, "results": []})
    assert cli("bench", "migration", "--backend", "sim", "--lengths", "8192").returncode == 0
    assert cli("bench", "migration", "--backend", "sim", "--lengths", "8192", "--decode-tokens", "500").returncode == 0
    assert [args[3] for args in seen] == [bench_migration.AUTO_DECODE_TOKENS, 500]
    assert bench_migration._longest([8192], bench_migration.AUTO_DECODE_TOKENS) == 8192 + 2048 + 64


def test_a_request_without_room_for_the_moves_left_stops_with_the_decode_tokens_that_would_do():
    # 3 moves of 6 s at 40 ms a token, 8 tokens of steady decoding after each: 2 x 150 + 1 + 8 tokens a move
    need = headroom.moves_need(6000, 40.0, 3, 8)
    assert need == 3 * (300 + 1 + 8)
    hint = headroom.hint(8192, 120, 6000, 40.0, 4, 8)
    assert "120 tokens left" in hint and "--decode-tokens 1536 or more" in hint  # 4 x 309 = 1236, rounded up past
    assert headroom.step_ms([0.0, 0.04, 0.08, 0.5]) == 40.0  # the median gap: one slow gap does not count
    # tokens batched into one chunk share its arrival time: per token, the chunk's gap over its tokens
    assert headroom.step_ms([0.0, 0.02, 0.02, 0.04, 0.04, 0.06, 0.06]) == pytest.approx(10.0)
