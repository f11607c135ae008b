"""A benchmark's time budget (what runs, what is skipped and why) and its progress line: pure functions of
measured durations and an injected clock (llumnixctl/experiments/bench/budget.py)."""

from __future__ import annotations

import io

import pytest

from llumnixctl.experiments.bench.budget import (Budget, Progress, Units, estimate, fit_seconds, plan,
                                                 skipped_lines, trace_prefix)


class Clock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_nothing_measured_gives_no_estimate():
    assert estimate([], 4096) is None


def test_units_of_one_size_are_estimated_as_the_longest_measured():
    assert estimate([(1, 50.0), (1, 70.0)], 1, safety=1.0) == 70.0
    assert estimate([(1, 50.0)], 1) == pytest.approx(60.0)  # the default safety, 1.2


def test_a_longer_unit_scales_at_least_linearly_and_at_most_quadratically():
    # flat small lengths (fixed costs): still at least linear past them
    assert estimate([(256, 20.0), (1024, 22.0)], 4096, safety=1.0) == pytest.approx(88.0)
    # superlinear: the power fitted to the two largest (here 1.5)
    assert estimate([(1024, 10.0), (4096, 80.0)], 8192, safety=1.0) == pytest.approx(80.0 * 2 ** 1.5)
    # steeper than quadratic is held at 2
    assert estimate([(1024, 1.0), (2048, 100.0)], 4096, safety=1.0) == pytest.approx(400.0)
    # one point: linear
    assert estimate([(256, 30.0)], 1024, safety=1.0) == pytest.approx(120.0)
    # a smaller unit than one measured: the longest of those at least as large
    assert estimate([(256, 30.0), (4096, 90.0)], 1024, safety=1.0) == 90.0


def test_the_issue_run_keeps_the_lengths_that_fit_and_says_why_the_rest_were_skipped():
    """--lengths 256,1024,4096,8192 (vLLM, kv-heavy): start-up 60 s, then lengths of 25, 40 and 150 s; 8192,
    estimated from 1024 -> 4096, cannot fit in the 240 s budget."""
    units = [({"tokens": n}, n) for n in (256, 1024, 4096, 8192)]
    run, skipped = plan(units, [25.0, 40.0, 150.0, 400.0], 240.0, start_s=60.0)
    # at 125 s: 4096 is estimated at 40 s x 4 x 1.2 = 192 s (1024 took hardly more than 256: linear), 115 s left
    assert run == [{"tokens": 256}, {"tokens": 1024}]
    assert skipped == [{"tokens": 4096, "reason": "estimated 192 s, 115 s of the 240 s budget left"},
                       {"tokens": 8192, "reason": "estimated 384 s, 115 s of the 240 s budget left"}]
    # the same with no budget: everything runs
    run, skipped = plan(units, [25.0, 40.0, 150.0, 400.0], None, start_s=60.0)
    assert len(run) == 4 and skipped == []


def test_plan_skips_exactly_what_the_estimates_say():
    units = [({"tokens": n}, n) for n in (256, 1024, 4096)]
    # 256 took 10 s at 20 s in: 1024 is estimated at 10 * 4 * 1.2 = 48 s and 70 s are left; it ran 30 s (at 60 s);
    # 4096 then 30 * 4 * 1.2 = 144 s against 40 s left: skipped
    run, skipped = plan(units, [10.0, 30.0, 999.0], 100.0, start_s=20.0)
    assert run == [{"tokens": 256}, {"tokens": 1024}]
    assert skipped == [{"tokens": 4096, "reason": "estimated 144 s, 40 s of the 100 s budget left"}]


def test_the_first_unit_always_runs_even_past_the_budget():
    run, skipped = plan([({"round": 1}, 1), ({"round": 2}, 1)], [500.0, 500.0], 60.0, start_s=120.0)
    assert run == [{"round": 1}] and skipped[0]["round"] == 2


def test_a_budget_keeps_a_reserve_and_a_unit_without_estimate_fits_only_while_the_reserve_does():
    clock = Clock()
    b = Budget(100, clock=clock)
    b.always()
    clock.t = 80
    assert b.allows(10, reserve_s=10) and not b.allows(11, reserve_s=10)
    assert b.allows(None, reserve_s=15) and not b.allows(None, reserve_s=25)
    assert not b.consider({"part": "short"}, 15, reserve_s=15)
    assert b.fields() == {"budget_s": 100.0, "skipped": [
        {"part": "short", "reason": "estimated 15 s (+15 s for what follows), 20 s of the 100 s budget left"}]}
    assert Budget(0).fields() == {"budget_s": None, "skipped": []}  # 0: no budget
    assert Budget(0).allows(1e9)


