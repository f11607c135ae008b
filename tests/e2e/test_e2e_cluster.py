"""Cluster behaviour with real daemons: dispatch, failure detection, hostile input, llumnixctl."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import threading
import time

import httpx
import msgspec
import psutil
import pytest
import zmq

from daemons import wire
from tests.conftest import ctl, ctl_json
from tests.streams import Stream, proxy_metric, wait_for

pytestmark = pytest.mark.e2e


def _complete(url: str, max_tokens: int, timeout: float = 60) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=timeout,
                      json={"model": "llumnix-sim", "prompt": "spread", "max_tokens": max_tokens, "ignore_eos": True})


def test_status_json_contract(cluster):
    st = ctl_json("status", "--run-dir", str(cluster.run_dir))
    assert [i["id"] for i in st["instances"]] == ["i0", "i1"]
    for inst in st["instances"]:
        for key in ("id", "host", "pid", "state", "blocks_total", "blocks_used", "running", "waiting", "freeness"):
            assert key in inst
        assert inst["state"] == "alive" and inst["blocks_total"] == 2048
        assert inst["pid"] == cluster.proc(f"instance-{inst['id']}").pid
        assert inst["freeness"] == pytest.approx(2048)  # idle: (M - 0) / max(1, 0 requests)
    assert st["totals"]["alive"] == 2 and st["totals"]["blocks_total"] == 4096
    human = ctl("status", "--run-dir", str(cluster.run_dir))
    assert human.returncode == 0 and "i0" in human.stdout and "FREENESS" in human.stdout
    via_manager = ctl_json("status", "--manager", cluster.manager)
    assert [i["id"] for i in via_manager["instances"]] == ["i0", "i1"]


def test_requests_json_contract(cluster):
    res = ctl_json("requests", "--run-dir", str(cluster.run_dir))
    assert res["requests"] == [] and res["unreachable"] == []


def test_unreachable_manager_is_one_line_and_nonzero(tmp_path):
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    address = f"tcp://127.0.0.1:{port.getsockname()[1]}"
    port.close()
    for cmd in ("status", "requests"):
        res = ctl(cmd, "--manager", address, "--timeout", "0.5")
        assert res.returncode == 1
        assert "did not answer" in res.stderr and address in res.stderr
        assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) <= 2
    res = ctl("down", "--run-dir", str(tmp_path))
    assert res.returncode == 1 and "no local cluster" in res.stderr


def test_dispatch_spreads_load(start_cluster):
    # 3 instances x 4 batch slots, 12 long requests at once: each instance must get 4 and none may queue.
    c = start_cluster(instances=3, sets=["sim.max_num_seqs=4", "sim.time_scale=0.5"])
    admin = c.admin()
    snapshots, done = [], threading.Event()

    def watch():
        while not done.is_set():
            snapshots.append(admin.status())
            time.sleep(0.03)

    async def burst():
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": "llumnix-sim", "prompt": "spread", "max_tokens": 150, "ignore_eos": True}
            return await asyncio.gather(*(client.post(c.url + "/v1/completions", json=body) for _ in range(12)))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        results = asyncio.run(burst())
    finally:
        done.set()
        watcher.join(10)
    assert [r.status_code for r in results] == [200] * 12
    final = {v.instance_id: v.load for v in admin.status().instances}
    assert sorted(ld.requests_received for ld in final.values()) == [4, 4, 4]
    assert any(sum(v.load.running for v in s.instances) == 12 for s in snapshots), "never all 12 at once"
    for s in snapshots:
        # A request that just arrived waits until the next step boundary; what must never happen is a
        # request queued behind a full batch while another instance still has a free slot.
        loads = [v.load for v in s.instances]
        if any(ld.waiting and ld.running >= ld.batch_size for ld in loads):
            assert all(ld.running + ld.waiting >= ld.batch_size for ld in loads), \
                f"an instance queued while another had room: {loads}"


def test_killed_instance_is_marked_dead_and_avoided(start_cluster):
    c = start_cluster(instances=2)
    victim = c.proc("instance-i1")
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.monotonic()
    heartbeat = 0.2
    while True:
        states = {v.instance_id: v.state for v in c.admin().status().instances}
        if states["i1"] == "dead":
            break
        assert time.monotonic() - killed < 3 * heartbeat + 0.5, "not marked dead within 3 heartbeats"
        time.sleep(0.02)
    assert states["i0"] == "alive"
    for _ in range(10):
        assert _complete(c.url, 3).status_code == 200
    st = c.status()
    by_id = {i["id"]: i for i in st["instances"]}
    assert by_id["i1"]["state"] == "dead" and st["totals"]["alive"] == 1
    assert "i1" in ctl("status", "--run-dir", str(c.run_dir)).stdout


def test_streams_on_a_killed_instance_fail_over_and_complete_exactly(start_cluster):
    """kill -9 of an instance mid-stream: every stream on it continues on the other instance by re-prefill.
    The client sees no error, every index once and in order (the sim's tokens are a function of the request
    id and index, so any mistake shows), and usage as if nothing happened; no blocks are left behind."""
    # rr: no migrations; 20 ms steps: the 400-token streams run ~8 s, so the kill lands mid-stream
    c = start_cluster(instances=2, sets=["instance.min_step_s=0.02", "manager.dispatch_policy=rr"])
    streams = [Stream(c.url, 400, ignore_eos=True) for _ in range(6)]
    for s in streams:
        s.wait_tokens(5)

    def placed() -> dict[str, str]:
        client = c.admin()  # in-process: the CLI's start-up costs seconds on a loaded machine
        try:
            got = {r.request_id: r.instance_id for r in client.requests().requests}
        finally:
            client.close()
        return got if all(s.rid in got for s in streams) else {}

    where = wait_for(placed, 20, "requests --json did not show every stream")
    victim = where[streams[0].rid]
    survivor = "i1" if victim == "i0" else "i0"
    os.kill(c.proc(f"instance-{victim}").pid, signal.SIGKILL)
    for s in streams:
        s.check_sim(400, prompt_tokens=1)
    assert proxy_metric(c.url, "llumnix_proxy_failovers_total") >= sum(1 for i in where.values() if i == victim), c.logs()
    wait_for(lambda: next(i for i in c.status()["instances"] if i["id"] == survivor)["blocks_used"] == 0, 10,
             "blocks left on the surviving instance")


def _garbage_everywhere(addresses: dict[str, int], rounds: int = 30) -> None:
    """Garbage to each address, by raw TCP and by ZeroMQ sockets of both kinds; ``addresses`` names the kind
    (DEALER or PUSH) that fits each address's socket."""
    rnd = random.Random(7)
    ctx = zmq.Context.instance()
    for address, fits in addresses.items():
        host, port = address.removeprefix("tcp://").split(":")
        for _ in range(5):  # not even ZeroMQ: raw TCP bytes
            with socket.create_connection((host, int(port)), timeout=2) as s:
                s.sendall(rnd.randbytes(rnd.randint(1, 300)))
        # The manager's and instances' sockets are ROUTERs, the proxy's token path a PULL: of DEALER and PUSH,
        # one kind fits each, and the other fails the ZMTP handshake (incompatible socket types). After that
        # libzmq drops the pipe for good and never reconnects, so a later send would block forever: a bounded
        # send stops that socket's round instead (the refused handshake is itself the garbage). The kind that
        # fits must send everything.
        complete = set()
        for kind in (zmq.DEALER, zmq.PUSH):
            sock = ctx.socket(kind)
            sock.setsockopt(zmq.LINGER, 500)
            sock.setsockopt(zmq.SNDTIMEO, 2000)
            sock.connect(address)
            frames_list = [[rnd.randbytes(rnd.randint(0, 64)) for _ in range(rnd.randint(1, 3))] for _ in range(rounds)]
            # well-formed but wrong for this socket, and malformed msgpack of the right shape
            frames_list += [
                [wire.encode(wire.TokenBatch("x", [wire.TokenOut("nope", 0, 1)]))],
                [wire.encode(wire.Submit("r", [], wire.SamplingParams(), "tcp://127.0.0.1:1"))],
                [msgspec.msgpack.encode([40, "r", "not a list"])],
                [wire.encode(wire.Abort("unknown"))],
            ]
            try:
                for frames in frames_list:
                    sock.send_multipart(frames)
                complete.add(kind)
            except zmq.Again:
                pass
            finally:
                sock.close()
        assert fits in complete, f"a {zmq.SocketType(fits).name} could not send to {address} for 2 s"


