"""Addresses are checked where they enter: a setting (the daemon refuses to start, naming the setting and
where it came from) and a peer's message (the frame does not decode: dropped and logged). A forged address
used to reach ZeroMQ's connect inside tasks the proxy cannot live without, and take every proxy down."""

from __future__ import annotations

import logging

import msgspec
import pytest
import zmq

from daemons import endpoints, wire
from daemons.config import ConfigError, load_config
from tests.support.cluster import VirtualCluster

BAD = ["127.0.0.1:7299", "", "tcp://x", "tcp://h:0", "tcp://h:99999", "tcp://*:7", "tcp://h :1", "udp://h:1",
       "inproc://", "tcp://" + "h" * 300 + ":1", "tcp://h:-1", "tcp://:5"]


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:7100", "tcp://node-3.example:1", "tcp://[::1]:7",
                                     "tcp://10.0.0.2;198.18.0.1:5000", "ipc:///run/llumnix/m.sock", "inproc://i0"])
def test_endpoints_that_pass(address):
    assert endpoints.problem(address) == ""


@pytest.mark.parametrize("address", BAD)
def test_endpoints_that_do_not(address):
    assert endpoints.problem(address) != ""


def test_binding_may_use_every_interface_and_any_port():
    assert endpoints.problem("tcp://*:0", bind=True) == endpoints.problem("tcp://127.0.0.1:0", bind=True) == ""
    assert "only binds" in endpoints.problem("tcp://*:7100")


@pytest.mark.parametrize("key", ["instance.advertise_address", "proxy.advertise_address", "manager.address",
                                 "instance.request_address", "proxy.token_address", "manager.bind"])
def test_a_bad_address_setting_names_the_setting_and_the_file(tmp_path, key):
    section, name = key.split(".")
    path = tmp_path / "llumnix.toml"
    path.write_text(f'[{section}]\n{name} = "127.0.0.1:7299"\n')
    with pytest.raises(ConfigError, match=rf"{path}: {key} '127.0.0.1:7299' is not a ZeroMQ endpoint"):
        load_config(path)


def test_settings_that_bind_take_every_interface_and_empty_ones_keep_their_meaning():
    cfg = load_config(None, ["instance.request_address=tcp://*:0", "manager.bind=tcp://*:7100",
                             "manager.address=tcp://0.0.0.0:0", "instance.advertise_address=",
                             "proxy.advertise_address="])
    assert cfg.instance.request_address == "tcp://*:0" and cfg.proxy.advertise_address == ""
    with pytest.raises(ConfigError, match="instance.request_address 'tcp://h' needs a host and a port"):
        load_config(None, ["instance.request_address=tcp://h"])


def forged(msg: msgspec.Struct, field: str, value: str) -> bytes:
    """``msg`` encoded with ``field`` set to ``value`` behind the constructor's back, as a hostile peer sends it."""
    data = msgspec.to_builtins(msg)
    data[1 + msg.__struct_fields__.index(field)] = value  # [tag, field, ...]
    return msgspec.msgpack.encode(data)


LOAD = wire.InstanceLoad(100, 0, 0, 0, 8, 16)
GOOD = "tcp://127.0.0.1:9"
MESSAGES = [(wire.Submit("r", [1], wire.SamplingParams(), GOOD), "reply_to"),
            (wire.ProxyAlive(GOOD), "token_address"),
            (wire.Heartbeat("i9", GOOD), "request_address"),
            (wire.Moved("r", "i9", GOOD), "request_address"),
            (wire.Register("i9", "h", 1, GOOD, "sim", "m", LOAD), "request_address"),
            (wire.MigrateStart(1, "i1", GOOD), "dst_address")]


@pytest.mark.parametrize("msg, field", MESSAGES, ids=[type(m).__name__ for m, _ in MESSAGES])
@pytest.mark.parametrize("address", BAD[:4])
def test_a_message_with_a_bad_address_does_not_decode(msg, field, address, caplog):
    assert wire.decode(forged(msg, field, GOOD)) == msg  # the forgery itself is sound
    assert wire.decode(forged(msg, field, address)) is None
    assert f"{field} {address!r}" in caplog.text and "dropped malformed frame" in caplog.text


def test_forged_addresses_on_every_socket_leave_every_daemon_serving(caplog):
    """Heartbeats, ownership claims, registrations, submits and proxy-alive messages naming bad addresses, sent
    to the proxy's token path, an instance's request socket and the manager, while a stream runs: each is
    dropped and logged, no task ends, the stream streams every index once and new requests are served."""
    caplog.set_level(logging.WARNING, logger="llumnix")

    async def scenario(c: VirtualCluster):
        s = await c.request(max_tokens=300)
        await c.tokens(s, 5)
        sent = 0
        to_proxy = c.zmq.socket(zmq.PUSH)
        to_proxy.connect(c.proxy.token_address)
        to_instance = c.zmq.socket(zmq.DEALER)
        to_instance.connect("inproc://i0")
        to_manager = c.zmq.socket(zmq.DEALER)
        to_manager.connect(c.cfg.manager.address)
        for address in BAD[:4]:
            for msg, field in MESSAGES:
                for sock in (to_proxy, to_instance, to_manager):
                    await sock.send(forged(msg, field, address))
                    sent += 1
        await c.until(lambda: caplog.text.count("dropped malformed frame") >= sent, 5, "not every frame was dropped")
        for sock in (to_proxy, to_instance, to_manager):
            sock.close(linger=0)
        assert all(not t.done() for t in c.proxy.essential)
        assert all(not c.runs[k].done() for k in ("manager", "i0", "i1"))
        assert "broke its handler" not in caplog.text
        assert [o.token_id for o in await c.result(s)] == c.expected(s, 300)
        later = await c.request(max_tokens=20)
        assert [o.token_id for o in await c.result(later)] == c.expected(later, 20)
        assert "i9" not in {v.instance_id for v in c.manager.view(c.clock.monotonic())}

    VirtualCluster.run(scenario, sets=["instance.min_step_s=0.02"])
