"""`llumnixctl bench lora` on a small trace: adapters drawn by Zipf popularity, every placement serves every request
(none lost, none failed), residency keeps a where-loaded cluster's adapters on one instance each, and the figures
the command prints are there."""

from __future__ import annotations

from collections import Counter

from llumnixctl.experiments.bench.lora import PLACEMENTS, LoraBench, adapter_draw, run


def test_adapters_are_drawn_by_zipf_popularity():
    names = adapter_draw(4000, 8, 1.0, seed=3)
    counts = Counter(names)
    assert set(counts) <= {f"a{k}" for k in range(8)}
    assert counts["a0"] > counts["a1"] > counts["a7"]
    assert adapter_draw(10, 8, 1.0, seed=3) == names[:10]  # seeded


def test_every_placement_serves_every_request():
    res = run(LoraBench(instances=2, slots=2, adapters=4, requests=60, rate=20.0, load_ms=20.0))
    assert set(res["placements"]) == set(PLACEMENTS)
    for name, r in res["placements"].items():
        assert (r["completed"], r["failed"]) == (60, 0), name
        assert r["adapter_loads"] >= 2 and r["p99_ttft_ms"] >= r["p50_ttft_ms"] > 0
    # Where-loaded: one replica per adapter, 4 adapters in 4 slots: each loaded once, none evicted.
    assert (res["placements"]["where-loaded"]["adapter_loads"], res["placements"]["where-loaded"]["adapter_evictions"]) == (4, 0)
