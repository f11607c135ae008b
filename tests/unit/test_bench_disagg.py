"""``llumnixctl bench disagg`` and ``bench handover`` without a cluster: the mixed trace's shape, one run's figures
from client results and metric pages built here, the medians and ranges over rounds, the sanity checks against
mixed serving, the tables, the handover gap, the configurations' roles and settings, and the commands' options
and JSON (the cluster run replaced)."""

from __future__ import annotations

import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from llumnixctl.experiments.bench import disagg as bench_disagg, disagg_figures as figs, handover as bench_handover
from llumnixctl.experiments.bench.cli import app
from tests.conftest import cli


def test_the_trace_mixes_long_prompts_into_steady_decode_traffic():
    mix = figs.Mix(seconds=20, short_rate=4, short_prompt=32, short_output=128, long_rate=1, long_prompt=2048,
                   long_output=100, seed=3)
    reqs, kinds = figs.mixed_trace(mix, 0)
    assert [r.index for r in reqs] == list(range(len(reqs))) and len(kinds) == len(reqs)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    short = [r for r, k in zip(reqs, kinds) if k == "short"]
    long = [r for r, k in zip(reqs, kinds) if k == "long"]
    assert len(short) == 80 and {(r.prompt_tokens, r.output_tokens) for r in short} == {(32, 128)}
    gaps = {round(b.arrival_s - a.arrival_s, 6) for a, b in zip(short, short[1:])}
    assert gaps == {0.25}  # steady
    assert 8 <= len(long) <= 35 and {(r.prompt_tokens, r.output_tokens) for r in long} == {(2048, 100)}
    assert all(0 <= r.arrival_s < 20 for r in reqs)
    again, _ = figs.mixed_trace(mix, 0)
    other, _ = figs.mixed_trace(mix, 1)
    assert again == reqs  # every configuration of a round replays the same trace
    assert [r.arrival_s for r in other] != [r.arrival_s for r in reqs]  # each round its own
    none, kinds0 = figs.mixed_trace(figs.Mix(seconds=5, long_rate=0), 0)
    assert set(kinds0) == {"short"} and none


