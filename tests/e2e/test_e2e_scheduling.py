"""Scheduling with real daemons on the sim engine, for what only separate processes show: the drain, remove
and undrain verbs of the CLI with their JSON and metrics, a removed instance's process exiting by itself, and
`down` while scaling would replace instances. Real ZeroMQ, Gloo and HTTP; every stream is checked. Steps are
paced (instance.min_step_s) so that timing does not hang on how busy the machine is.

Load balancing, de-fragmentation and priorities run in process on virtual time (tests/unit/test_scheduling_virtual.py);
so do auto-scaling, a failing launch and an instance that drains on SIGTERM (tests/unit/test_lifecycle_virtual.py)
and a restarted manager learning drains and cordons again (tests/unit/test_manager_core.py). A launch through the
local cluster's launcher is tests/e2e/test_hygiene.py's, SIGTERM's clean exit tests/e2e/test_e2e_cluster.py's."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from llumnixctl.main import status_json
from tests.conftest import ctl, ctl_json
from tests.streams import metric, samples, wait_for
from tests.load import Load, Spec, failures

pytestmark = pytest.mark.e2e

PACED = ["instance.min_step_s=0.02", "scheduling.migration_interval_s=0.2"]


def status(c) -> dict:
    """``llumnixctl status --json`` in-process: the CLI's start-up (~0.5 s) would blur the timings here."""
    client = c.admin()
    try:
        return status_json(client.status(), c.manager)
    finally:
        client.close()


def instances(c) -> dict[str, dict]:
    return {i["id"]: i for i in status(c)["instances"]}


def view_showing(c, ok, message: str, timeout: float = 5.0) -> dict[str, dict]:
    """The view once ``ok(view)`` holds. It lags the streams' tokens by a load report (a step's tokens go out
    before its report), so a check made the moment a client saw a token reads it through this."""
    def got() -> dict[str, dict] | None:
        v = instances(c)
        return v if ok(v) else None

    return wait_for(got, timeout, message)


def _metrics_line(text: str, name: str) -> float:
    return metric(samples(text), name)


def _metrics(c, daemon: str) -> dict[str, float]:
    """A daemon's Prometheus samples, by name{labels}; its address is in its start-up log line."""
    line = next(x for x in open(c.proc(daemon).log) if "metrics 127.0.0.1:" in x)
    address = line.split("metrics ")[1].split(")")[0].split(",")[0].strip()
    samples = {}
    for x in httpx.get(f"http://{address}/metrics").text.splitlines():
        if x and not x.startswith("#"):
            name, value = x.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def _drain_load(c, tokens: int = 150) -> Load:
    # 3 instances of 6 slots: 24 long streams fill them and queue some; those queued on the drained
    # instance are given back and dispatched again, the running ones migrate.
    load = Load(c.url, [Spec(0.02 * i, tokens, prompt_tokens=48) for i in range(24)])
    wait_for(lambda: load.started() >= 18, 30, message="the streams did not start")
    return load


