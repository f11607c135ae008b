"""The figure modules fig13 (priorities), fig14 (auto-scaling, the paper's Fig 14/15) and bursts: each
one's --quick run writes a JSON with the paper's figures beside ours, and sane values."""

from __future__ import annotations

import json
import math

import pytest

from llumnixctl.experiments.figs import bursts, fig13, fig14


def _load(tmp_path, name: str) -> dict:
    data = json.loads((tmp_path / f"{name}.json").read_text())
    for key in ("figure", "setup", "ours", "paper", "differences"):
        assert key in data, key
    assert data["quick"] is True
    assert data["paper"] and isinstance(data["paper"], dict)
    assert "certainty" in data["paper"]  # the paper's numbers say how sure we are of them
    assert data["differences"] and all(isinstance(s, str) and s for s in data["differences"])
    return data


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x >= 0


def test_fig13_quick(tmp_path):
    fig13.main(["--quick", "--out", str(tmp_path)])
    d = _load(tmp_path, "fig13")
    table = d["ours"]["table"]
    assert any(r["params"]["policy"] == "infaas++" for r in table.values())
    assert any(r["params"]["policy"] == "llumnix" and r["params"]["headroom"] > 0 for r in table.values())
    for row in table.values():
        assert row["high"]["completed"] > 0 and row["normal"]["completed"] > 0
        for prio in ("high", "normal"):
            for m in ("ttft", "tpot", "e2el"):
                assert _finite(row[prio][f"mean_{m}_ms"])
                assert row[prio][f"p99_{m}_ms"] >= row[prio][f"mean_{m}_ms"] * 0.5
            assert row[prio]["mean_e2el_ms"] >= row[prio]["mean_ttft_ms"]
    assert d["ours"]["high_priority_speedup"]
    assert (tmp_path / "fig13.png").exists()


def test_fig14_quick(tmp_path):
    fig14.main(["--quick", "--out", str(tmp_path)])
    d = _load(tmp_path, "fig14")
    pts = d["ours"]["points"]
    assert {p["params"]["policy"] for p in pts.values()} == {"llumnix", "infaas++"}
    for p in pts.values():
        assert p["instance_seconds"] > 0
        assert 1 <= p["mean_instances"] <= d["setup"]["max_instances"] + 1e-6
        assert _finite(p["p99_ttft_ms"]) and _finite(p["p99_e2el_ms"])
    assert d["paper"]["cost_saving_up_to"] == pytest.approx(0.36)
    assert d["ours"]["same_thresholds"]


def test_bursts_quick(tmp_path):
    bursts.main(["--quick", "--out", str(tmp_path)])
    d = _load(tmp_path, "bursts")
    runs = d["ours"]["runs"]
    assert {r["params"]["policy"] for r in runs.values()} == {"llumnix", "infaas++"}
    for r in runs.values():
        assert r["committed"] <= r["migrations"]
        # Peaks are of migrations that happened: some where there were any, none where there were none.
        assert (r["in_flight_peak"] >= 1) == (r["migrations"] > 0), r
        assert (r["kv_bytes_per_s_peak"] > 0) == (r["kv_bytes_total"] > 0), r
        assert r["kv_bytes_total"] > 0 or not r["committed"], r  # a committed migration copied its KV
        if r["params"]["policy"] == "llumnix":  # the quick trace's bursts are what migration is for
            assert r["committed"] > 0, r
        assert _finite(r["p99_ttft_ms"])
        if r["params"]["policy"] == "infaas++":
            assert r["migrations"] == 0 and r["kv_bytes_total"] == 0
        if r["params"]["caps"].startswith("capped"):
            assert r["in_flight_peak_per_instance"] <= 2
        assert len(r["series"]["arrivals"]) == len(r["series"]["in_flight"])


def test_cache_fleet_quick(tmp_path):
    from llumnixctl.experiments.figs import cache

    cache.main(["--quick", "--requests", "90", "--parts", "fleet,hotspot", "--out", str(tmp_path)])
    d = json.loads((tmp_path / "cache-fleet.json").read_text())
    # The sweep's unique prompts (the paper's L-L mix) take ten times a fleet request's steps: 30 of them.
    cache.main(["--quick", "--requests", "30", "--parts", "sweep", "--out", str(tmp_path / "sweep")])
    sweep_d = json.loads((tmp_path / "sweep" / "cache-fleet.json").read_text())
    d["runs"] += sweep_d["runs"]
    d["analysis"].update(sweep_d["analysis"])
    assert d["setup"]["quick"] is True
    for r in d["runs"]:
        assert r["result"]["failed"] == 0 and r["result"]["leaked_blocks"] == 0 and r["result"]["completed"] > 0
    for key in ("fleet n=16 shared-prefix", "fleet n=16 multi-turn"):
        (point,) = d["analysis"][key]["points"]
        hits = point["hit_rate"]
        # Cache-aware finds the warm instances a cache-blind placement misses, close to the oracle's rate.
        assert hits["llumnix-cache"] > hits["llumnix"] + 0.15, hits
        assert hits["oracle-cache"] - hits["llumnix-cache"] < 0.1, hits
    (hot,) = d["analysis"]["hotspot n=16 shared-prefix hot=0.8"]["points"]
    assert hot["max_running_share"]["llumnix-cache"] < hot["max_running_share"]["oracle-cache"]
    (sweep,) = d["analysis"]["sweep n=16 unique L-L cv3"]["points"]
    assert sweep["p99_ttft_ms"]["llumnix-cache"] == sweep["p99_ttft_ms"]["llumnix"]  # nothing cached: the same
