"""A cluster on several "hosts" for real: network namespaces joined by veth pairs on a bridge
(llumnixctl/lab/netns.py, addresses from 198.18.0.0/15 inside those namespaces only), CURVE keys on every
cluster socket. The manager and the proxy run on host ctl, one vLLM instance on each of i0 and i1, and
an outsider without the cluster's keys on host x.

Checked: requests are served and migrated across hosts (KV over Gloo between i0's and i1's addresses)
with exactly the greedy tokens and logprobs of an unmigrated run; the outsider is refused by the
manager, an instance and the proxy's token socket (the CURVE handshake fails, seen from its side), with
or without a key of its own, and the daemons go on unaffected.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import re
import time
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

pytest.importorskip("vllm")

from conftest import Cluster, ctl  # noqa: E402
from daemons import runtime, security, wire  # noqa: E402
from daemons.config import SecurityConfig  # noqa: E402
from llumnixctl.admin import AdminClient  # noqa: E402
from llumnixctl.lab import localcluster  # noqa: E402
from llumnixctl.lab.model import write_tiny_model  # noqa: E402
from llumnixctl.lab.netns import Lab  # noqa: E402
from tests.e2e.test_e2e_vllm_migration import BASE, PROMPT, Stream  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600),
              pytest.mark.skipif(Lab.unavailable() is not None, reason=str(Lab.unavailable()))]


class Hosts:
    def __init__(self, lab: Lab, cluster: Cluster, keys: Path):
        self.lab, self.cluster, self.keys = lab, cluster, keys

    def admin(self) -> AdminClient:
        sec = security.Security(SecurityConfig(keys_dir=str(self.keys), key="operator"), "llumnixctl")
        return AdminClient(self.cluster.manager, timeout_s=10, sec=sec)

    def on(self, host: str, fn, *args, timeout_s: float = 240):
        return self.lab.run_in(host, functools.partial(fn, *args), timeout_s=timeout_s)

    def token_address(self) -> str:
        log = Path(self.cluster.proc("proxy").log).read_text()
        return re.search(r"token path on (tcp://\S+),", log).group(1)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys")
    assert ctl("keys", "generate", str(keys)).returncode == 0
    model = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")
    run_dir = tmp_path_factory.mktemp("hosts")
    with Lab(["ctl", "i0", "i1", "x"]) as lab:
        ctl_addr = lab.address("ctl")

        def place(name: str) -> tuple[list[str], list[str]]:
            if name.startswith("instance-"):
                host = name.removeprefix("instance-")
                return lab.prefix(host), [f"instance.request_address=tcp://{lab.address(host)}:0",
                                          f"migration.kv_host={lab.address(host)}", f"instance.host={host}"]
            if name == "proxy":
                return [], [f"proxy.token_address=tcp://{ctl_addr}:0"]
            return [], []

        sets = BASE + [f"model.path={model}", f"security.keys_dir={keys}"]
        up = functools.partial(localcluster.up, run_dir, 2, "vllm", 0, None, sets, 240, place=place,
                               manager_host=ctl_addr)
        state = lab.run_in("ctl", up, timeout_s=300)  # the manager and the proxy start on host ctl
        cluster = Cluster(state, run_dir)
        try:
            yield Hosts(lab, cluster, keys)
        finally:
            lab.run_in("ctl", functools.partial(localcluster.stop, state, 20), timeout_s=120)


def _listening(pid: int, skip_port: int = 0) -> set[str]:
    """The addresses process ``pid`` listens on (TCP), read in its own network namespace (psutil reads
    the caller's)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for table, size in (("tcp", 4), ("tcp6", 16)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes and int(fields[1].split(":")[1], 16) != skip_port:  # LISTEN
                raw = bytes.fromhex(fields[1].split(":")[0])
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, size, 4))  # each 32-bit word is host order
                out.add(str(ipaddress.ip_address(words)))
    return out


def test_instances_listen_on_their_own_hosts(hosts):
    views = {v.instance_id: v for v in hosts.on("ctl", lambda: hosts.admin().status()).instances}
    assert sorted(views) == ["i0", "i1"] and all(v.state == "alive" for v in views.values())
    for host in ("i0", "i1"):
        assert views[host].request_address.startswith(f"tcp://{hosts.lab.address(host)}:")
        assert "KV transfer pairs meet over ZeroMQ" in Path(hosts.cluster.proc(f"instance-{host}").log).read_text()
        listening = _listening(views[host].pid, skip_port=-1)
        # requests and Gloo on the host's address, metrics on its loopback; nothing on every interface (the KV
        # rendezvous, once a TCPStore that listened there, travels over the authenticated channel)
        assert listening == {hosts.lab.address(host), "127.0.0.1"}, (host, listening)