def test_random_bytes_on_every_socket_leave_daemons_serving(start_cluster):
    c = start_cluster(instances=2)
    snap = c.admin().status()
    proxy_token_address = None
    for line in open(c.proc("proxy").log):
        if "token path on" in line:
            proxy_token_address = line.split("token path on ")[1].split(",")[0].strip()
    assert proxy_token_address
    addresses = {c.manager: zmq.DEALER, proxy_token_address: zmq.PUSH} | {v.request_address: zmq.DEALER
                                                                           for v in snap.instances}
    _garbage_everywhere(addresses)

    def dropped(name: str) -> bool:
        return "dropped" in open(c.proc(name).log).read()

    # Each daemon has handled garbage (and said so) before it is checked for life.
    wait_for(lambda: all(dropped(n) for n in ("manager", "instance-i0", "instance-i1"))
             and proxy_metric(c.url, "llumnix_proxy_malformed_frames_total") >= 1, 30,
             "a daemon did not report dropping garbage")
    for p in c.state.procs:
        assert p.process() is not None, f"{p.name} died:\n{c.logs()}"
    r = _complete(c.url, 5)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    st = c.status()
    assert st["totals"]["alive"] == 2
    assert "dropped" in open(c.proc("manager").log).read()


def test_up_refuses_a_second_cluster_and_down_stops_exactly_its_processes(tmp_path):
    run_dir = tmp_path / "run"
    res = ctl("up", "--instances", "1", "--port", "0", "--run-dir", str(run_dir), "--set", "manager.heartbeat_interval_s=0.2")
    assert res.returncode == 0, res.stderr
    try:
        assert "/v1" in res.stdout
        again = ctl("up", "--instances", "1", "--port", "0", "--run-dir", str(run_dir))
        assert again.returncode == 1 and "already running" in again.stderr
        import json

        state = json.loads((run_dir / "cluster.json").read_text())
        pids = [p["pid"] for p in state["procs"]]
        assert len(pids) == 3 and all(psutil.pid_exists(p) for p in pids)
        bystander = psutil.Popen(["sleep", "30"])
        down = ctl_json("down", "--run-dir", str(run_dir))
        assert sorted(p["pid"] for p in down["stopped"]) == sorted(pids)
        for pid in pids:
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert bystander.is_running()
        bystander.kill()
        bystander.wait()
        assert not (run_dir / "cluster.json").exists()
    finally:
        ctl("down", "--run-dir", str(run_dir))


