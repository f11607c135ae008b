"""The generated traces: seeded, bounded, and with the statistics they claim.

Tolerances are at least five standard errors of the estimate for the sample size used (noted per test),
so a correct generator fails none of them in practice, while a wrong rate, scale or exponent does.
"""

from __future__ import annotations

import math
import random
import statistics

import pytest

from llumnixctl.experiments.traces import gen as trace

N = 20_000


def _gaps(reqs: list[trace.TraceRequest]) -> list[float]:
    times = [0.0] + [r.arrival_s for r in reqs]
    return [b - a for a, b in zip(times, times[1:])]


def _cv(xs: list[float]) -> float:
    return statistics.pstdev(xs) / statistics.fmean(xs)


def test_same_seed_same_trace_and_other_seed_another():
    kw = dict(rate=3.0, arrival="gamma", cv=2.0, prompt=(8, 300), output=(4, 900), alpha=1.2, high_fraction=0.3)
    a = trace.generate(500, seed=7, **kw)
    assert a == trace.generate(500, seed=7, **kw)
    b = trace.generate(500, seed=8, **kw)
    assert [r.arrival_s for r in a] != [r.arrival_s for r in b]
    assert [r.output_tokens for r in a] != [r.output_tokens for r in b]


def test_arrival_process_changes_only_arrivals():
    # Separate random streams: comparing Poisson with Gamma on one seed compares the same requests.
    p = trace.generate(300, rate=2.0, arrival="poisson", seed=3, high_fraction=0.2)
    g = trace.generate(300, rate=2.0, arrival="gamma", cv=3.0, seed=3, high_fraction=0.2)
    assert [(r.prompt_tokens, r.output_tokens, r.priority) for r in p] == \
           [(r.prompt_tokens, r.output_tokens, r.priority) for r in g]
    assert [r.arrival_s for r in p] != [r.arrival_s for r in g]


def test_lengths_within_bounds_and_arrivals_in_order():
    reqs = trace.generate(N, rate=5.0, prompt=(10, 20), output=(1, 3000), alpha=0.8, seed=1)
    assert [r.index for r in reqs] == list(range(N))
    assert all(10 <= r.prompt_tokens <= 20 for r in reqs)
    assert all(1 <= r.output_tokens <= 3000 for r in reqs)
    assert {r.prompt_tokens for r in reqs} == set(range(10, 21))  # every value of a narrow range is drawn
    assert min(r.output_tokens for r in reqs) == 1
    assert all(isinstance(r.prompt_tokens, int) and isinstance(r.output_tokens, int) for r in reqs)
    times = [r.arrival_s for r in reqs]
    assert times == sorted(times) and times[0] > 0
    fixed = trace.generate(50, rate=1.0, prompt=(64, 64), output=(5, 5), seed=2)
    assert {(r.prompt_tokens, r.output_tokens) for r in fixed} == {(64, 5)}


@pytest.mark.parametrize("arrival,cv", [("poisson", 1.0), ("gamma", 1.0), ("gamma", 3.0), ("gamma", 0.5)])
def test_mean_inter_arrival_is_one_over_rate(arrival, cv):
    rate = 4.0
    gaps = trace.gaps(random.Random(11), N, rate, arrival, cv)
    # Standard error of the mean gap: cv / rate / sqrt(N) (0.7% of 1/rate for cv 1, 2.1% for cv 3): allow
    # five of them, and at least 5%.
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=max(0.05, 5 * cv / math.sqrt(N)))


def test_gamma_is_burstier_than_poisson():
    poisson = _cv(_gaps(trace.generate(N, rate=2.0, arrival="poisson", seed=5)))  # through generate, once
    gamma = _cv(trace.gaps(random.Random(5), N, 2.0, "gamma", 3.0))
    # The sample CV's standard error is about 1% (Poisson) and 3% (Gamma, shape 1/9) for this N.
    assert 0.9 < poisson < 1.1
    assert 2.5 < gamma < 3.5
    smooth = _cv(trace.gaps(random.Random(5), N, 2.0, "gamma", 0.5))
    assert 0.45 < smooth < 0.55


def test_power_law_is_heavy_tailed_with_the_right_mean():
    lo, hi = 16, 4096
    xs = [r.output_tokens for r in trace.generate(N, rate=1.0, output=(lo, hi), alpha=1.0, seed=9)]
    mean, median = statistics.fmean(xs), statistics.median(xs)
    # alpha = 1 on [16, 4097): median ~256, mean ~735 (standard error ~7 for this N).
    assert median < 0.5 * mean
    assert mean == pytest.approx(trace.power_law_mean(lo, hi, 1.0) - 0.5, rel=0.05)
    assert sum(x >= 2048 for x in xs) / N == pytest.approx(math.log(4097 / 2048) / math.log(4097 / 16), abs=0.02)


@pytest.mark.parametrize("alpha", [0.0, 1.0, 1.5, 2.0])
def test_power_law_log_log_slope(alpha):
    lo, hi = 10, 10_000
    rng = random.Random(4)
    xs = [trace.power_law(rng, lo, hi, alpha) for _ in range(N)]
    # Density over log-spaced bins: log(count / width) against log(centre) has slope -alpha.
    edges = [lo * (hi / lo) ** (k / 12) for k in range(13)]
    points = []
    for a, b in zip(edges, edges[1:]):
        count = sum(a <= x < b for x in xs)
        if count >= 30:  # enough draws that the bin's log-count is within ~0.2 of its expectation
            points.append((math.log(math.sqrt(a * b)), math.log(count / (b - a))))
    assert len(points) >= 5
    mx = statistics.fmean(p[0] for p in points)
    my = statistics.fmean(p[1] for p in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    assert slope == pytest.approx(-alpha, abs=0.25)


def test_power_law_mean_formula():
    assert trace.power_law_mean(1, 99, 0.0) == pytest.approx(50.5)  # uniform on [1, 100)
    assert trace.power_law_mean(16, 4095, 1.0) == pytest.approx((4096 - 16) / math.log(4096 / 16))


@pytest.mark.parametrize("fraction,n", [(0.0, 1000), (0.1, N), (0.5, N), (1.0, 1000)])
def test_high_priority_fraction(fraction, n):
    reqs = trace.generate(n, rate=1.0, high_fraction=fraction, seed=6)
    assert {r.priority for r in reqs} <= {"high", "normal"}
    share = sum(r.priority == "high" for r in reqs) / n
    assert share == pytest.approx(fraction, abs=0.015)  # standard error at most 0.0036 here


def test_summary_and_bad_arguments():
    reqs = trace.generate(100, rate=10.0, prompt=(5, 5), output=(7, 7), high_fraction=1.0, seed=0)
    s = trace.summary(reqs)
    assert s["requests"] == 100 and s["high_priority"] == 100
    assert s["prompt_tokens"] == {"mean": 5, "median": 5, "max": 5}
    assert s["duration_s"] == reqs[-1].arrival_s
    assert trace.summary([]) == {"requests": 0}
    assert trace.generate(0, rate=1.0) == []
    for bad in (dict(rate=0.0), dict(rate=1.0, arrival="uniform"), dict(rate=1.0, arrival="gamma", cv=0.0),
                dict(rate=1.0, prompt=(0, 5)), dict(rate=1.0, output=(9, 8)), dict(rate=1.0, high_fraction=1.5)):
        with pytest.raises(ValueError):
            trace.generate(10, **bad)