def test_a_shifting_mix_alternates_prompt_heavy_and_decode_heavy_phases_at_the_same_mean_rates():
    mix = figs.Mix(seconds=120, short_rate=4, long_rate=1, seed=3, phase_s=30)
    reqs, kinds = figs.mixed_trace(mix, 0)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    by_phase = {}
    for r, k in zip(reqs, kinds):
        by_phase.setdefault(int(r.arrival_s // 30), []).append(k)
    for phase, ks in by_phase.items():
        if phase % 2:  # decode-heavy: no long prompt, the decode traffic at 1.5 times its rate
            assert ks.count("long") == 0 and abs(ks.count("short") - 180) <= 1
        else:  # prompt-heavy: the long prompts at twice their rate, half the decode traffic
            assert ks.count("long") >= 30 and abs(ks.count("short") - 60) <= 1
    assert abs(kinds.count("short") - 480) <= 2 and 80 <= kinds.count("long") <= 160  # the stationary means
    with pytest.raises(ValueError):
        figs.Mix(phase_s=-1).check()


def test_a_long_prompt_must_be_ten_to_one_and_lengths_are_checked():
    with pytest.raises(ValueError, match="10:1"):
        figs.Mix(long_prompt=900, long_output=100).check()
    with pytest.raises(ValueError, match="shorter"):
        figs.Mix(short_prompt=4096, long_prompt=2048, long_output=10).check()
    figs.Mix(long_prompt=1000, long_output=100).check()
    assert figs.parse_lengths("2048:100", "--long-lengths") == (2048, 100)
    for bad in ("2048", "a:b", "0:5", "1:2:3"):
        with pytest.raises(ValueError, match="--long-lengths"):
            figs.parse_lengths(bad, "--long-lengths")
    assert figs.parse_list("256, 1024,", "--lengths") == [256, 1024]
    with pytest.raises(ValueError, match="--lengths"):
        figs.parse_list("x", "--lengths")


def test_prompts_differ_per_request_and_stay_in_the_vocabulary():
    a, b = figs.prompt_tokens(500, 100, "0-1"), figs.prompt_tokens(500, 100, "0-2")
    assert len(a) == 500 and a != b and a[:8] != b[:8] and all(3 <= t < 100 for t in a + b)
    assert figs.prompt_tokens(500, 100, "0-1") == a


def stream(index: int, ttft: float, gaps: list[float], error: str | None = None, status: int = 200) -> dict:
    times = [ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return {"index": index, "error": error, "status": status, "times": [] if error else times, "sent": float(index)}


def test_one_runs_figures_split_the_decode_traffic_from_the_long_prompts():
    kinds = ["short"] * 4 + ["long"] * 2 + ["short"]
    results = [stream(0, 0.05, [0.02] * 10), stream(1, 0.05, [0.02] * 9 + [0.5]),  # one stalled by a prefill
               stream(2, 0.06, [0.02] * 10), stream(3, 0.04, [0.02] * 10),
               stream(4, 0.8, [0.02] * 5), stream(5, 1.6, [0.02] * 5),
               stream(6, 0, [], error="HTTP 429: busy", status=429)]
    f = figs.run_figures(results, kinds, 10.0, ttft_s=1.0, tpot_s=0.05)
    short, long = f["kinds"]["short"], f["kinds"]["long"]
    assert (short["requests"], short["completed"], short["failed"]) == (5, 4, 1)
    assert short["tpot_p50_ms"] == pytest.approx(20.0) and short["tpot_p99_ms"] == pytest.approx(66.0, abs=1.0)
    assert short["itl_max_ms"] == pytest.approx(500.0) and short["ttft_p50_ms"] == pytest.approx(50.0)
    assert long["ttft_p50_ms"] == pytest.approx(1200.0) and long["met"] == 1 and long["attainment"] == 0.5
    assert short["met"] == 3  # the stalled one misses the TPOT target
    assert f["failed"] == 1 and f["slo"]["goodput_rps"] == 0.4 and f["errors"] == ["HTTP 429: busy"]


PAGE = """# TYPE llumnix_instance_request_phase_seconds histogram
llumnix_instance_request_phase_seconds_bucket{phase="handover",le="+Inf"} %(n)d
llumnix_instance_request_phase_seconds_count{phase="handover"} %(n)d
llumnix_instance_request_phase_seconds_sum{phase="handover"} %(s)f
llumnix_instance_request_phase_seconds_bucket{phase="queued",le="+Inf"} %(n)d
llumnix_instance_request_phase_seconds_count{phase="queued"} %(n)d
llumnix_instance_request_phase_seconds_sum{phase="queued"} %(q)f
# TYPE llumnix_migrations_total counter
llumnix_migrations_total{instance_id="i0",model_name="m",outcome="committed"} %(n)d
llumnix_migrations_total{instance_id="i0",model_name="m",outcome="aborted"} 1
llumnix_migrations_created{instance_id="i0",model_name="m",outcome="aborted"} 1796467765.7
# TYPE llumnix_migration_downtime_seconds histogram
llumnix_migration_downtime_seconds_count{instance_id="i0",model_name="m"} %(n)d
llumnix_migration_downtime_seconds_sum{instance_id="i0",model_name="m"} %(d)f
"""
PROXY = """# TYPE llumnix_proxy_disagg_decisions_total counter
llumnix_proxy_disagg_decisions_total{decision="remote"} %d
llumnix_proxy_disagg_decisions_total{decision="local_short"} %d
# TYPE llumnix_proxy_migration_gap_seconds histogram
llumnix_proxy_migration_gap_seconds_count{kind="handover"} %d
llumnix_proxy_migration_gap_seconds_sum{kind="handover"} %f
llumnix_proxy_migration_gap_seconds_count{kind="migration"} 7
llumnix_proxy_migration_gap_seconds_sum{kind="migration"} 70
"""
OWN = """# TYPE llumnix_instance_request_prefill_time_seconds histogram
llumnix_instance_request_prefill_time_seconds_count{instance_id="i0"} %(n)d
llumnix_instance_request_prefill_time_seconds_sum{instance_id="i0"} %(s)f
# TYPE llumnix_instance_handover_seconds histogram
llumnix_instance_handover_seconds_count{instance_id="i0"} %(n)d
llumnix_instance_handover_seconds_sum{instance_id="i0"} %(s)f
# TYPE llumnix_instance_handovers_total counter
llumnix_instance_handovers_total{instance_id="i0",reason="handover",outcome="committed"} %(n)d
llumnix_instance_handovers_total{instance_id="i0",reason="role",outcome="aborted"} 1
"""


def test_the_cluster_figures_count_handovers_phases_and_decisions():
    i0a = figs.parse_metrics(PAGE % {"n": 2, "s": 0.1, "q": 0.2, "d": 0.01})
    i0b = figs.parse_metrics(PAGE % {"n": 6, "s": 0.5, "q": 0.6, "d": 0.05})
    i1 = figs.parse_metrics(PAGE % {"n": 0, "s": 0, "q": 0, "d": 0})
    before, after = figs.merged([i0a, i1]), figs.merged([i0b, i1])
    assert after["llumnix_migrations_total{outcome=aborted}"] == 2  # the instances' pages add up
    assert not any("_created" in k or "instance_id" in k for k in after)
    c = figs.cluster_figures({"handover/committed": 3, "balance/committed": 1},
                             {"handover/committed": 7, "handover/aborted": 1, "balance/committed": 1}, before, after,
                             figs.parse_metrics(PROXY % (1, 5, 1, 0.01)), figs.parse_metrics(PROXY % (5, 6, 3, 0.07)),
                             {"i1": "decode", "i0": "prefill"})
    assert c["handovers"] == {"committed": 4, "aborted": 1}
    assert c["ordered_migrations"] == {"handover/aborted": 1, "handover/committed": 4}
    assert c["handover_ms"] == pytest.approx(100.0) and c["phase_mean_ms"]["queued"] == pytest.approx(100.0)
    assert c["phase_mean_ms"]["prefill"] is None and c["migration_downtime_mean_ms"] == pytest.approx(10.0)
    assert c["migrations"] == {"committed": 4} and c["decisions"] == {"local_short": 1, "remote": 4}
    assert list(c["roles_at_end"]) == ["i0", "i1"]
    assert c["handover_gap_mean_ms"] == pytest.approx(30.0)  # the handovers' gaps, not the other migrations'
    # where the instances have no per-phase histogram, their own prefill and handover histograms stand in
    own0, own1 = figs.parse_metrics(OWN % {"n": 1, "s": 0.2}), figs.parse_metrics(OWN % {"n": 3, "s": 0.5})
    c = figs.cluster_figures({}, {}, own0, own1, {}, {}, {})
    assert c["phase_mean_ms"]["prefill"] == pytest.approx(150.0) and c["handover_ms"] == pytest.approx(150.0)
    assert c["phase_mean_ms"]["queued"] is None and c["instance_handovers"] == {"handover/committed": 2}


def figures(tpot99: float, long_ttft: float, goodput: float, handover: float | None = None,
            queued: float | None = None, migration: float | None = None) -> dict:
    return {"kinds": {"short": {"tpot_p99_ms": tpot99, "tpot_p50_ms": tpot99 / 2, "itl_p99_ms": None,
                                "ttft_p50_ms": 50.0, "ttft_p99_ms": 90.0},
                      "long": {"ttft_p50_ms": long_ttft, "ttft_p99_ms": long_ttft * 1.5}},
            "slo": {"goodput_rps": goodput, "attainment": 0.9}, "failed": 0,
            "cluster": {"handovers": {"committed": 10, "aborted": 0}, "handover_ms": handover,
                        "phase_mean_ms": {"queued": queued}, "migration_downtime_mean_ms": None,
                        "migration_mean_ms": migration}}


def test_rounds_give_medians_and_ranges_and_the_sanity_checks_compare_with_mixed():
    runs = []
    for r, (m, s, a) in enumerate([(100, 40, 60), (120, 45, 50), (90, 70, 55)]):
        runs += [{"config": "mixed", "round": r, "figures": figures(m, 300, 2.0)},
                 {"config": "split", "round": r, "figures": figures(s, 400, 3.0, handover=20, queued=90)},
                 {"config": "adaptive", "round": r, "figures": figures(a, 500, 1.8, handover=20, queued=30)}]
    summary = figs.summarize(runs)
    assert list(summary) == ["mixed", "split", "adaptive"]
    assert summary["mixed"]["decode_tpot_p99_ms"] == {"median": 100, "min": 90, "max": 120, "values": [100, 120, 90]}
    assert summary["split"]["decode_itl_p99_ms"]["median"] is None
    checks = figs.sanity(summary)
    assert checks["split"]["tpot_p99_ratio"] == 0.45 and checks["split"]["tpot_goal_met"] is True
    assert checks["split"]["long_ttft_p50_increase_ms"] == 100 and checks["split"]["handover_plus_queued_ms"] == 110
    assert checks["split"]["ttft_increase_within"] is True and checks["split"]["goodput_higher"] is True
    assert checks["adaptive"]["tpot_goal_met"] is False and checks["adaptive"]["ttft_increase_within"] is False
    assert checks["adaptive"]["goodput_ratio"] == 0.9 and checks["adaptive"]["goodput_higher"] is False
    res = {"instances": 3, "backend": "sim", "rounds": 3, "slo": {"ttft_ms": 1000, "tpot_ms": 50},
           "roles": {"mixed": "3 mixed", "split": "1P+2D", "adaptive": "1P+2D"}, "summary": summary, "sanity": checks}
    console = Console(record=True, width=200)
    console.print(figs.summary_table(res))
    text = console.export_text()
    assert "100.0 [90.0-120.0]" in text and "0.45 (yes)" in text and "split (1P+2D)" in text
    # no handover or queueing measured: the TTFT check says so rather than passing or failing
    bare = figs.sanity(figs.summarize([{"config": "mixed", "round": 0, "figures": figures(100, 300, 2)},
                                       {"config": "split", "round": 0, "figures": figures(40, 400, 3)}]))
    assert bare["split"]["handover_plus_queued_ms"] is None and bare["split"]["ttft_increase_within"] is None
    # no handover phase measured: the migrations' mean time stands for it
    moved = figs.sanity(figs.summarize([{"config": "mixed", "round": 0, "figures": figures(100, 300, 2)},
                                        {"config": "split", "round": 0, "figures": figures(40, 400, 3, migration=70,
                                                                                           queued=40)}]))
    assert moved["split"]["handover_plus_queued_ms"] == 110 and moved["split"]["ttft_increase_within"] is True


def test_the_handover_gap_is_the_longest_wait_after_the_first_token():
    g = figs.handover_gap([0.3, 0.31, 0.36, 0.37, 0.38, 0.39])
    assert g == {"ttft_ms": 300.0, "gap_ms": 50.0, "gap_at": 2, "step_ms": 10.0}
    assert figs.handover_gap([0.3])["gap_ms"] is None and figs.handover_gap([])["ttft_ms"] is None
    samples = [{"tokens": n, "cluster": c, "gap_ms": gap, "ttft_ms": 100.0, "step_ms": 10.0, "handovers": int(c == "disagg"),
                "handover_ms": 5.0 if c == "disagg" else None, "downtime_ms": None, "migration_ms": None,
                "proxy_gap_ms": 9.0 if c == "disagg" else None}
               for n in (256, 1024) for c in ("disagg", "mixed") for gap in ((30.0, 40.0, 35.0) if c == "disagg" else (12.0,) * 3)]
    rows = figs.handover_rows(samples)
    assert [r["tokens"] for r in rows] == [256, 1024]
    assert rows[0]["disagg"]["gap_ms"]["median"] == 35.0 and rows[0]["disagg"]["handovers"] == 3
    assert rows[0]["mixed"]["gap_ms"] == {"median": 12.0, "min": 12.0, "max": 12.0, "values": [12.0] * 3}
    console = Console(record=True, width=200)
    console.print(figs.handover_table({"backend": "sim", "model": "sim", "repeat": 3, "results": rows}))
    text = console.export_text()
    assert "35.0 [30.0-40.0]" in text and "3/3" in text


def test_the_configurations_roles_and_settings():
    assert bench_disagg.roles_of("mixed", 3, 1) == ["mixed"] * 3
    assert bench_disagg.roles_of("split", 4, 1) == ["prefill", "decode", "decode", "decode"]
    assert bench_disagg.roles_label(["prefill", "decode", "decode"]) == "1P+2D"
    assert bench_disagg.config_sets("adaptive", 3000, 100, False) == ["disagg.adaptive=true", "slo.ttft_ms=3000",
                                                                      "slo.tpot_ms=100"]
    assert bench_disagg.config_sets("split", 3000, 100, False) == []
    assert bench_disagg.config_sets("mixed", 3000, 0, True) == ["slo.ttft_ms=3000"]


def test_the_handover_bench_picks_a_model_whose_context_holds_the_prompts():
    assert bench_handover.model_size("auto", [256, 1024, 3968], 64) == "tiny"
    assert bench_handover.model_size("auto", [256, 8192], 64) == "kv-heavy"
    with pytest.raises(ValueError, match="context is 4096 tokens: prompts of at most 3968"):
        bench_handover.model_size("tiny", [4096], 64)
    res = cli("bench", "handover", "--model-size", "tiny", "--lengths", "256,8192")
    assert res.returncode == 2 and "context is 4096" in res.stderr


def test_bad_options_are_refused_before_anything_starts():
    for args, words in ((["--long-lengths", "500:100"], "10:1"), (["--configs", "mixed,both"], "--configs"),
                        (["--prefill", "3", "--instances", "3"], "no decode instance"),
                        (["--set", "disagg.adaptive=maybe"], "disagg.adaptive")):
        res = cli("bench", "disagg", "--backend", "sim", *args)
        assert res.returncode == 2 and words in res.stderr, (args, res.stderr)


def fake_run_one(calls: list):
    def run_one(backend, sets, roles, reqs, kinds, target, round_, ttft_s, tpot_s, timeout_s, log):
        calls.append((round_, bench_disagg.roles_label(roles), [s for s in sets if s.startswith(("slo.", "disagg."))]))
        mixed = bench_disagg.roles_label(roles).endswith("mixed")
        f = figures(100 + round_ if mixed else 40, 300 if mixed else 400, 2.0 if mixed else 2.5,
                    handover=None if mixed else 20, queued=None if mixed else 100)
        return f | {"errors": []}
    return run_one


def test_the_command_runs_every_configuration_of_every_round_interleaved(monkeypatch, tmp_path):
    calls: list = []
    monkeypatch.setattr(bench_disagg, "run_one", fake_run_one(calls))
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["disagg", "--backend", "sim", "--rounds", "2", "--seconds", "5", "--json",
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert [(r, label) for r, label, _ in calls] == [(0, "2 mixed"), (0, "1P+1D"), (0, "1P+1D"),
                                                    (1, "2 mixed"), (1, "1P+1D"), (1, "1P+1D")]
    assert calls[2][2] == ["disagg.adaptive=true", "slo.ttft_ms=1000", "slo.tpot_ms=25"] and calls[1][2] == []
    doc = json.loads(out.read_text())
    assert json.loads(res.stdout) == doc
    for key in ("backend", "cores", "instances", "rounds", "trace", "slo", "roles", "summary", "sanity", "runs"):
        assert key in doc, key
    assert doc["sanity"]["split"]["tpot_p99_ratio"] == round(40 / 100.5, 4) and len(doc["runs"]) == 6
    assert doc["trace"]["long_prompt"] == 2048 and doc["roles"]["adaptive"] == "1P+1D"


def test_rounds_split_over_runs_merge_into_one_result(monkeypatch, tmp_path):
    calls: list = []
    monkeypatch.setattr(bench_disagg, "run_one", fake_run_one(calls))
    files = []
    for k in range(3):
        files.append(tmp_path / f"r{k}.json")
        res = CliRunner().invoke(app, ["disagg", "--backend", "sim", "--rounds", "1", "--first-round", str(k),
                                       "--configs", "mixed,split", "--out", str(files[-1])])
        assert res.exit_code == 0, res.output
    assert [c[0] for c in calls] == [0, 0, 1, 1, 2, 2]  # each run its own round (its own trace)
    res = CliRunner().invoke(app, ["disagg", "--merge", str(files[0]), "--merge", str(files[1]), "--merge",
                                   str(files[2]), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["rounds"] == 3 and len(doc["runs"]) == 6
    assert doc["summary"]["mixed"]["decode_tpot_p99_ms"] == {"median": 101, "min": 100, "max": 102,
                                                             "values": [100, 101, 102]}
    assert doc["sanity"]["split"]["tpot_p99_ratio"] == round(40 / 101, 4)
    again = CliRunner().invoke(app, ["disagg", "--merge", str(files[0]), "--merge", str(files[0])])
    assert again.exit_code == 2 and "repeat a round" in again.stderr
    other = json.loads(files[1].read_text()) | {"instances": 4}
    (tmp_path / "other.json").write_text(json.dumps(other))
    differ = CliRunner().invoke(app, ["disagg", "--merge", str(files[0]), "--merge", str(tmp_path / "other.json")])
    assert differ.exit_code == 2 and "'instances'" in differ.stderr
