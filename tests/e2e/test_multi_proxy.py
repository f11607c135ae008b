"""A local cluster with several proxies (`llumnixctl up --proxies N`): each serves, `down` stops them all."""

from __future__ import annotations

import json
import urllib.request

import psutil
import pytest

from conftest import FAST, cli
from llumnixctl.lab import localcluster

pytestmark = pytest.mark.e2e


def complete(url: str) -> dict:
    body = json.dumps({"model": "llumnix-sim", "prompt": "hello", "max_tokens": 2}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def test_three_proxies_serve_and_down_stops_every_one(tmp_path):
    args = ["up", "--run-dir", str(tmp_path), "--port", "0", "-n", "2", "--proxies", "3", "--json"]
    res = cli(*args, *[a for s in FAST for a in ("--set", s)])
    assert res.returncode == 0, res.stderr
    up = json.loads(res.stdout)
    procs = [localcluster.Proc(p["name"], p["pid"], psutil.Process(p["pid"]).create_time(), p["log"], [])
             for p in up["processes"]]
    try:
        assert up["url"] == up["urls"][0] and len(set(up["urls"])) == 3
        assert sorted(p.name for p in procs if p.name.startswith("proxy")) == ["proxy", "proxy-1", "proxy-2"]
        for url in up["urls"]:
            assert complete(url)["choices"][0]["text"] is not None
        assert localcluster.ClusterState.load(tmp_path).urls == up["urls"]  # saved with the state
        res = cli("down", "--run-dir", str(tmp_path), "--json")
        assert res.returncode == 0, res.stderr
        assert len(json.loads(res.stdout)["stopped"]) == len(procs)
        assert [p.pid for p in procs if p.process() is not None] == []
    finally:
        for p in procs:  # only if an assertion failed before `down`: by pid and start time
            live = p.process()
            if live is not None:
                live.kill()


def test_a_state_file_from_before_several_proxies_loads(tmp_path):
    state = localcluster.ClusterState("tcp://127.0.0.1:1", "http://127.0.0.1:2", "sim", None)
    state.save(tmp_path)
    data = json.loads((tmp_path / localcluster.STATE_FILE).read_text())
    del data["urls"]  # as an older llumnixctl wrote it
    (tmp_path / localcluster.STATE_FILE).write_text(json.dumps(data))
    assert localcluster.ClusterState.load(tmp_path).urls == ["http://127.0.0.1:2"]


OLD_KEYS = {"instances", "cores", "direct_ttft_ms", "proxy_ttft_ms", "added_ttft_ms_p50", "streams", "concurrency",
            "tokens", "expected_tokens", "tokens_per_s", "proxy_cpu_us_per_token"}  # scripts read these
SHORT_KEYS = {"stream", "requests", "failures", "requests_per_s", "latency_ms", "proxy_cpu_us_per_request",
              "proxy_cores", "manager_cores", "instance_cores", "client_cores", "client_parallelism",
              "client_saturated", "machine_busy_cores"}


def bench_proxy(*args: str) -> dict:
    """`llumnixctl bench proxy ARGS --json` in this process (no seconds of imports per run)."""
    from typer.testing import CliRunner

    from llumnixctl.experiments.bench import cli as bench

    res = CliRunner().invoke(bench.app, ["proxy", *args, "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_bench_proxy_json_keeps_its_keys_and_adds_the_short_rate():
    d = bench_proxy("--instances", "2", "--requests", "3", "--streams", "4", "--tokens", "4", "--short-seconds",
                    "0.5", "--short-connections", "4", "--short-client", "python")
    assert OLD_KEYS <= set(d), OLD_KEYS - set(d)
    assert d["tokens"] == d["expected_tokens"] == 16 and set(d["direct_ttft_ms"]) == {"p50", "p99"}
    short = d["short_requests"]
    assert (short["client"], short["connections"], short["max_tokens"]) == ("python", 4, 1)
    for kind in ("stream", "plain"):
        assert SHORT_KEYS <= set(short[kind]), SHORT_KEYS - set(short[kind])
        assert short[kind]["requests"] > 0 and short[kind]["failures"] == 0
        assert short[kind]["stream"] is (kind == "stream") and short[kind]["client_parallelism"] == 2
    assert d["short_requests_per_s"] == short["stream"]["requests_per_s"]
    assert d["burst"] is None


def test_bench_proxy_burst_over_two_proxies_counts_every_request():
    d = bench_proxy("--instances", "2", "--requests", "0", "--streams", "0", "--short-seconds", "0", "--burst", "6",
                    "--proxies", "2", "--burst-tokens", "2", "--set", "sim.time_scale=0.1")
    assert OLD_KEYS <= set(d) and d["tokens_per_s"] is d["short_requests"] is None  # skipped: null, not absent
    b = d["burst"]
    assert (b["proxies"], b["requests"], b["completed"], b["failures"]) == (2, 6, 6, 0)
    assert sum(b["received_per_instance"].values()) == 6 and set(b["received_per_instance"]) == {"i0", "i1"}
    assert b["ttft_ms"]["p50"] <= b["ttft_ms"]["p99"] <= b["ttft_ms"]["max"]
    assert d["settings"] == ["sim.time_scale=0.1"] and b["time_scale"] == 0.1
    assert b["over_batch"] == sum(max(0, n - b["max_num_seqs"]) for n in b["received_per_instance"].values())


def test_bench_proxy_falls_back_to_its_own_client_without_wrk(monkeypatch):
    from llumnixctl.experiments.bench import cli as bench

    monkeypatch.setattr(bench.shutil, "which", lambda name: None)
    assert bench.pick_client("auto") == "python"
    with pytest.raises(ValueError, match="wrk is not installed"):
        bench.pick_client("wrk")