def test_up_with_bad_setting_fails_fast(tmp_path):
    res = ctl("up", "--run-dir", str(tmp_path), "--set", "sim.num_blocks=none")
    assert res.returncode == 2 and "sim.num_blocks must be int" in res.stderr


@pytest.mark.parametrize("name", ["proxy", "instance-i0", "manager"])
def test_sigterm_exits_cleanly(no_fork_server, start_cluster, name):
    c = start_cluster(instances=1)
    proc = c.proc(name).process()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0
    assert "Traceback" not in open(c.proc(name).log).read()


@pytest.mark.parametrize("argv", [
    lambda port: ["daemons.proxy.app", "--port", str(port)],
    lambda port: ["daemons.manager", "--address", f"tcp://127.0.0.1:{port}", "--metrics-port", "-1"],
])
def test_address_in_use_is_one_line_and_exit_1(argv):
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", *argv(port)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert "cannot start" in res.stderr and str(port) in res.stderr
    assert "Traceback" not in res.stderr


def test_proxy_dispatches_by_the_clusters_policy_while_the_manager_is_away(start_cluster):
    c = start_cluster(instances=2, sets=["manager.dispatch_policy=flood", "proxy.dispatch_timeout_s=0.2"])
    # The proxy has a snapshot (which names the policy): the manager's count of proxies, from that snapshot.
    wait_for(lambda: proxy_metric(c.url, "llumnix_proxy_peers") >= 1, 30, "the proxy has no snapshot")
    manager = c.proc("manager").process()
    manager.send_signal(signal.SIGSTOP)
    try:
        results = [_complete(c.url, 3, timeout=30) for _ in range(6)]
    finally:
        manager.send_signal(signal.SIGCONT)
    assert [r.status_code for r in results] == [200] * 6
    assert all(r.json()["usage"]["completion_tokens"] == 3 for r in results)
    assert proxy_metric(c.url, "llumnix_proxy_local_dispatches_total") == 6
    received = {v.instance_id: v.load.requests_received for v in c.admin().status().instances}
    assert received == {"i0": 6, "i1": 0}  # flood, as the manager would have: not the proxy's own preference