def test_a_timed_phase_is_shortened_to_the_budget_but_not_below_its_floor():
    clock = Clock()
    b = Budget(240, clock=clock)
    clock.t = 100
    assert fit_seconds(b, 120, reserve_s=30) == 110  # 140 left, 30 kept
    clock.t = 180
    assert fit_seconds(b, 120, reserve_s=30) == 30
    clock.t = 239
    assert fit_seconds(b, 120, reserve_s=30) == 10  # never below 10 s
    assert fit_seconds(b, 5, reserve_s=30) == 5
    assert fit_seconds(Budget(None), 120, reserve_s=30) == 120


def test_units_of_several_kinds_are_estimated_by_kind_and_skipped_with_a_progress_line():
    clock, out = Clock(), io.StringIO()
    b = Budget(240, clock=clock)
    p = Progress(6, stream=out, clock=clock, start=0.0, heartbeat_s=None)
    u = Units(b, p, reserve_s=15)
    ran = []
    durations = {"llumnix": 60.0, "router": 90.0}
    clock.t = 30  # start-up
    for rnd in (1, 2, 3):
        for name in ("llumnix", "router"):
            if u.start({"round": rnd, "system": name}, f"round {rnd}/3: {name}", key=name):
                clock.t += durations[name]
                u.done()
                ran.append((rnd, name))
    # 30 + 60 = 90; the router has no estimate of its own: the llumnix one's (72 s) fits 150 - 15; 90 more: 180.
    # round 2, llumnix: 72 s against 60 left minus 15 reserved: skipped; router: 108: skipped; round 3 likewise.
    assert ran == [(1, "llumnix"), (1, "router")]
    assert [(s["round"], s["system"]) for s in b.skipped] == [(2, "llumnix"), (2, "router"), (3, "llumnix"), (3, "router")]
    lines = out.getvalue().splitlines()
    assert lines[0] == "[1/6] round 1/3: llumnix: 30 s elapsed"
    assert lines[1] == "[2/6] round 1/3: router: 90 s elapsed"
    assert lines[2] == ("[3/6] round 2/3: llumnix: skipped (estimated 72 s (+15 s for what follows), "
                        "60 s of the 240 s budget left)")
    assert lines[-1].startswith("[6/6] round 3/3: router: skipped (")


def test_the_progress_line_counts_units_and_seconds_since_the_start():
    clock, out = Clock(100.0), io.StringIO()
    p = Progress(12, stream=out, clock=clock, start=59.0, heartbeat_s=None)
    assert p.step("length 256") == "[1/12] length 256: 41 s elapsed"
    clock.t = 130.4
    p.step("length 1024")
    assert p.update("length 1024, round 2") == "[2/12] length 1024, round 2: 71 s elapsed"
    assert p.skipped("length 8192", "no time") == "[3/12] length 8192: skipped (no time)"
    assert p.label == ""  # the heartbeat does not repeat a unit that ended
    assert out.getvalue().splitlines() == ["[1/12] length 256: 41 s elapsed", "[2/12] length 1024: 71 s elapsed",
                                           "[2/12] length 1024, round 2: 71 s elapsed",
                                           "[3/12] length 8192: skipped (no time)"]


def test_the_progress_line_repeats_while_a_unit_runs_long():
    import time

    out = io.StringIO()
    with Progress(3, stream=out, heartbeat_s=0.05) as p:
        p.step("round 1")
        time.sleep(1.3)  # the heartbeat looks at least once a second
    lines = out.getvalue().splitlines()
    assert len(lines) >= 2 and all(x.startswith("[1/3] round 1: ") and x.endswith(" s elapsed") for x in lines)


def test_skipped_lines_name_the_unit_and_the_reason():
    assert skipped_lines([{"tokens": 8192, "reason": "estimated 300 s, 20 s of the 240 s budget left"}],
                         lambda s: f"length {s['tokens']}") == [
        "skipped length 8192: estimated 300 s, 20 s of the 240 s budget left"]


def test_a_trace_is_cut_to_the_requests_every_replay_can_serve_within_the_budget():
    arrivals = [0.0, 5.0, 10.0, 20.0, 40.0]
    outputs = [100, 400, 100, 2000, 100]
    # 3 replays of 20 s overhead, 25 ms a token: the first 3 take 3 x (10 + 10 + 20) = 120 s; the 4th request's
    # 2000 tokens make it 3 x (20 + 50 + 20) = 270 s
    assert trace_prefix(arrivals, outputs, 3, 200.0, 0.025, 20.0) == 3
    assert trace_prefix(arrivals, outputs, 3, 1e9, 0.025, 20.0) == 5  # all of it fits
    assert trace_prefix(arrivals, outputs, 3, 1.0, 0.025, 20.0) == 1  # never none
