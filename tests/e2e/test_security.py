"""Cluster sockets with CURVE keys: every role's key works and only for its verbs; unknown keys, no key, a
replayed conversation, forged messages and oversized frames are refused, and the daemons are unaffected.
Plus what listens where: nothing beyond loopback without keys, the KV store on kv_host only, /metrics
behind a token."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
import zmq

from conftest import FAST, Cluster, cli
from daemons import runtime, security, wire
from daemons.config import SecurityConfig
from llumnixctl.admin import AdminClient
from llumnixctl.lab import localcluster
from tests.streams import wait_for

pytestmark = pytest.mark.e2e

MAX_MESSAGE = 1 << 20


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("keys")
    res = cli("keys", "generate", str(d))
    assert res.returncode == 0, res.stderr
    assert cli("keys", "generate", str(d), "--name", "instance-spare").returncode == 0
    return d


@pytest.fixture(scope="module")
def secured(keys, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("secured")
    token = run_dir / "metrics.token"
    token.write_text("s3cret-scrape\n")
    sets = FAST + [f"security.keys_dir={keys}", f"security.max_message_bytes={MAX_MESSAGE}",
                   f"security.metrics_token_file={token}"]
    state = localcluster.up(run_dir, 2, "sim", 0, None, sets, timeout_s=60)
    cluster = Cluster(state, run_dir)
    try:
        yield cluster
    finally:
        cluster.stop()


def config_for(tmp_path: Path, keys_dir: Path, key: str = "") -> str:
    path = tmp_path / f"{key or 'default'}-{keys_dir.name}.toml"
    path.write_text(f'[security]\nkeys_dir = "{keys_dir}"\nkey = "{key}"\n')
    return str(path)


def client(keys_dir: Path, key: str, address: str) -> AdminClient:
    return AdminClient(address, timeout_s=3, sec=security.Security(SecurityConfig(keys_dir=str(keys_dir), key=key),
                                                                    "llumnixctl"))


def status(secured: Cluster, keys: Path) -> dict:
    snap = client(keys, "operator", secured.manager).status()
    return {v.instance_id: v for v in snap.instances}


# ------------------------------------------------------------------ keys


def test_keys_generate_lists_roles_and_never_overwrites(keys, tmp_path):
    listed = json.loads(cli("keys", "list", str(keys), "--json").stdout)
    assert {k["name"]: k["role"] for k in listed} == {
        "manager": "manager", "instance": "instance", "proxy": "proxy", "operator": "operator",
        "reader": "reader", "instance-spare": "instance"}
    assert all(k["secret"] and len(k["public_key"]) == 40 for k in listed)
    assert (keys / "secret").stat().st_mode & 0o077 == 0
    assert all(p.stat().st_mode & 0o077 == 0 for p in (keys / "secret").iterdir())
    before = (keys / "public" / "operator.key").read_bytes()
    again = cli("keys", "generate", str(keys))
    assert again.returncode == 1 and "already exist" in again.stderr and "--force" in again.stderr
    assert (keys / "public" / "operator.key").read_bytes() == before
    bad = cli("keys", "generate", str(tmp_path / "k"), "--name", "admin-bob")
    assert bad.returncode == 2 and "must start with a role" in bad.stderr


# ------------------------------------------------------------------ roles and verbs


def test_operator_key_runs_every_verb_and_traffic_flows(secured, keys, tmp_path):
    cfg = config_for(tmp_path, keys, "operator")
    got = cli("status", "--json", "--manager", secured.manager, "--config", cfg)
    assert got.returncode == 0, got.stderr
    assert [i["id"] for i in json.loads(got.stdout)["instances"]] == ["i0", "i1"]
    assert cli("cordon", "i0", "--manager", secured.manager, "--config", cfg).returncode == 0, secured.logs()
    assert status(secured, keys)["i0"].cordoned
    assert cli("uncordon", "i0", "--manager", secured.manager, "--config", cfg).returncode == 0
    assert not status(secured, keys)["i0"].cordoned
    # requests are served and migrate between instances over authenticated sockets
    api = secured.openai()
    # Long enough to be running whatever the machine's load when the migration comes (the fast sim makes a
    # few hundred tokens a second); closed once it has streamed past the move.
    stream = api.completions.create(model="llumnix-sim", prompt="hello", max_tokens=4000, stream=True,
                                    extra_body={"ignore_eos": True})
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    admin = client(keys, "operator", secured.manager)
    rid = wait_for(lambda: next((r for r in admin.requests().requests), None), 10, "the request is listed")
    dst = "i1" if rid.instance_id == "i0" else "i0"
    outcome = admin.migrate(dst, request_id=rid.request_id).outcomes[0]
    assert outcome.outcome == "committed", outcome
    text += "".join(next(chunks).choices[0].text for _ in range(20))  # it streams on from the destination
    stream.close()
    assert text


def test_reader_key_reads_but_may_not_change_anything(secured, keys, tmp_path):
    cfg = config_for(tmp_path, keys, "reader")
    assert cli("status", "--json", "--manager", secured.manager, "--config", cfg).returncode == 0
    assert cli("requests", "--json", "--manager", secured.manager, "--config", cfg).returncode == 0
    for verb in (["drain", "i0"], ["remove", "i1"], ["add"], ["migrate", "i0", "--to", "i1"],
                 ["policy", "--dispatch", "rr"]):
        res = cli(*verb, "--manager", secured.manager, "--config", cfg)
        assert res.returncode == 1, (verb, res.stdout, res.stderr)
        assert "permission denied" in res.stderr and "operator" in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    views = status(secured, keys)
    assert sorted(views) == ["i0", "i1"] and not any(v.draining or v.cordoned for v in views.values())
    assert client(keys, "operator", secured.manager).policy().dispatch_policy == "llumnix"
    assert "refused DrainQuery from reader:reader" in secured.logs()


@pytest.mark.parametrize("key", ["instance", "proxy"])
def test_daemon_keys_may_not_run_admin_verbs(secured, keys, key):
    with pytest.raises(RuntimeError, match="permission denied"):
        client(keys, key, secured.manager).drain("i0")
    assert not status(secured, keys)["i0"].draining


def test_unknown_key_and_no_key_are_refused_and_logged(secured, keys, tmp_path):
    other = tmp_path / "other"
    assert cli("keys", "generate", str(other)).returncode == 0
    (other / "public" / "manager.key").write_bytes((keys / "public" / "manager.key").read_bytes())
    res = cli("status", "--manager", secured.manager, "--config", config_for(tmp_path, other, "operator"))
    assert res.returncode == 1 and "refused our key 'operator'" in res.stderr, res.stderr
    res = cli("status", "--manager", secured.manager, "--timeout", "2")
    assert res.returncode == 1 and "uses CURVE keys" in res.stderr, res.stderr
    wait_for(lambda: "refused a connection to the manager socket: unknown key" in secured.logs(), 10,
             "the manager logs the unknown key")
    assert len(status(secured, keys)) == 2


def test_a_second_key_cannot_take_a_live_instance_id(secured, keys, no_fork_server):
    argv = localcluster.daemon_argv("instance") + secured.state.args + [
        "--set", "instance.id=i0", "--set", "instance.backend=sim", "--set", "security.key=instance-spare"]
    proc = secured.spawn("instance-impostor", argv)
    live = psutil.Process(proc.pid)
    assert live.wait(30) == 1
    log = Path(proc.log).read_text()
    assert "refused our registration" in log and "taken by another key" in log, log
    views = status(secured, keys)
    assert views["i0"].pid == secured.proc("instance-i0").pid and views["i0"].state == "alive"


# ------------------------------------------------------------------ forged, replayed, oversized


def _submit(reply_to: str, rid: str) -> bytes:
    return wire.encode(wire.Submit(rid, [5, 6, 7], wire.SamplingParams(max_tokens=2, ignore_eos=True), reply_to))


def test_forged_submit_without_a_key_is_never_run(secured, keys):
    address = status(secured, keys)["i0"].request_address
    ctx = zmq.Context.instance()
    proxy_sec = security.Security(SecurityConfig(keys_dir=str(keys), key="proxy"), "proxy", ctx)
    pull = proxy_sec.server(runtime.tune(ctx.socket(zmq.PULL)), "proxy")
    reply_to = runtime.bind(pull, "tcp://127.0.0.1:0")
    plain = runtime.tune(ctx.socket(zmq.DEALER))
    keyed = proxy_sec.client(runtime.tune(ctx.socket(zmq.DEALER)), "instance")
    try:
        plain.connect(address)
        plain.send(_submit(reply_to, "forged-1"))
        keyed.connect(address)  # the control: the same message with a proxy key is served
        keyed.send(_submit(reply_to, "keyed-1"))
        seen = set()
        deadline = time.monotonic() + 10
        while "keyed-1" not in seen and time.monotonic() < deadline:
            if pull.poll(500):
                msg = wire.decode(pull.recv())
                if isinstance(msg, wire.TokenBatch):
                    seen |= {o.request_id for o in msg.outputs}
        assert "keyed-1" in seen
        settle = time.monotonic() + 1.0  # whatever else arrived (heartbeats keep coming: bounded)
        while time.monotonic() < settle and pull.poll(100):
            msg = wire.decode(pull.recv())
            if isinstance(msg, wire.TokenBatch):
                seen |= {o.request_id for o in msg.outputs}
        assert "forged-1" not in seen
    finally:
        for s in (plain, keyed, pull):
            s.close(0)
        proxy_sec.close()


def _token_ports(secured: Cluster) -> list[int]:
    """The proxy's listening ports other than its HTTP port: its token socket."""
    proxy = psutil.Process(secured.proc("proxy").pid)
    http_port = int(secured.url.rsplit(":", 1)[1])
    return [c.laddr.port for c in proxy.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port != http_port]


