"""Admission control over a proxy's view, without daemons: ``ClusterClient.admit`` on heartbeats built by hand."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemons import wire
from daemons.config import load_config
from daemons.proxy.cluster import ClusterClient, Overloaded


_made: list[ClusterClient] = []


def client(*sets: str) -> ClusterClient:
    c = ClusterClient(load_config(None, list(sets)))
    _made.append(c)
    return c


def beat(iid: str, waiting: int, waiting_tokens: int = 0, accepting: bool = True, healthy: bool = True,
         blocks_total: int = 100, block_size: int = 16) -> wire.Heartbeat:
    load = wire.InstanceLoad(blocks_total=blocks_total, blocks_used=0, running=0, waiting=waiting, batch_size=8,
                             block_size=block_size, waiting_tokens=waiting_tokens)
    return wire.Heartbeat(iid, f"tcp://127.0.0.1:{1000 + len(iid)}", healthy, load, accepting)


def refused(c: ClusterClient, priority: int = 0) -> str | None:
    try:
        c.admit(priority)
    except Overloaded as exc:
        return exc.reason
    return None


def test_requests_bound_is_per_instance_that_takes_requests():
    c = client("admission.max_queued_requests=4", "admission.max_queued_tokens=0")
    c.beats = {"a": beat("a", 3), "b": beat("b", 4)}
    assert refused(c) is None  # 7 < 4 x 2
    c.beats["a"] = beat("a", 4)
    assert refused(c) == "queued_requests"  # 8
    c.beats["b"] = beat("b", 4, accepting=False)  # a cordoned instance is no capacity, and its queue not ours
    assert refused(c) == "queued_requests"  # 4 >= 4 x 1
    c.beats["a"] = beat("a", 3)
    assert refused(c) is None


def test_tokens_bound_defaults_to_the_kv_cache():
    c = client("admission.max_queued_requests=0")  # max_queued_tokens = -1: twice each instance's KV, 100 x 16 tokens
    c.beats = {"a": beat("a", 1, waiting_tokens=3199)}
    assert refused(c) is None
    c.beats = {"a": beat("a", 1, waiting_tokens=3200)}
    assert refused(c) == "queued_tokens"
    assert refused(c, priority=1) is None  # x2 for high priority


def test_requests_bound_defaults_to_the_batch_size():
    c = client("admission.max_queued_tokens=0")  # max_queued_requests = -1: each instance's batch (8)
    c.beats = {"a": beat("a", 7), "b": beat("b", 8)}
    assert refused(c) is None  # 15 < 16
    c.beats["a"] = beat("a", 8)
    assert refused(c) == "queued_requests"


def test_requests_waiting_here_and_unshown_dispatches_count():
    c = client("admission.max_queued_requests=2", "admission.max_queued_tokens=0")
    c.beats = {"a": beat("a", 0)}
    c.view.sent_to("a", c.beats["a"].load, 10)
    assert refused(c) is None
    c.placing["r1"] = 10
    assert refused(c) == "queued_requests"


def test_no_bound_and_no_instance_admit():
    c = client("admission.max_queued_requests=0", "admission.max_queued_tokens=0")
    c.beats = {"a": beat("a", 10_000, 10**9)}
    assert refused(c) is None
    c = client()
    c.beats = {}
    assert refused(c) is None  # nothing to measure: placement says whether anything can serve


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 4000), st.booleans()), min_size=1, max_size=6),
       st.integers(-1, 8), st.sampled_from([-1, 0, 500]), st.floats(1.0, 4.0))
def test_high_priority_is_never_refused_while_normal_is_admitted(loads, max_requests, max_tokens, factor):
    c = client(f"admission.max_queued_requests={max_requests}", f"admission.max_queued_tokens={max_tokens}",
               f"admission.high_priority_factor={factor}")
    try:
        c.beats = {f"i{k}": beat(f"i{k}", w, t, accepting=a) for k, (w, t, a) in enumerate(loads)}
        if refused(c, 0) is None:
            assert refused(c, 1) is None
        if refused(c, 1) is not None:
            assert refused(c, 0) is not None
    finally:
        _made.remove(c)
        c.ctx.destroy(linger=0)


@pytest.fixture(autouse=True)
def _close_contexts():
    yield
    while _made:
        _made.pop().ctx.destroy(linger=0)
