"""LoRA adapters on a cluster of real daemons with the sim engine (adapters as slots with a load time): dispatch by
residency (a request goes where its adapter is held while that instance is not hot; a hot holder makes another
instance load it, up to lora.max_replicas), an adapter no instance holds served after a load, and loads and unloads
of one adapter racing the requests that use it: every request answered (200, or 404 while it is not served), no
daemon down, no slot leaked."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import cli, ctl_json

pytestmark = pytest.mark.e2e

LORA = ["lora.slots=2", "lora.load_ms=20", "proxy.snapshot_interval_s=0.1", "sim.max_num_seqs=2"]


def _listed(cluster) -> dict[str, list[str]]:
    return {a["name"]: a["instances"] for a in ctl_json("lora", "list", "--run-dir", str(cluster.run_dir))["adapters"]}


def _wait(what, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (got := what()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def _load(cluster, name: str, *instances: str) -> None:
    args = [a for i in instances for a in ("--instances", i)]
    res = cli("lora", "load", name, f"/adapters/{name}", *args, "--run-dir", str(cluster.run_dir))
    assert res.returncode == 0, res.stderr
    assert _wait(lambda: name in [m["id"] for m in httpx.get(cluster.url + "/v1/models").json()["data"]])


def _complete(cluster, model: str, tokens: int = 8) -> int:
    r = httpx.post(cluster.url + "/v1/completions", timeout=60, json={
        "model": model, "prompt": [5, 6, 7, 8], "max_tokens": tokens, "ignore_eos": True})
    assert r.status_code in (200, 404), r.text
    return r.status_code


def test_requests_go_where_their_adapter_is_held(start_cluster):
    c = start_cluster(2, LORA)
    _load(c, "a", "i0")
    for _ in range(8):  # one at a time: the holder is never hot
        assert _complete(c, "a") == 200
    assert _listed(c)["a"] == ["i0"]  # nobody else had to load it


def test_a_hot_holder_makes_another_instance_load_it_within_the_replica_bound(start_cluster):
    c = start_cluster(2, LORA)
    _load(c, "a", "i0")
    with ThreadPoolExecutor(8) as pool:  # more than the holder's batch of 2: it queues, so it is hot
        assert set(pool.map(lambda _: _complete(c, "a", 200), range(8))) == {200}
    assert _wait(lambda: sorted(_listed(c)["a"]) == ["i0", "i1"]), _listed(c)


def test_the_replica_bound_keeps_the_adapter_on_its_holder(start_cluster):
    c = start_cluster(2, LORA + ["lora.max_replicas=1"])
    _load(c, "a")  # without --instances: on lora.max_replicas instances
    held = _listed(c)["a"]
    assert len(held) == 1
    with ThreadPoolExecutor(8) as pool:
        assert set(pool.map(lambda _: _complete(c, "a", 200), range(8))) == {200}
    assert _listed(c)["a"] == held


def test_loads_and_unloads_racing_requests_lose_nothing(start_cluster):
    c = start_cluster(2, LORA)
    _load(c, "b")
    stop = threading.Event()
    codes: list[int] = []

    def ask() -> None:
        while not stop.is_set():
            codes.append(_complete(c, "b", 30))

    clients = [threading.Thread(target=ask) for _ in range(4)]
    for t in clients:
        t.start()
    try:
        for _ in range(5):
            assert cli("lora", "unload", "b", "--run-dir", str(c.run_dir)).returncode == 0
            time.sleep(0.1)
            assert cli("lora", "load", "b", "/adapters/b", "--run-dir", str(c.run_dir)).returncode == 0
            time.sleep(0.1)
    finally:
        stop.set()
        for t in clients:
            t.join(60)
    assert codes and set(codes) <= {200, 404} and 200 in codes
    st = c.status()
    assert all(i["state"] == "alive" for i in st["instances"])
    # Once the requests are done, every instance holds b once at most, and every slot is open again.
    assert _wait(lambda: all(i["running"] == 0 and len(i["adapters"]) <= 2 and i["adapter_slots"] == 2
                             for i in c.status()["instances"])), c.status()["instances"]


def test_an_unknown_adapter_is_a_404_and_lora_off_refuses_loads(start_cluster):
    c = start_cluster(1, ["proxy.snapshot_interval_s=0.1", "lora.api_updates=true"])
    r = httpx.post(c.url + "/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    res = cli("lora", "load", "a", "/adapters/a", "--run-dir", str(c.run_dir))
    assert res.returncode == 1 and "adapter 'a': no live instance serves LoRA adapters" in res.stderr
    r = httpx.post(c.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/adapters/a"})
    assert r.status_code == 400 and "lora.slots is 0" in r.json()["error"]["message"]
    assert ctl_json("lora", "list", "--run-dir", str(c.run_dir)) == {"adapters": []}


def _where(cluster, rid: str) -> str:
    admin = cluster.admin()
    try:
        return next(r.instance_id for r in admin.requests().requests if r.request_id == rid)
    finally:
        admin.close()


def test_a_drain_and_a_kill_move_lora_streams_with_their_adapter_exactly(start_cluster):
    """Drain: the stream migrates to the other instance, which loads its adapter first. kill -9: it fails over
    (re-prefill) to an instance that loads the adapter. Every token once, in order, as the sim makes them."""
    import os
    import signal

    from tests.streams import Stream

    c = start_cluster(3, LORA + ["instance.min_step_s=0.02", "manager.dispatch_policy=flood"])
    _load(c, "d", "i0")
    # Long enough (400 steps of at least 20 ms) to be still running after the drain, which may take seconds on a
    # busy host (120 tokens had finished before a drain that retried once: the request was nowhere to be found).
    s = Stream(c.url, 400, prompt="x " * 20, model="d")
    s.wait_tokens(10)
    assert _where(c, s.rid) == "i0"
    res = cli("drain", "i0", "--wait", "--timeout", "60", "--run-dir", str(c.run_dir))
    assert res.returncode == 0, res.stderr
    here = _where(c, s.rid)
    assert here != "i0" and _wait(lambda: here in _listed(c)["d"])
    s.wait_tokens(60)
    os.kill(c.proc(f"instance-{here}").pid, signal.SIGKILL)
    s.check_sim(400)
    assert _wait(lambda: any(i["state"] == "alive" and "d" in i["adapters"] and i["id"] not in ("i0", here)
                             for i in c.status()["instances"])), c.status()["instances"]


def test_the_proxys_lora_routes_are_off_unless_lora_api_updates(start_cluster):
    c = start_cluster(1, LORA)
    r = httpx.post(c.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/adapters/a"})
    assert r.status_code == 404 and "lora.api_updates = false" in r.json()["error"]["message"]
    assert httpx.post(c.url + "/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 404
    _load(c, "a")  # the operator's way
    assert _complete(c, "a") == 200