def test_forged_token_failure_without_a_key_does_not_touch_streams(secured, keys):
    api = secured.openai()
    # Long enough to be running when the forgery comes (a CI run's 60-token request was over before the
    # manager's listing showed it); the request id is the response's id.
    stream = api.completions.create(model="llumnix-sim", prompt="hello", max_tokens=600, stream=True,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    chunks = [next(iter(stream))]
    rid = chunks[0].id
    ports = _token_ports(secured)
    assert ports  # the token socket
    ctx = zmq.Context.instance()
    socks = []
    try:
        for port in ports:  # a forged failure of the running request, from a sender without a key
            s = runtime.tune(ctx.socket(zmq.PUSH))
            s.connect(f"tcp://127.0.0.1:{port}")
            socks.append(s)
            try:
                s.send(wire.encode(wire.RequestFailed(rid, "i0", "forged failure")), zmq.NOBLOCK)
            except zmq.Again:
                pass  # never connected: refused at the handshake
        chunks += list(stream)
    finally:
        for s in socks:
            s.close(0)
    ids = [t for c in chunks for ch in c.choices for t in (getattr(ch, "token_ids", None) or [])]
    assert len(ids) == 600 and chunks[-1].choices[0].finish_reason == "length"


def test_a_stolen_instance_key_cannot_inject_tokens_or_forge_heartbeats_for_another_instance(secured, keys):
    """The holder of instance-spare's key (a real instance key, stolen) speaks on the proxy's token path as
    i0 and i1: tokens for a running stream, and heartbeats saying the instances are unhealthy. The manager
    pinned i0 and i1 to the key they registered with; the proxy drops what another key says for them: the
    stream is exact (the sim's tokens), nothing failed over, and the forgeries are counted."""
    from daemons.config import SimConfig
    from daemons.engine.sim import sim_token_id

    api = secured.openai()
    stream = api.completions.create(model="llumnix-sim", prompt="hello", max_tokens=600, stream=True,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    chunks = [next(iter(stream))]
    rid = chunks[0].id
    ports = _token_ports(secured)
    ctx = zmq.Context.instance()
    thief = security.Security(SecurityConfig(keys_dir=str(keys), key="instance-spare"), "instance", ctx)
    socks = []
    try:
        for port in ports:
            s = thief.client(runtime.tune(ctx.socket(zmq.PUSH)), "proxy")
            s.connect(f"tcp://127.0.0.1:{port}")
            socks.append(s)
        for s in socks:
            for iid in ("i0", "i1"):
                forged = [wire.TokenOut(rid, i, 7, epoch=e) for e in (1, 2) for i in range(600)]
                for part in range(0, len(forged), 100):
                    s.send(wire.encode(wire.TokenBatch(iid, forged[part:part + 100])))
                address = status(secured, keys)[iid].request_address
                s.send(wire.encode(wire.Heartbeat(iid, address, healthy=False)))
        chunks += list(stream)
    finally:
        for s in socks:
            s.close(0)
        thief.close()
    ids = [t for c in chunks for ch in c.choices for t in (getattr(ch, "token_ids", None) or [])]
    assert ids == [sim_token_id(rid, i, SimConfig().vocab_size) for i in range(600)]
    req = urllib.request.Request(secured.url + "/metrics", headers={"Authorization": "Bearer s3cret-scrape"})
    text = urllib.request.urlopen(req, timeout=10).read().decode()
    forged = [line for line in text.splitlines() if line.startswith("llumnix_proxy_forged_messages_total")]
    assert forged and float(forged[0].rsplit(" ", 1)[1]) > 0, forged
    failovers = [line for line in text.splitlines() if line.startswith("llumnix_proxy_failovers_total")
                 and 'cause="unhealthy"' in line]
    assert failovers and float(failovers[0].rsplit(" ", 1)[1]) == 0, failovers


class _Relay(threading.Thread):
    """A TCP relay that records what the client sent, to replay it later."""

    def __init__(self, target_port: int):
        super().__init__(daemon=True)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target_port = target_port
        self.sent = bytearray()
        self.start()

    def run(self) -> None:
        conn, _ = self.listener.accept()
        upstream = socket.create_connection(("127.0.0.1", self.target_port))

        def pump(src, dst, record):
            while data := src.recv(65536):
                if record:
                    self.sent.extend(data)
                dst.sendall(data)

        back = threading.Thread(target=pump, args=(upstream, conn, False), daemon=True)
        back.start()
        try:
            pump(conn, upstream, True)
        except OSError:
            pass
        finally:
            upstream.close()
            conn.close()


def test_a_replayed_conversation_is_refused(secured, keys):
    port = int(secured.manager.rsplit(":", 1)[1])
    relay = _Relay(port)
    recorded = client(keys, "operator", f"tcp://127.0.0.1:{relay.port}")
    assert recorded.drain("i1", cordon_only=True)
    recorded.close()
    wait_for(lambda: not relay.is_alive(), 10, "the relayed connection closes")
    assert status(secured, keys)["i1"].cordoned
    client(keys, "operator", secured.manager).drain("i1", drain=False, cordon_only=True)
    assert not status(secured, keys)["i1"].cordoned
    # the same bytes again, on a new connection: the server's handshake has new keys and cookies
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(bytes(relay.sent))
        s.settimeout(5)
        try:
            while s.recv(65536):
                pass  # the manager closes the connection when the replayed handshake fails
        except (TimeoutError, ConnectionResetError):
            pass
    assert not status(secured, keys)["i1"].cordoned


def test_oversized_frame_disconnects_the_sender_only(secured, keys):
    ctx = zmq.Context.instance()
    sec = security.Security(SecurityConfig(keys_dir=str(keys), key="operator"), "llumnixctl", ctx)
    sock = sec.client(runtime.tune(ctx.socket(zmq.DEALER)), "manager")
    sock.setsockopt(zmq.MAXMSGSIZE, -1)  # our side would send anything
    try:
        sock.connect(secured.manager)
        sock.send(wire.encode(wire.StatusQuery(1)))
        assert sock.poll(5000), "a small query is answered"
        sock.recv()
        sock.send(wire.encode(wire.DrainQuery(2, "i0" + "x" * (2 * MAX_MESSAGE))))
        assert not sock.poll(1500), "the oversized query was answered"
    finally:
        sock.close(0)
    views = status(secured, keys)
    assert sorted(views) == ["i0", "i1"] and not views["i0"].draining


# ------------------------------------------------------------------ what listens where


def test_metrics_need_the_token(secured, keys):
    addr = status(secured, keys)["i0"].metrics_address
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"http://{addr}/metrics", timeout=5)
    assert err.value.code == 401
    req = urllib.request.Request(f"http://{addr}/metrics", headers={"Authorization": "Bearer s3cret-scrape"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert b"llumnix_instance" in resp.read()


def test_instances_listen_on_loopback_only(secured):
    for name in ("instance-i0", "instance-i1", "manager", "proxy"):
        proc = secured.proc(name)
        # No TCPStore any more (it listened on every interface whatever it was told): KV pairs meet over ZeroMQ
        listening = [c.laddr for c in psutil.Process(proc.pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        assert listening and all(a.ip == "127.0.0.1" for a in listening), (name, listening)


@pytest.mark.parametrize("daemon,setting", [
    ("manager", "manager.address=tcp://0.0.0.0:0"),
    ("instance", "instance.request_address=tcp://0.0.0.0:0"),
    ("instance", "migration.kv_host=0.0.0.0"),
])
def test_no_listening_beyond_loopback_without_keys(daemon, setting):
    argv = localcluster.daemon_argv(daemon) + ["--set", setting, "--set", "instance.backend=sim",
                                           "--set", "manager.metrics_port=-1"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, res.stderr
    lines = [line for line in res.stderr.splitlines() if "cannot start" in line]
    assert len(lines) == 1 and setting.split("=")[0] in lines[0] and "security.keys_dir" in lines[0] \
        and "security.trusted_network" in lines[0], res.stderr


def test_a_trusted_network_may_listen_without_keys(tmp_path):
    argv = localcluster.daemon_argv("manager") + ["--set", "manager.address=tcp://0.0.0.0:0", "--set",
                                              "manager.metrics_port=-1", "--set", "security.trusted_network=true"]
    log = tmp_path / "manager.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "serving on tcp://0.0.0.0:" in log.read_text() or proc.poll() is not None, 30, "it serves")
        assert proc.poll() is None, log.read_text()
    finally:
        proc.terminate()
        proc.wait(15)


def test_bad_keys_dir_is_one_line_naming_the_setting(tmp_path):
    argv = localcluster.daemon_argv("manager") + ["--set", f"security.keys_dir={tmp_path / 'nowhere'}",
                                              "--set", "manager.metrics_port=-1"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert "security.keys_dir" in res.stderr and "llumnixctl keys generate" in res.stderr, res.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


# Connects to a port as a TCPStore client and lists its keys. A refusal (no store there: the connection is
# refused or closed, the handshake or the read times out) prints REFUSED and exits 0; anything else (a broken
# probe) fails with its traceback, so that "nothing listed" can only mean refused.
PROBE = """
import sys
from datetime import timedelta
import torch.distributed as dist
try:
    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=2), use_libuv=True)
    print("LISTED", store.list_keys(), flush=True)
except (RuntimeError, OSError) as exc:  # torch's DistError and its store errors are RuntimeErrors
    print("REFUSED", type(exc).__name__, flush=True)
"""


def probe(ports: list[int], within_s: float) -> dict[int, str]:
    """Each port probed by a process of its own, at once; what each printed (TIMEOUT: still trying at the
    end, killed). A probe that failed otherwise fails the test."""
    procs = {port: subprocess.Popen([sys.executable, "-c", PROBE, str(port)], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for port in ports}
    said = {}
    deadline = time.monotonic() + within_s
    try:
        for port, proc in procs.items():
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                said[port] = "TIMEOUT"
                continue
            assert proc.returncode == 0 and out.startswith(("LISTED", "REFUSED")), f"the probe broke: {out}{err}"
            said[port] = out.strip()
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return said


def test_the_probe_lists_a_tcpstore():
    """The control of the next test: the same probe lists the keys of a TCPStore (what the KV rendezvous
    once served), so a probe that lists nothing was refused, not broken."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), use_libuv=True)
    store.set("pair-i0-i1", "10.0.0.1:29500")
    (said,) = probe([store.port], 20).values()
    assert said.startswith("LISTED") and "pair-i0-i1" in said, said


def test_the_kv_rendezvous_leaves_no_port_that_a_host_without_keys_can_read(secured, keys):
    """A KV pair's rendezvous (each end's Gloo address, under the pair's secret key) travels over the
    instances' CURVE channel: after a migration, no listening port of either instance answers as a TCPStore,
    the store that once listed the pair keys to anyone who reached it (and took writes from anyone). Each
    port is probed by a process of its own, bounded in time (a probe that gets no answer found nothing; the
    test above is its control: the same probe lists a TCPStore's keys)."""
    api = secured.openai()
    stream = api.completions.create(model="llumnix-sim", prompt="hello", max_tokens=150, stream=True,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    first = next(iter(stream))
    rid = first.id
    op = client(keys, "operator", secured.manager)
    try:
        src = next(r.instance_id for r in op.requests().requests if r.request_id == rid)
        out = op.migrate("i1" if src == "i0" else "i0", request_id=rid).outcomes[0]
    finally:
        op.close()
    assert out.outcome == "committed", out  # the pair formed over the relay, with CURVE on
    # It streams on from its new instance to the end: every token (chunks may carry several when the client
    # reads slower than they come, so their number says nothing).
    ids = [t for c in [first, *stream] for ch in c.choices for t in (getattr(ch, "token_ids", None) or [])]
    assert len(ids) == 150, len(ids)
    ports = {c.laddr.port for name in ("instance-i0", "instance-i1")
             for c in psutil.Process(secured.proc(name).pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    assert ports
    said = probe(sorted(ports), 20)  # a probe gets 2 s per try, 4 tries
    listed = {port: out for port, out in said.items() if out.startswith("LISTED")}
    assert not listed, f"instance ports answer as a TCPStore: {listed}"