def test_greedy_output_is_identical_when_migrated_across_hosts(hosts):
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}

    def scenario():
        url = hosts.cluster.url  # the proxy's HTTP on ctl's loopback: this thread is on ctl
        ref = Stream(url, body).result()
        s = Stream(url, body)
        s.wait_tokens(6)
        admin = hosts.admin()
        here = next(r.instance_id for r in admin.requests().requests if r.request_id == s.rid)
        outcomes = []
        for at in (6, 20):
            s.wait_tokens(at)
            there = "i1" if here == "i0" else "i0"
            outcomes.append(admin.migrate(there, request_id=s.rid).outcomes[0])
            here = there
        return ref, s.result(), outcomes

    ref, moved, outcomes = hosts.on("ctl", scenario)
    assert [o.outcome for o in outcomes] == ["committed", "committed"], outcomes
    assert all(o.bytes > 0 for o in outcomes)
    assert len(ref.ids) == 40 and moved.ids == ref.ids
    assert moved.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert moved.text == ref.text and moved.usage["completion_tokens"] == 40


def _handshake(address: str, message: bytes, sock_type: int, keys: Path | None, server_role: str) -> str:
    """From this thread's host: connect (with a key of our own cluster ``keys``, or none), send, and say how
    the CURVE handshake ended: 'refused' (the server said no), 'failed' (mechanism mismatch) or 'answered'.
    A keyless client may also only see the connection closed during the handshake, every time (a CURVE
    server can hang up before a NULL client has read its greeting: seen under load); with no other event by
    the deadline, that is 'failed' too: it never got through."""
    ctx = zmq.Context()
    sock = runtime.tune(ctx.socket(sock_type))
    sec = None
    if keys is not None:  # a key that is not the cluster's, and the server's real public key
        sec = security.Security(SecurityConfig(keys_dir=str(keys), key="operator"), "llumnixctl")
        sec.client(sock, server_role)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                      | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    closed = False
    try:
        sock.connect(address)
        sock.send(message)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if monitor.poll(200):
                event = recv_monitor_message(monitor)["event"]
                if event == zmq.EVENT_DISCONNECTED:
                    closed = True  # a reconnection follows: wait for a clearer event
                    continue
                return {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused", zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "failed",
                        zmq.EVENT_HANDSHAKE_SUCCEEDED: "answered"}[event]
        return "failed" if closed and keys is None else "no event"
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
        ctx.term()


def test_an_outsider_is_refused_everywhere(hosts, tmp_path):
    admin = hosts.admin()  # its socket is made (in ctl's namespace) on first use, in the thread that uses it
    before = {v.instance_id: v.pid for v in hosts.on("ctl", lambda: admin.status()).instances}
    instance = next(v.request_address for v in hosts.on("ctl", lambda: admin.status()).instances
                    if v.instance_id == "i1")
    token = hosts.token_address()
    assert not token.startswith("tcp://127.")
    # the outsider knows the servers' public keys (they are no secret) but has no key of the cluster
    own = tmp_path / "outsider"
    assert ctl("keys", "generate", str(own)).returncode == 0
    for role in ("manager", "instance", "proxy"):
        (own / "public" / f"{role}.key").write_bytes((hosts.keys / "public" / f"{role}.key").read_bytes())
    drain = wire.encode(wire.DrainQuery(1, "i0"))
    submit = wire.encode(wire.Submit("outsider-1", [1, 2, 3], wire.SamplingParams(max_tokens=2), token))
    failure = wire.encode(wire.RequestFailed("any", "i0", "forged"))
    cases = [(hosts.cluster.manager, drain, zmq.DEALER, "manager"), (instance, submit, zmq.DEALER, "instance"),
             (token, failure, zmq.PUSH, "proxy")]
    for address, message, kind, role in cases:
        assert hosts.on("x", _handshake, address, message, kind, None, role) == "failed", (role, "no key")
        assert hosts.on("x", _handshake, address, message, kind, own, role) == "refused", (role, "unknown key")
    # the control: a key of the cluster from the same host is admitted
    assert hosts.on("x", _handshake, hosts.cluster.manager, wire.encode(wire.StatusQuery(1)), zmq.DEALER,
                    hosts.keys, "manager") == "answered"
    after = hosts.on("ctl", lambda: admin.status()).instances
    assert {v.instance_id: v.pid for v in after} == before
    assert all(v.state == "alive" and not v.draining for v in after)
    manager_log = Path(hosts.cluster.proc("manager").log).read_text()
    assert "refused a connection to the manager socket: unknown key" in manager_log
