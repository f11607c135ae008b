"""`llumnixctl bench lora` on a small trace: adapters drawn by Zipf popularity, every placement serves every request
(none lost, none failed), residency keeps a where-loaded cluster's adapters on one instance each, and the figures
the command prints are there; the sim's load time from a profile's measured load; the vllm mode's pieces that run
without vLLM (its cluster's catalogue and placement, its counters, its rounds' summary, its options)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from llumnixctl.experiments.bench.lora import PLACEMENTS, LoraBench, adapter_draw, run, summarize

PROFILES = Path(__file__).resolve().parents[2] / "daemons" / "engine" / "profiles"


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


def test_the_sim_loads_in_the_profiles_measured_time_unless_load_ms_is_given(tmp_path):
    from daemons.engine.profile import LatencyProfile, LoraProfile
    from llumnixctl.experiments.bench.lora import sim_load_ms

    prof = LatencyProfile.load(PROFILES / "vllm-cpu-tiny.json")
    assert prof.lora is not None and prof.lora.rank == 8 and prof.lora.stall_ms > 0  # measured, shipped
    path = tmp_path / "p.json"
    LatencyProfile(**{**prof.__dict__, "lora": LoraProfile(8, 5, 30.0, 5.0, 1.0)}).save(path)
    small = LoraBench(instances=2, slots=2, adapters=4, requests=40, rate=20.0, load_ms=None)
    assert sim_load_ms(small, [f"sim.profile={path}"]) == 35.0
    assert sim_load_ms(small) == 50.0  # no profile: the old default
    assert sim_load_ms(LoraBench(load_ms=20.0), [f"sim.profile={path}"]) == 20.0
    res = run(small, ["by-load"], [f"sim.profile={path}"])
    assert res["bench"]["load_ms"] == 35.0 and res["placements"]["by-load"]["completed"] == 40


def test_rounds_are_summarized_by_their_median_and_failures_summed():
    rows = [{"round": k + 1, "placement": "resident", "completed": 10, "failed": k, "p99_ttft_ms": p99,
             "adapter_loads": loads, "first_error": ""} for k, (p99, loads) in enumerate([(300.0, 4), (100.0, 9),
                                                                                         (200.0, 5)])]
    s = summarize(rows)["resident"]
    assert s == {"rounds": 3, "completed": 30, "failed": 3, "p99_ttft_ms": 200.0, "adapter_loads": 5, "first_error": ""}


def test_the_vllm_run_serves_every_adapter_from_the_proxy_and_none_from_the_instances_at_start():
    from llumnixctl.experiments.bench.lora_vllm import catalogue, none_held

    assert none_held("instance-i3") == ([], ["lora.adapters="])
    assert none_held("manager") == ([], []) and none_held("proxy") == ([], [])
    assert catalogue({"a0": Path("/x/a0"), "a1": Path("/x/a1")}) == "a0=/x/a0,a1=/x/a1"


def test_the_adapter_counters_are_read_off_an_instances_metrics_page():
    from llumnixctl.experiments.bench.lora_vllm import EVICTIONS, LOADS, REQUESTS, totals

    page = ("# TYPE llumnix_instance_adapter_loads_total counter\nllumnix_instance_adapter_loads_total 7.0\n"
            "# TYPE llumnix_instance_adapter_evictions_total counter\nllumnix_instance_adapter_evictions_total 5.0\n"
            "# TYPE llumnix_instance_requests_total counter\nllumnix_instance_requests_total{priority=\"normal\"} 30.0\n"
            "llumnix_instance_requests_total{priority=\"high\"} 2.0\n"
            "# TYPE llumnix_instance_adapters_held gauge\nllumnix_instance_adapters_held 2.0\n")
    assert totals(page) == {LOADS: 7.0, EVICTIONS: 5.0, REQUESTS: 32.0}


def test_the_command_keeps_each_engines_options_to_it():
    from typer.testing import CliRunner

    from llumnixctl.main import app

    def bench(*args):
        return CliRunner().invoke(app, ["bench", "lora", *args])

    r = bench("--rounds", "2")
    assert r.exit_code == 2 and "--rounds is for --engine vllm" in r.output
    r = bench("--engine", "vllm", "--load-ms", "10")
    assert r.exit_code == 2 and "for the simulator" in r.output
    r = bench("--engine", "gpu")
    assert r.exit_code == 2 and "--engine takes sim or vllm" in r.output
    r = bench("--profile", "/nonexistent.json")
    assert r.exit_code == 2 and "cannot read the latency profile" in r.output
    r = bench("-n", "2", "--adapters", "3", "--requests", "30", "--rate", "10", "--placement", "resident", "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["engine"] == "sim" and res["bench"]["load_ms"] == 50.0 and res["placements"]["resident"]["completed"] == 30
    assert res["bench"]["prompt"] == [16, 1024] and res["bench"]["output"] == [16, 512]  # the sim's defaults

