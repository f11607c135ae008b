"""Ownership rules in one place: the instance's request table, the proxy's fencing, the token path's backlog."""

from __future__ import annotations

import socket
import time

import zmq

from daemons import wire
from daemons.proxy.cluster.client import Stream
from daemons.proxylinks import ProxyLinks
from daemons.requests import AbortAction, RequestTable


def test_table_admit_advance_forget():
    t = RequestTable()
    t.admit("r", "tcp://p:3", epoch=1)
    assert "r" in t and t.get("r").emitted == 0
    t.advance("r", 0, finished=False)
    t.advance("r", 1, finished=False)
    assert t.get("r").emitted == 2
    assert t.advance("r", 2, finished=True).emitted == 3
    assert "r" not in t and t.advance("r", 3, False) is None  # late outputs of a finished request go nowhere


def test_failover_admission_continues_at_its_index():
    t = RequestTable()
    e = t.admit("r", "tcp://p:3", epoch=3, emitted=17)
    assert (e.epoch, e.emitted, e.arrived) == (3, 17, 0.0)


def test_aborts_follow_epochs_and_migrations():
    t = RequestTable()
    t.admit("r", "tcp://p:3", epoch=2)
    assert t.abort("r", epoch=1) is AbortAction.STALE  # meant for an older copy
    assert t.abort("r", epoch=2) is AbortAction.HERE
    assert t.abort("r") is AbortAction.HERE  # a client's abort: whichever copy
    entry = t.begin_migration("r")
    assert t.begin_migration("r") is None  # one migration at a time
    assert t.abort("r") is AbortAction.DEFERRED
    t.hand_over("r", "tcp://dst:6")
    assert t.end_migration(entry) is True  # the deferred abort is still known after the hand-over
    assert t.abort("r") is AbortAction.FOLLOW and t.moved_to("r") == "tcp://dst:6"
    assert t.abort("r") is AbortAction.UNKNOWN  # followed once


def test_take_over_marks_arrival_and_reclaim_bumps_the_epoch():
    t = RequestTable()
    before = time.monotonic()
    t.take_over("r", "tcp://p:3", epoch=4, emitted=9)
    assert list(t.arrivals()) == ["r"] and before <= t.arrivals()["r"] <= time.monotonic()
    assert t.reclaim("r").epoch == 5
    assert t.of_proxy("tcp://p:3") == ["r"] and t.proxies() == {"tcp://p:3"}


def _out(index: int, epoch: int, rid: str = "r") -> wire.TokenOut:
    return wire.TokenOut(rid, index, 100 + index, epoch=epoch)


def test_stream_takes_tokens_only_from_its_owner():
    s = Stream("r", wire.Submit("r", [1], wire.SamplingParams(), "tcp://p:3"))
    s.instance_id, s.epoch = "i0", 1
    assert s.owns("i0", _out(0, 1)) and not s.owns("i1", _out(0, 1))  # same epoch, another copy
    # A migration commits on i1 as epoch 2 from index 5: the source's tokens before 5 still count (they may
    # arrive after the destination's claim), none after.
    s.instance_id, s.epoch, s.owner_from = "i1", 2, 5
    assert s.owns("i0", _out(4, 1)) and not s.owns("i0", _out(5, 1))
    assert s.owns("i1", _out(5, 2)) and not s.owns("i1", _out(5, 3))


def test_stream_delivers_each_index_once_in_order():
    s = Stream("r", wire.Submit("r", [1], wire.SamplingParams(), "tcp://p:3"))
    for i in (0, 2, 1, 1, 3):
        s.feed(_out(i, 1))
    assert [o.index for o in s.ready] == [0, 1, 2, 3] and s.token_ids == [100, 101, 102, 103]


def test_a_full_token_path_holds_messages_in_order_and_loses_none():
    ctx = zmq.Context()
    try:
        # A port nobody listens on: the PUSH queue fills up to its high-water mark. (A ZeroMQ listener
        # closed here would go away asynchronously: the PUSH could still connect to it and lose what
        # it wrote into that dying connection.)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        address = f"tcp://127.0.0.1:{port}"
        links = ProxyLinks(ctx, orphan_timeout_s=60, max_backlog=5, sndhwm=10)
        sent = [wire.TokenBatch("i0", [_out(i, 1)]) for i in range(40)]
        for msg in sent:
            links.send(address, msg)
        assert len(links.links[address].backlog) > 5
        assert [a for a, _ in links.gone({address})] == [address]  # reported, not silently dropped
        pull = ctx.socket(zmq.PULL)
        pull.bind(address)
        deadline = time.monotonic() + 30
        got = []
        while len(got) < len(sent):
            assert time.monotonic() < deadline, f"{len(got)} of {len(sent)} arrived"
            links.flush()
            if pull.poll(50):
                got.append(wire.decode(pull.recv()))
        assert got == sent
        links.close()
        pull.close(0)
    finally:
        ctx.destroy(0)