def test_drain_moves_everything_out_with_no_error(start_cluster):
    c = start_cluster(3, PACED + ["sim.max_num_seqs=6"])
    # 500 tokens (10 s at the paced step): the first streams still run when the drain CLI has started, so
    # those queued behind them on i0 are still queued (with 150, on a slow machine they had all started:
    # nothing was given back)
    load = _drain_load(c, 500)
    view_showing(c, lambda v: v["i0"]["running"] == 6, "the view did not show i0's 6 slots full")
    res = ctl("drain", "i0", "--wait", "--timeout", "60", "--json", "--run-dir", str(c.run_dir), timeout=90)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["drained"] is True and out["instance"]["draining"] is True and out["instance"]["drain_reason"] == "operator"
    i0 = instances(c)["i0"]
    assert i0["running"] == i0["waiting"] == i0["blocks_used"] == 0 and i0["freeness"] is None
    assert i0["virtual_usage"] is None  # infinite: JSON has no infinity
    results = load.wait()
    assert not failures(results), failures(results)
    assert status(c)["totals"]["ordered_migrations"].get("drain/committed", 0) >= 1
    given_back = _metrics_line(httpx.get(c.url + "/metrics").text, "llumnix_proxy_given_back_total")
    assert given_back >= 1  # the ones queued there were dispatched again
    refused = ctl("migrate", "--from", "i1", "--to", "i0", "--run-dir", str(c.run_dir))
    assert refused.returncode == 1 and "destination i0 is draining" in refused.stderr and "undrain i0" in refused.stderr
    manager_metrics = _metrics(c, "manager")
    assert metric(manager_metrics, "llumnix_instance_draining", instance_id="i0", model_name="llumnix-sim") == 1.0
    assert metric(manager_metrics, "llumnix_instance_draining", instance_id="i1") == 0.0
    assert metric(manager_metrics, "llumnix_instance_virtual_usage_blocks", instance_id="i0") == float("inf")
    assert metric(manager_metrics, "llumnix_instance_freeness", instance_id="i0") == float("-inf")
    assert metric(manager_metrics, "llumnix_manager_migrations_total", outcome="committed", reason="drain") >= 1
    assert metric(manager_metrics, "llumnix_cluster_freeness") is not None
    # No new request goes to a drained instance; undrain takes it back into service.
    def received() -> int:
        client = c.admin()
        try:
            return next(v.load.requests_received for v in client.status().instances if v.instance_id == "i0")
        finally:
            client.close()

    drained_count = received()
    assert not failures(Load(c.url, [Spec(0, 5) for _ in range(6)]).wait())
    assert received() == drained_count
    assert ctl_json("undrain", "i0", "--run-dir", str(c.run_dir))["instance"]["draining"] is False
    assert not failures(Load(c.url, [Spec(0, 5) for _ in range(12)]).wait())
    assert received() > drained_count


# Draining the only instance until another joins, and a cordon, run in process on virtual time
# (tests/unit/test_protocol_virtual.py), where the queue is what the scenario makes it every time.


def test_remove_drains_then_stops_the_instance(no_fork_server, start_cluster):
    c = start_cluster(3, PACED + ["sim.max_num_seqs=6"])
    # 500 tokens, and i1's slots seen full before the remove: with 150 (3 s at the paced step), on a loaded
    # machine i1's streams had all ended before the CLI's drain began, and nothing migrated (CI, once)
    load = _drain_load(c, 500)
    view_showing(c, lambda v: v["i1"]["running"] == 6, "the view did not show i1's 6 slots full")
    proc = c.proc("instance-i1").process()
    res = ctl("remove", "i1", "--timeout", "60", "--json", "--run-dir", str(c.run_dir), timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["id"] == "i1" and out["removed"] is True and out["migrated"] >= 1
    assert proc.wait(15) == 0  # it stopped by itself, cleanly
    results = load.wait()
    assert not failures(results), failures(results)
    wait_for(lambda: "i1" not in instances(c), 10, message="the removed instance stayed in the view")
    bad = ctl("remove", "nope", "--run-dir", str(c.run_dir))
    assert bad.returncode == 1 and "unknown instance 'nope'" in bad.stderr


def test_down_leaves_no_instance_behind_when_scaling_would_replace_them(start_cluster, tmp_path):
    import psutil

    # Scaling goes on once both instances serve: on a loaded host a manager that scales from its start would
    # launch (and time out, and launch again) while the first instances are still starting.
    c = start_cluster(2, ["scaling.policy=off", "scaling.min_instances=2", "scaling.launch_timeout_s=1",
                          "scaling.cooldown_s=0"])
    assert ctl_json("policy", "--scaling", "llumnix", "--run-dir", str(c.run_dir))["scaling_policy"] == "llumnix"
    # Past launch_timeout_s since the manager started: instances that leave now look like a cluster below its
    # minimum, which the scaler would replace.
    wait_for(lambda: status(c)["manager"]["uptime_s"] > 1.0, 30, "the manager's uptime did not pass 1 s")
    res = ctl("down", "--run-dir", str(c.run_dir), "--json", timeout=180)  # each group of processes may take its stop timeout
    assert res.returncode == 0, res.stderr

    def ours() -> list[str]:
        found = []
        for p in psutil.process_iter(["cmdline"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if str(c.run_dir) in cmd:
                found.append(f"{p.pid}: {cmd[:200]}")
        return found

    # A launch the manager started before it was stopped is a process by now (the manager forked it); it
    # must end without leaving an instance: every process of the run directory goes, and stays gone.
    deadline = time.monotonic() + 30
    while left := ours():
        assert time.monotonic() < deadline, f"processes of the stopped cluster remain: {left}"
        time.sleep(0.1)
    assert not (c.run_dir / "cluster.json").exists()
