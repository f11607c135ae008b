"""Admission control over a proxy's view, without daemons: ``ClusterClient.admit`` on heartbeats built by hand."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemons import wire
from daemons.config import load_config
from daemons.proxy.cluster.client import ClusterClient, Overloaded


_made: list[ClusterClient] = []


def client(*sets: str) -> ClusterClient:
    c = ClusterClient(load_config(None, list(sets)))
    _made.append(c)
    return c


def beat(iid: str, waiting: int, waiting_tokens: int = 0, accepting: bool = True, healthy: bool = True,
         running: int = 8, blocks_used: int = 100) -> wire.Heartbeat:
    """A heartbeat of an instance with batch 8 and 100 blocks of 16 tokens: full by default."""
    load = wire.InstanceLoad(blocks_total=100, blocks_used=blocks_used, running=running, waiting=waiting,
                             batch_size=8, block_size=16, waiting_tokens=waiting_tokens)
    return wire.Heartbeat(iid, f"tcp://127.0.0.1:{1000 + len(iid)}", healthy, load, accepting)


def refused(c: ClusterClient, priority: int = 0) -> str | None:
    try:
        c.admit(priority)
    except Overloaded as exc:
        return exc.reason
    return None


NO_TOKEN_BOUND = "admission.max_queued_tokens=1000000"


def test_requests_bound_is_per_instance_that_takes_requests():
    c = client("admission.max_queued_requests=4", NO_TOKEN_BOUND)
    c.known.beats = {"a": beat("a", 3), "b": beat("b", 4)}
    assert refused(c) is None  # 7 waiting and this one: 8 <= 4 x 2
    c.known.beats["a"] = beat("a", 4)
    assert refused(c) == "queued_requests"  # 9
    c.known.beats["b"] = beat("b", 4, accepting=False)  # a cordoned instance is no capacity, and its queue not ours
    assert refused(c) == "queued_requests"  # 5 > 4 x 1
    c.known.beats["a"] = beat("a", 3)
    assert refused(c) is None


def test_free_batch_slots_take_requests_before_any_waits():
    c = client("admission.max_queued_requests=0", NO_TOKEN_BOUND)  # none may wait: only into a free slot
    c.known.beats = {"a": beat("a", 0, running=7)}
    assert refused(c) is None
    c.known.beats = {"a": beat("a", 0, running=8)}
    assert refused(c) == "queued_requests"
    c.known.beats = {"a": beat("a", 2, running=5)}  # 3 free slots: the 2 waiting (about to start) and this one
    assert refused(c) is None
    c.known.beats = {"a": beat("a", 0, running=8)}
    assert refused(c, priority=1) is None  # high priority may still wait, one per instance
    c.known.beats = {"a": beat("a", 1, running=8)}
    assert refused(c, priority=1) == "queued_requests"


def test_tokens_bound_defaults_to_eight_kv_caches():
    c = client("admission.max_queued_requests=1000")  # max_queued_tokens = -1: 8 KV caches, 8 x 100 x 16 tokens
    c.known.beats = {"a": beat("a", 1, waiting_tokens=12800)}
    assert refused(c) is None
    c.known.beats = {"a": beat("a", 1, waiting_tokens=12801)}
    assert refused(c) == "queued_tokens"
    assert refused(c, priority=1) is None  # x2 for high priority
    c.known.beats = {"a": beat("a", 1, waiting_tokens=12801, blocks_used=99)}  # one free block takes 16 of them
    assert refused(c) is None


def test_requests_bound_defaults_to_four_batches():
    c = client(NO_TOKEN_BOUND)  # max_queued_requests = -1: four batches of each instance (4 x 8)
    c.known.beats = {"a": beat("a", 31), "b": beat("b", 32)}
    assert refused(c) is None  # 63 and this one: 64 <= 64
    c.known.beats["a"] = beat("a", 32)
    assert refused(c) == "queued_requests"


def test_requests_waiting_here_and_unshown_dispatches_count():
    c = client("admission.max_queued_requests=2", NO_TOKEN_BOUND)
    c.known.beats = {"a": beat("a", 0)}
    c.view.sent_to("a", c.known.beats["a"].load, 10)
    assert refused(c) is None
    c.placing.add("r1", 10)
    assert refused(c) == "queued_requests"


def test_an_empty_view_admits():
    c = client()
    c.known.beats = {}
    assert refused(c) is None  # nothing to measure: placement says whether anything can serve


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 4000), st.booleans(), st.integers(0, 8),
                          st.integers(0, 100)), min_size=1, max_size=6),
       st.integers(-1, 8), st.sampled_from([-1, 0, 500]), st.floats(1.0, 4.0))
def test_high_priority_is_never_refused_while_normal_is_admitted(loads, max_requests, max_tokens, factor):
    c = client(f"admission.max_queued_requests={max_requests}", f"admission.max_queued_tokens={max_tokens}",
               f"admission.high_priority_factor={factor}")
    try:
        c.known.beats = {f"i{k}": beat(f"i{k}", w, t, accepting=a, running=r, blocks_used=u)
                   for k, (w, t, a, r, u) in enumerate(loads)}
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
