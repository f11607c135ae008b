"""The cross-host cost check in pairing: a balancing move to another host pays only when its KV crosses
the link faster than the source could recompute what the move saves it (daemons/policy/migration.py).
The manager itself, with two instances that report different hosts: tests/e2e/test_crossnode_manager.py."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from daemons import wire
from daemons.clock import Clock
from daemons.config import Config, MigrationConfig, SchedulingConfig
from daemons.policy import (INF, CrossNode, InstanceState, cross_node_budget_blocks, cross_node_saving_ms,
                            crosses_hosts, pair, select_migrants, transfer_ms)
from daemons.manager.orders import Orders
from daemons.manager.shared import Shared
from daemons.wire import RequestLoad

KV = 64 * 1024  # the kv-heavy shape: bytes per token
ON = CrossNode(bandwidth_gbps=10, kv_bytes_per_token=KV, recompute_ms_per_token=0.1, overhead_ms=50)


def loaded(iid: str, host: str, used: int = 900, running: int = 4, total: int = 1000) -> InstanceState:
    return InstanceState(iid, total, blocks_used=used, running=running, host=host)


def idle(iid: str, host: str, total: int = 1000) -> InstanceState:
    return InstanceState(iid, total, blocks_used=0, running=0, host=host)


def pairs_of(states, cost=ON, **kw):
    return pair(states, 0.0, 6.0, 8.0, 2, cross_node=cost, **kw)


def test_transfer_and_saving_figures():
    assert transfer_ms(1024, KV, 10) == pytest.approx(53.69, abs=0.01)  # 64 MiB at 10 Gbit/s
    assert transfer_ms(1024, KV, 1) == pytest.approx(536.9, abs=0.1)
    assert transfer_ms(1, KV, 0) == INF
    src = loaded("i0", "a", used=256, running=4)  # 64 blocks of 16 tokens a request: 1024 tokens
    assert cross_node_saving_ms(src, ON) == pytest.approx(102.4)


@pytest.mark.parametrize("gbps, blocks", [(25, 156.2), (10, 62.5), (1, 6.2)])
def test_budget_shrinks_with_the_bandwidth(gbps, blocks):
    src = loaded("i0", "a", used=256, running=4)  # average 1024 tokens: recompute 102.4 ms, less 50 ms overhead
    budget = cross_node_budget_blocks(src, dataclasses.replace(ON, bandwidth_gbps=gbps))
    assert budget == pytest.approx(blocks, abs=0.1)


def test_budget_is_unlimited_when_off_and_zero_when_nothing_pays():
    src = loaded("i0", "a", used=256, running=4)
    assert cross_node_budget_blocks(src, CrossNode()) == INF
    assert cross_node_budget_blocks(src, dataclasses.replace(ON, kv_bytes_per_token=0)) == INF  # KV size unknown
    assert cross_node_budget_blocks(src, dataclasses.replace(ON, bandwidth_gbps=0)) == INF
    short = loaded("i0", "a", used=16, running=4)  # 64-token requests: recomputing them beats any move's overhead
    assert cross_node_budget_blocks(short, ON) == 0.0


def test_crosses_hosts():
    assert crosses_hosts(idle("a0", "a"), idle("b0", "b"))
    assert not crosses_hosts(idle("a0", "a"), idle("a1", "a"))
    assert not crosses_hosts(idle("a0", ""), idle("b0", "b"))  # unknown host: taken as local


def test_cross_host_pair_is_capped_same_host_pair_is_not():
    src, remote = loaded("i0", "a", used=256 * 3, running=12, total=800), idle("i1", "b")
    [p] = pairs_of([src, remote])
    assert p.cross_node and p.budget_blocks == pytest.approx(62.5, abs=0.1)
    assert p.dst_free == pytest.approx(62.5 + 4, abs=0.1)  # the budget plus one copy's headroom
    local = idle("i1", "a")
    [q] = pairs_of([src, local])
    assert not q.cross_node and q.budget_blocks == INF and q.dst_free == 1000


def test_source_that_cannot_pay_pairs_nearer_by():
    # 1 Gbit/s, 64-token requests: nothing pays across hosts; the freer remote destination is passed over
    src = loaded("i0", "a", used=396, running=99, total=400)
    cost = dataclasses.replace(ON, bandwidth_gbps=1)
    [p] = pairs_of([src, idle("i1", "b", total=2000), idle("i2", "a")], cost)
    assert (p.src, p.dst, p.cross_node) == ("i0", "i2", False)
    assert pairs_of([src, idle("i1", "b")], cost) == []  # and with no local destination, no pair
    assert [p.dst for p in pairs_of([src, idle("i1", "b")], CrossNode())] == ["i1"]  # the check off: paired


def test_drains_cross_hosts_whatever_the_cost():
    src = dataclasses.replace(loaded("i0", "a", used=396, running=99, total=400), draining=True)
    [p] = pairs_of([src, idle("i1", "b")], dataclasses.replace(ON, bandwidth_gbps=1))
    assert p.drain and not p.cross_node and p.dst_free == 1000


def test_selection_skips_requests_larger_than_the_budget():
    # Source: 1024-token requests on average; at 10 Gbit/s a move pays up to 62 blocks (~1000 tokens).
    src = loaded("i0", "a", used=256 * 3, running=12, total=800)
    [p] = pairs_of([src, idle("i1", "b")])
    reqs = [RequestLoad("big", "running", 100, 1600, 0), RequestLoad("small", "running", 40, 640, 0),
            RequestLoad("q", "waiting", 0, 300, 0)]
    common = dict(src_usage=p.src_usage, src_blocks=800, dst_usage=p.dst_usage, dst_blocks=p.dst_blocks,
                  headroom=0.0, block_size=16, dst_free=p.dst_free)
    chosen = select_migrants("longest", reqs, 2, **common)
    assert [c.request_id for c in chosen] == ["small"]  # big's 100 blocks would take longer than recomputing
    # first-waiting: a queued request goes back through dispatch (no KV crosses): never limited
    assert [c.request_id for c in select_migrants("first-waiting", reqs, 2, **common)] == ["q", "small"]
    # the same pair on one host: the biggest goes first
    [q] = pairs_of([src, idle("i1", "a")])
    assert select_migrants("longest", reqs, 2, **dict(common, dst_free=q.dst_free))[0].request_id == "big"


hosts = st.sampled_from(["", "a", "b"])
states = st.lists(
    st.builds(InstanceState, instance_id=st.sampled_from([f"i{k}" for k in range(5)]),
              blocks_total=st.integers(1, 2048), blocks_used=st.integers(0, 2048), running=st.integers(0, 32),
              waiting=st.integers(0, 4), alive=st.booleans(), draining=st.booleans(), migrations=st.integers(0, 2),
              host=hosts),
    max_size=6, unique_by=lambda s: s.instance_id)


@settings(max_examples=300)
@given(states, st.sampled_from([0.5, 1, 10, 25, 100]), st.integers(0, 5))
def test_check_only_narrows_cross_host_pairs(ss, gbps, turn):
    cost = dataclasses.replace(ON, bandwidth_gbps=gbps)
    off = pair(ss, 0.0, 6.0, 8.0, 2, turn=turn)
    assert off == pair(ss, 0.0, 6.0, 8.0, 2, turn=turn, cross_node=CrossNode())  # off: as before
    one_host = [dataclasses.replace(s, host="a") for s in ss]
    assert pair(one_host, 0.0, 6.0, 8.0, 2, turn=turn, cross_node=cost) == pair(one_host, 0.0, 6.0, 8.0, 2, turn=turn)
    by_id = {s.instance_id: s for s in ss}
    for p in pair(ss, 0.0, 6.0, 8.0, 2, turn=turn, cross_node=cost):
        src, dst = by_id[p.src], by_id[p.dst]
        assert p.cross_node == (crosses_hosts(src, dst) and not src.draining)
        if p.cross_node:
            assert p.budget_blocks >= 1 and p.dst_free <= p.budget_blocks + 4
        else:
            assert p.budget_blocks == INF


def test_rescheduler_learns_kv_size_and_pairs_with_hosts():
    """The manager's wiring: hosts from registration, KV bytes per token from committed migrations."""
    src_load = wire.InstanceLoad(800, 768, 12, 0, 64, 16)
    dst_load = wire.InstanceLoad(1000, 0, 0, 0, 64, 16)

    def record(iid, host, load):
        info = SimpleNamespace(host=host, request_address=f"tcp://{iid}:1")
        return SimpleNamespace(instance_id=iid, state="alive", info=info, load=load)

    instances = {"i0": record("i0", "a", src_load), "i1": record("i1", "b", dst_load)}
    cluster = SimpleNamespace(  # the Cluster protocol (daemons/manager/view.py), as much as pairing reads
        instances=instances, get=instances.get, records=instances.values,
        state=lambda r, now: InstanceState(r.instance_id, r.load.blocks_total, blocks_used=r.load.blocks_used,
                                           running=r.load.running, block_size=r.load.block_size))
    spawned = []

    def orders(sc: SchedulingConfig) -> Orders:  # no manager loop: only what pair_once and learn touch
        shared = Shared(Config(scheduling=sc, migration=MigrationConfig()), cluster,
                        SimpleNamespace(migrating=True, request_selection="llumnix"), Clock(), send=None,
                        spawn=spawned.append)
        return Orders(shared, next_id=None, lookup=None, lookup_timeout_s=10.0)

    rs = orders(SchedulingConfig(cross_node_bandwidth_gbps=10.0))
    [p] = rs.pair_once()
    assert not p.cross_node  # KV size not known yet: no check
    rs.learn(instances["i0"], [wire.MigrationOutcome("r", "i0", "i1", "committed", blocks=9, bytes=9 * 16 * KV)])
    assert rs.cross_node().kv_bytes_per_token == KV
    [p] = rs.pair_once()
    assert p.cross_node and p.budget_blocks == pytest.approx((102.4 - 20) / transfer_ms(16, KV, 10), abs=0.1)
    for coro in spawned:
        coro.close()
    rs = orders(SchedulingConfig(cross_node_bandwidth_gbps=10.0, cross_node_kv_bytes_per_token=2 * KV))
    rs.learn(instances["i0"], [wire.MigrationOutcome("r", "i0", "i1", "committed", blocks=9, bytes=9 * 16 * KV)])
    assert rs.cross_node().kv_bytes_per_token == 2 * KV  # the setting wins over what was seen
