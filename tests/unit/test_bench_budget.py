"""A benchmark's time budget (what runs, what is skipped and why) and its progress line: pure functions of
measured durations and an injected clock (llumnixctl/experiments/bench/budget.py)."""

from __future__ import annotations

import io

import pytest

from llumnixctl.experiments.bench.budget import (Budget, Progress, Rounds, Units, estimate, fit_seconds, plan,
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
    assert estimate([(1, 50.0)], 1) == pytest.approx(55.0)  # the default safety for a unit like one measured, 1.1
    assert estimate([(1, 50.0)], 2) == pytest.approx(120.0)  # past the largest measured, 1.2


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


def test_rounds_run_whole_or_not_at_all_and_each_skipped_unit_has_a_progress_line():
    """bench disagg's default: 3 interleaved rounds of mixed, split and adaptive. A round runs only when all its
    configurations fit (a round without one of them compares nothing); the first always runs."""
    clock, out = Clock(), io.StringIO()
    b = Budget(240, clock=clock)
    p = Progress(9, stream=out, clock=clock, start=0.0, heartbeat_s=None)
    rounds = Rounds(b, p, reserve_s=15)
    took = {"mixed": 36.0, "split": 60.0, "adaptive": 60.0}
    ran = []
    clock.t = 5  # the model written
    for r in (1, 2, 3):
        units = [({"config": c, "round": r}, f"round {r}/3: {c}", c) for c in took]
        if not rounds.begin(units):
            continue
        for unit, label, key in units:
            assert rounds.start(unit, label, key)
            clock.t += took[key]
            rounds.done(key)
            ran.append((r, key))
    # round 1 ends at 161 s; round 2 is estimated at 1.1 x 156 = 172 s (+15) against 79 s left: skipped whole
    assert ran == [(1, "mixed"), (1, "split"), (1, "adaptive")]
    assert [(s["round"], s["config"]) for s in b.skipped] == [(r, c) for r in (2, 3) for c in took]
    assert b.skipped[0]["reason"] == "the round estimated 172 s (+15 s for what follows), 79 s of the 240 s budget left"
    lines = out.getvalue().splitlines()
    assert lines[:3] == ["[1/9] round 1/3: mixed: 5 s elapsed", "[2/9] round 1/3: split: 41 s elapsed",
                         "[3/9] round 1/3: adaptive: 101 s elapsed"]
    assert lines[3].startswith("[4/9] round 2/3: mixed: skipped (the round estimated 172 s") and len(lines) == 9


def test_a_later_round_runs_when_it_fits():
    clock = Clock()
    b = Budget(240, clock=clock)
    rounds = Rounds(b, Progress(4, stream=io.StringIO(), clock=clock, heartbeat_s=None), reserve_s=15)
    ran = 0
    for r in (1, 2, 3, 4):
        units = [({"round": r, "system": "llumnix"}, f"round {r}", "llumnix")]
        if rounds.begin(units):
            assert rounds.start(*units[0])
            clock.t += 50
            rounds.done("llumnix")
            ran += 1
    # 50, 100, 150: the 4th is estimated at 60 s + 15 against 90 s left: it runs; ends at 200
    assert ran == 4 and b.skipped == []


def test_interleaved_rounds_reverse_the_order_every_other_round_and_time_each_unit():
    clock = Clock()
    b = Budget(1000, clock=clock)
    rounds = Rounds(b, Progress(6, stream=io.StringIO(), clock=clock, heartbeat_s=None), reserve_s=15)
    ran = []
    for k in range(3):
        for label, name in rounds.interleaved(k, 3, ["a", "b"], "system"):
            clock.t += {"a": 10, "b": 30}[name]
            ran.append(label)
    assert ran == ["round 1/3: a", "round 1/3: b", "round 2/3: b", "round 2/3: a", "round 3/3: a", "round 3/3: b"]
    assert rounds.measured == {"a": [(1.0, 10)] * 3, "b": [(1.0, 30)] * 3}


def test_units_of_one_kind_are_estimated_from_the_longest_and_skipped_with_a_progress_line():
    clock, out = Clock(), io.StringIO()
    b = Budget(240, clock=clock)
    p = Progress(3, stream=out, clock=clock, start=0.0, heartbeat_s=None)
    u = Units(b, p, reserve_s=15)
    clock.t = 10
    for name in ("rr", "infaas++", "llumnix"):
        if u.start({"policy": name}, f"policy {name}"):
            clock.t += 90
            u.done()
    # 100: infaas++ estimated 99 + 15 against 140 left: runs; at 190 llumnix is skipped
    assert [s["policy"] for s in b.skipped] == ["llumnix"]
    assert out.getvalue().splitlines()[-1] == ("[3/3] policy llumnix: skipped (estimated 99 s (+15 s for what "
                                               "follows), 50 s of the 240 s budget left)")


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


def test_a_first_round_longer_than_the_budget_runs_its_units_while_they_fit():
    """bench cache with our two systems: each (trace, system) starts 4 engines and replays 300 requests."""
    clock = Clock()
    b = Budget(240, clock=clock)
    rounds = Rounds(b, Progress(8, stream=io.StringIO(), clock=clock, heartbeat_s=None), reserve_s=15)
    ran = []
    for r in (1, 2):
        units = [({"round": r, "trace": t, "system": s}, f"round {r}: {t} {s}", (t, s))
                 for t in ("shared-prefix", "multi-turn") for s in ("llumnix-cache", "llumnix")]
        if not rounds.begin(units):
            continue
        for unit, label, key in units:
            if rounds.start(unit, label, key):
                clock.t += 150
                rounds.done(key)
                ran.append(key)
    assert ran == [("shared-prefix", "llumnix-cache")]
    assert len(b.skipped) == 7 and b.skipped[0]["system"] == "llumnix" and b.skipped[0]["round"] == 1
