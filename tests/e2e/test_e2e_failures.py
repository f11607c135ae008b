"""Failures with real daemons on the sim engine: instances that die or hang (real processes, real
connections), deadlines, clients and proxies that go away. Migrations whose last stage goes wrong run in
process on virtual time (tests/unit/test_protocol_virtual.py), and so do, deterministically, a hung step, a
deadline, a killed proxy, a proxy restarted at the same address and a manager restarted under load
(tests/unit/test_lifecycle_virtual.py); here they run as processes, with real exits, signals and HTTP.

Each test checks what the client got (every token exactly once and in order: the sim's tokens are a pure
function of (request id, index), so a duplicate, a gap or a token from the wrong copy shows) and that no
KV block is left behind once the cluster is idle. Faults are injected with ``$LLUMNIX_FAULTS``
(daemons/watchdog.py), which every daemon a cluster starts inherits, scoped by instance id.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest

from llumnixctl.main import status_json
from tests.conftest import ctl_json
from tests.streams import Stream, metric, proxy_metric, samples, wait_for

pytestmark = pytest.mark.e2e

PROMPT = list(range(100, 180))  # 80 prompt tokens (5 blocks of 16): usage must say 80 whatever re-prefilled
PACED = ["instance.min_step_s=0.02", "manager.dispatch_policy=flood"]  # flood: every request on i0


# ---------------------------------------------------------------- helpers (in-process: the CLI costs CPU)


def instances(c) -> dict[str, dict]:
    """What `llumnixctl status --json` says of each instance, asked in-process."""
    client = c.admin()
    try:
        return {r["id"]: r for r in status_json(client.status(), c.manager)["instances"]}
    finally:
        client.close()


def placements(c, rid: str) -> list[str]:
    """The instances that hold a copy of ``rid`` (as `llumnixctl requests` lists them)."""
    client = c.admin()
    try:
        return sorted(r.instance_id for r in client.requests().requests if r.request_id == rid)
    finally:
        client.close()


def _idle(row: dict) -> bool:
    return row["blocks_used"] == 0 and row["running"] == 0 and row["waiting"] == 0 \
        and row["migrating_out"] == 0 and row["migrating_in"] == 0


def settle(c, ids: list[str], timeout: float = 10) -> None:
    """Wait until every instance of ``ids`` is idle and holds no block; then confirm with the CLI itself."""
    def check(rows):
        return all(_idle(rows[i]) for i in ids)

    last = {}

    def idle_now():
        last.update(instances(c))
        return check(last)

    wait_for(idle_now, timeout, f"blocks left behind: {[last.get(i) for i in ids]}", every=0.1)
    rows = {r["id"]: r for r in c.status()["instances"]}  # `llumnixctl status --json`
    assert check(rows), rows


def instance_metrics(c, iid: str) -> dict[str, float]:
    address = instances(c)[iid]["metrics_address"]
    return samples(httpx.get(f"http://{address}/metrics", timeout=10).text)


def log_of(c, name: str) -> str:
    return Path(c.proc(name).log).read_text(errors="replace")


# ---------------------------------------------------------------- migration: the last stage goes wrong


# A commit later than the source waits, a lost commit acknowledgement and a destination killed right after the
# commit run in process on virtual time, where each race goes one way every time (tests/unit/test_protocol_virtual.py).


# ---------------------------------------------------------------- an instance that hangs


def test_hung_step_fails_over_and_the_instance_exits_with_status_3(no_fork_server, start_cluster, monkeypatch):
    monkeypatch.setenv("LLUMNIX_FAULTS", "i0:hang_step_after=30")
    c = start_cluster(instances=2, sets=PACED + ["instance.step_timeout_s=1", "instance.hung_exit_s=1"])
    victim = psutil.Process(c.proc("instance-i0").pid)  # our child (localcluster spawned it): wait() gets its status
    s = Stream(c.url, 150, prompt=PROMPT, ignore_eos=True)
    # No subprocess may start before this wait: subprocess's own clean-up could reap the child first.
    assert victim.wait(timeout=30) == 3
    s.check_sim(150, prompt_tokens=len(PROMPT))
    assert proxy_metric(c.url, "llumnix_proxy_failovers_total") >= 1
    log = log_of(c, "instance-i0")
    assert "fault injection: this engine step never ends" in log and "exiting with status 3" in log, log[-2000:]
    assert "failed over to us: continues at token" in log_of(c, "instance-i1")  # mid-stream, not a retry
    settle(c, ["i1"])


# ---------------------------------------------------------------- deadline, client gone, proxy gone


def test_request_deadline_ends_with_504_and_aborts(start_cluster):
    c = start_cluster(instances=2, sets=["proxy.request_timeout_s=1", "instance.min_step_s=0.05",
                                         "manager.dispatch_policy=rr"])
    s = Stream(c.url, 500, prompt=PROMPT, ignore_eos=True)  # 500 steps of 50 ms: 25 s without the deadline
    t0 = time.monotonic()
    resp = httpx.post(c.url + "/v1/completions", timeout=30,
                      json={"model": "llumnix-sim", "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True})
    assert resp.status_code == 504, resp.text
    assert time.monotonic() - t0 < 6
    err = resp.json()["error"]
    assert "request_timeout_s" in err["message"] and err["type"] == "server_error", err
    s.result(30)
    assert isinstance(s.error, dict) and "request_timeout_s" in s.error["message"], s.error  # in-band error
    assert 0 < len(s.ids) < 500
    assert proxy_metric(c.url, "llumnix_proxy_request_timeouts_total") == 2
    settle(c, ["i0", "i1"], timeout=5)  # aborted on the instances, not decoded to the end


def test_client_disconnect_non_streaming_aborts_the_request(start_cluster):
    c = start_cluster(instances=2, sets=PACED)
    body = {"model": "llumnix-sim", "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True}  # 40 s of decode
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 0.5 s and closes its connection
        httpx.post(c.url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
    assert time.monotonic() - t0 < 5
    settle(c, ["i0", "i1"], timeout=5)
    assert ctl_json("requests", "--run-dir", str(c.run_dir))["requests"] == []
    m = instance_metrics(c, "i0")
    assert metric(m, "llumnix_instance_requests_total", instance_id="i0") == 1
    assert metric(m, "llumnix_instance_requests_finished_total", finished_reason="abort") == 1, m


def test_killed_proxy_orphans_are_aborted(start_cluster):
    c = start_cluster(instances=2, sets=["instance.min_step_s=0.02", "manager.dispatch_policy=rr",
                                         "instance.orphan_timeout_s=1.5"])
    streams = [Stream(c.url, 1000, prompt=PROMPT, ignore_eos=True) for _ in range(2)]  # 20 s each
    for s in streams:
        s.wait_tokens(5)
    assert sorted(p for s in streams for p in placements(c, s.rid)) == ["i0", "i1"]  # rr: one each
    os.kill(c.proc("proxy").pid, signal.SIGKILL)
    killed = time.monotonic()
    settle(c, ["i0", "i1"], timeout=8)
    assert time.monotonic() - killed < 8
    for s in streams:
        s.result(30)
        assert s.error is not None and len(s.ids) < 1000  # the client saw its connection drop
    orphaned = sum(metric(instance_metrics(c, i), "llumnix_instance_requests_orphaned_total", 0) for i in ("i0", "i1"))
    assert orphaned == 2
    assert "is gone" in log_of(c, "instance-i0") and "is gone" in log_of(c, "instance-i1")


def test_manager_killed_and_restarted_under_load(start_cluster):
    """Without its manager the cluster keeps serving: streams go on, new requests are dispatched from the
    proxy's own view; a restarted manager gets every instance back without a storm of stale reports."""
    c = start_cluster(2, ["instance.min_step_s=0.02"])
    running = [Stream(c.url, 150, prompt=PROMPT, ignore_eos=True) for _ in range(4)]
    for s in running:
        s.wait_tokens(3)
    manager = c.proc("manager")
    os.kill(manager.pid, signal.SIGKILL)
    wait_for(lambda: manager.process() is None, 10, "the manager did not die")
    # The proxy notices the manager is away (its /health says so) and dispatches from its own view.
    wait_for(lambda: httpx.get(c.url + "/health", timeout=10).json()["manager"] == "unreachable", 30,
             "the proxy did not notice that the manager is away")
    during = [Stream(c.url, 40, prompt=PROMPT, ignore_eos=True) for _ in range(4)]
    for s in during:
        s.check_sim(40, prompt_tokens=80)
    c.spawn("manager", manager.argv)
    wait_for(lambda: len([i for i in instances(c).values() if i["state"] == "alive"]) == 2, 15,
             "the restarted manager did not get both instances back")
    for s in running:
        s.check_sim(150, prompt_tokens=80)
    after = Stream(c.url, 20, prompt=PROMPT, ignore_eos=True)
    after.check_sim(20, prompt_tokens=80)
    # Each instance was asked to register again a few times at most (one per heartbeat), not once per report.
    for i in ("i0", "i1"):
        asked = Path(c.proc(f"instance-{i}").log).read_text().count("manager asks us to register")
        assert 1 <= asked <= 5, (i, asked)
    settle(c, ["i0", "i1"])


def test_restarted_proxy_gets_the_old_proxy_streams_aborted(start_cluster):
    """A proxy restarted at the same token address: the instances' tokens for requests it does not know are
    answered with aborts, so they do not decode for nobody."""
    c = start_cluster(2, ["instance.min_step_s=0.02", "instance.orphan_timeout_s=60"])
    proxy = c.proc("proxy")
    token_address = next(line for line in Path(proxy.log).read_text().splitlines() if "token path on" in line)
    token_address = token_address.split("token path on ")[1].split(",")[0]
    streams = [Stream(c.url, 2000, prompt=PROMPT, ignore_eos=True) for _ in range(2)]
    for s in streams:
        s.wait_tokens(3)
    os.kill(proxy.pid, signal.SIGKILL)
    wait_for(lambda: proxy.process() is None, 10)
    argv = [*proxy.argv, "--set", f"proxy.token_address={token_address}"]
    c.spawn("proxy", argv)
    wait_for(lambda: _health(c.url), 30, "the restarted proxy did not come up")
    settle(c, ["i0", "i1"], timeout=15)


def _health(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
