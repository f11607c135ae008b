"""``llumnixctl simulate``: the virtual-time cluster runs the daemons' own code (not a copy), keeps the
engines' invariants, and is deterministic and fast."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections import Counter

import pytest

from conftest import ctl
from daemons import policy
from daemons.config import load_config
from daemons.engine.sim import SimEngine
from daemons.migration import Migrator
from daemons.proxy.cluster.view import DispatchView
from llumnixctl.experiments.traces import gen as trace
from llumnixctl.experiments.sim.simulate import Network, simulate

# Small instances under KV pressure: preemptions happen, and pairing has sources and destinations.
PRESSURE = ["sim.num_blocks=300", "sim.max_num_seqs=32", "instance.log_level=warning"]


def _trace(n=600, rate=24.0, seed=3):
    return trace.generate(n, rate=rate, arrival="gamma", cv=2.0, prompt=(16, 768), output=(16, 768), alpha=1.0,
                          seed=seed)


def _run(policy_name="llumnix", n=600, extra=(), net=None):
    cfg = load_config(None, PRESSURE + [f"manager.dispatch_policy={policy_name}", *extra])
    reqs = _trace(n)
    return reqs, simulate(cfg, 4, reqs, net)


@functools.lru_cache(maxsize=None)
def _plain(policy_name: str = "llumnix"):
    """``_run(policy_name)``, once per module: the tests that only read its figures share it."""
    return _run(policy_name)


def test_the_simulator_calls_the_daemons_policy_and_engine_code(monkeypatch):
    calls = {"dispatch_batch": 0, "pair": 0, "select_migrants": 0, "step": 0}

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    for name in ("dispatch_batch", "pair", "select_migrants"):
        monkeypatch.setattr(policy, name, spy(name, getattr(policy, name)))
    monkeypatch.setattr(SimEngine, "step", spy("step", SimEngine.step))
    monkeypatch.setattr(Migrator, "migrate_out", spy("migrate_out", Migrator.migrate_out))
    calls["migrate_out"] = 0
    reqs, res = _run(extra=["proxy.dispatch=manager"])
    assert res["completed"] == len(reqs)
    assert all(calls[k] > 0 for k in calls), calls
    assert calls["dispatch_batch"] >= len(reqs)  # every dispatch through the manager's policy call
    assert res["migrations"].get("balance/committed", 0) > 0, res["migrations"]
    # every migration is the daemons' own Migrator's
    assert calls["migrate_out"] == sum(v for k, v in res["migrations"].items() if k.startswith("balance/")
                                       and not k.endswith("/ordered"))


def test_the_default_edge_dispatch_is_the_proxys_own_view(monkeypatch):
    chosen = Counter()
    asked = Counter()
    inner_choose, inner_batch = DispatchView.choose, policy.dispatch_batch

    def choose(self, *a, **kw):
        iid = inner_choose(self, *a, **kw)
        chosen[iid] += 1
        return iid

    def dispatch_batch(*a, **kw):
        asked["batch"] += 1
        return inner_batch(*a, **kw)

    monkeypatch.setattr(DispatchView, "choose", choose)
    monkeypatch.setattr(policy, "dispatch_batch", dispatch_batch)
    reqs, res = _run()  # proxy.dispatch = local: the default
    assert res["completed"] == len(reqs) and res["failed"] == 0 and res["leaked_blocks"] == 0
    assert sum(chosen.values()) >= 0.95 * len(reqs)  # all but those before the proxy's first snapshot
    assert asked["batch"] <= 0.05 * len(reqs)
    assert len([i for i in chosen if i is not None]) == 4  # spread over the cluster
    assert res["migrations"].get("balance/committed", 0) > 0, res["migrations"]


def test_every_request_finishes_with_its_length_and_nothing_leaks():
    reqs, res = _plain()
    assert res["completed"] == len(reqs) and res["failed"] == 0
    assert res["total_output_tokens"] == sum(r.output_tokens for r in reqs)
    assert res["total_input_tokens"] == sum(r.prompt_tokens for r in reqs)
    assert res["leaked_blocks"] == 0
    assert res["preemptions"] > 0  # the pressure is real
    assert res["mean_ttft_ms"] > 0 and res["p99_ttft_ms"] >= res["median_ttft_ms"]
    assert res["instance_seconds"] == pytest.approx(4 * res["duration"])


def test_migration_lowers_preemptions_on_the_same_trace():
    _, llumnix = _plain("llumnix")
    _, infaas = _run("infaas++")
    assert infaas["migrations"] == {}
    assert llumnix["preemptions"] < infaas["preemptions"], (llumnix["preemptions"], infaas["preemptions"])


def test_a_slow_link_makes_migrations_cost_more_downtime():
    # The downtime is the daemons' migrator's: the last stage's copy and the commit at the destination's next
    # step boundary. With LLaMA-7B's KV per token (512 KiB) the copy of its last block is what the link decides.
    _, fast = _run(n=300, net=Network(kv_gbps=100.0, kv_bytes_per_token=512 * 1024))
    _, slow = _run(n=300, net=Network(kv_gbps=1.0, kv_bytes_per_token=512 * 1024))
    assert fast["migration_downtime_ms"] < slow["migration_downtime_ms"]


def test_the_same_inputs_give_the_same_figures():
    _, a = _run(n=300)
    _, b = _run(n=300)
    a.pop("wall_s"), b.pop("wall_s")
    assert a == b


def test_command_json():
    import typer
    from typer.testing import CliRunner

    from llumnixctl.experiments.sim import simulate as simulate_cmd

    app = typer.Typer()
    app.command()(simulate_cmd.command)
    runner = CliRunner()
    res = runner.invoke(app, ["-n", "2", "--requests", "50", "--rate", "5", "--json", "--set", "sim.num_blocks=500"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["completed"] == 50 and data["instances"] == 2
    for key in ("request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                "mean_tpot_ms", "p99_itl_ms", "p99_e2el_ms", "preemptions", "migrations", "instance_seconds"):
        assert key in data
    bad = runner.invoke(app, ["--set", "sim.nope=1"])
    assert bad.exit_code == 2 and "sim.nope" in bad.output


def test_the_cli_has_the_command():
    res = ctl("simulate", "--help")
    assert res.returncode == 0 and "virtual time" in res.stdout


def test_auto_scaling_adds_under_load_and_retires_after():
    cfg = load_config(None, PRESSURE + ["scaling.policy=llumnix", "scaling.min_instances=1", "scaling.max_instances=6",
                                        "scaling.sustain_s=3", "scaling.cooldown_s=5"])
    burst = trace.generate(500, rate=20.0, prompt=(16, 256), output=(16, 256), seed=5)
    calm = trace.generate(60, rate=1.0, prompt=(16, 64), output=(16, 64), seed=6)  # then a quiet minute
    reqs = burst + [dataclasses.replace(r, index=500 + r.index, arrival_s=burst[-1].arrival_s + r.arrival_s)
                    for r in calm]
    res = simulate(cfg, 1, reqs, Network(launch_s=10.0))
    assert res["completed"] == 560 and res["leaked_blocks"] == 0
    assert res["scaling"]["out"] >= 1 and res["scaling"]["in"] >= 1, res["scaling"]
    assert res["instances_at_end"] < 1 + res["scaling"]["out"]  # some retired again
    assert 0 < res["instance_seconds"] < (1 + res["scaling"]["out"]) * res["duration"]


def test_observers_and_fragmentation_samples():
    seen = Counter()
    cfg = load_config(None, PRESSURE)
    res = simulate(cfg, 3, _trace(200), sample_s=0.2, observers=(lambda kind, sim, data: seen.update([kind]),))
    assert seen["dispatch"] == 200 and seen["step"] > 0 and seen["sample"] == res["fragmentation"]["samples"] > 0
    assert res["fragmentation"].get("fragmented", 0) <= res["fragmentation"].get("blocked", 0)
