"""The manager's parts, each built alone with only what its constructor asks for (daemons/manager/__init__.py
lists them): the cluster view and its verbs, the policies in force, the registry, migration orders and the
lifecycle, with sends recorded instead of sent. The whole manager on virtual time: test_manager_core.py."""

from __future__ import annotations

import asyncio

import pytest

from daemons import wire
from daemons.clock import VirtualTimeLoop
from daemons.config import load_config
from daemons.manager.launcher import Launcher
from daemons.manager.lifecycle import Lifecycle
from daemons.manager.orders import Orders
from daemons.manager.records import InstanceRecord, Policies
from daemons.manager.registry import Registry
from daemons.manager.rescheduler import Rescheduler
from daemons.manager.shared import Shared
from daemons.manager.view import ClusterView

CFG = load_config(None, [])
LOAD = wire.InstanceLoad(blocks_total=100, blocks_used=0, running=0, waiting=0, batch_size=8, block_size=16)


def register(iid: str, **kw) -> wire.Register:
    return wire.Register(iid, "h", 1, f"inproc://{iid}", "sim", "m", LOAD, **kw)


def record(iid: str) -> InstanceRecord:
    return InstanceRecord(info=register(iid), identity=iid.encode(), load=LOAD, last_seen=0.0)


def cluster_of(*ids: str) -> ClusterView:
    view = ClusterView(CFG.scheduling, VirtualTimeLoop().clock())
    for iid in ids:
        view.put(record(iid), 0.0)
    return view


def test_the_cluster_view_is_the_one_writer_of_its_records_and_tells_who_forgets():
    view, forgotten = cluster_of("i0", "i1"), []
    view.on_forget(lambda r: forgotten.append(r.instance_id))
    with pytest.raises(TypeError):
        view.instances["i2"] = record("i2")  # read-only to everyone else
    r0 = view.get("i0")
    before = view.state(r0, 0.0)
    view.set_flags(r0, drain_reason="operator")
    assert r0.draining and view.state(r0, 0.0) is not before and view.state(r0, 0.0).draining
    view.count_orders("i0", 2)
    view.count_orders("i0", -5)
    view.count_orders("gone", 1)  # an instance forgotten meanwhile: nothing to count
    assert r0.orders == 0
    view.forget(r0, "test")
    assert forgotten == ["i0"] and view.get("i0") is None and [r.instance_id for r in view.records()] == ["i1"]


def test_a_policy_change_naming_an_unknown_policy_changes_none():
    p = Policies(CFG)
    before = (p.dispatch_policy, p.pairing_policy)
    reply = p.change(wire.PolicyQuery(1, dispatch_policy="flood", pairing_policy="nonsense"))
    assert isinstance(reply, wire.ErrorReply) and "unknown pairing policy 'nonsense'" in reply.message
    assert (p.dispatch_policy, p.pairing_policy) == before
    reply = p.change(wire.PolicyQuery(2, dispatch_policy="flood"))
    assert isinstance(reply, wire.PolicyReply) and reply.dispatch_policy == "flood" == p.dispatch_policy
    assert not p.migrating and not reply.migrating  # flood never balances


def test_the_registry_watches_a_new_instance_and_hands_it_to_the_rescheduler():
    view, watched, joined = cluster_of(), [], []
    reg = Registry(view, VirtualTimeLoop().clock(), CFG.manager, CFG.scheduling, send=lambda r, m: None,
                   watch=lambda rec, old: watched.append((rec.instance_id, old)),
                   joined=lambda rec, new: joined.append((rec.instance_id, new)))
    assert reg.on_register(b"a", register("i0"), "instance:a").accepted
    assert view.get("i0").principal == "instance:a" and watched == [("i0", None)] and joined == [("i0", True)]
    # Another process under the live instance's id (another pid): it waits, and its goodbye is not i0's.
    assert reg.on_register(b"b", wire.Register("i0", "h", 2, "inproc://i0", "sim", "m", LOAD), "instance:a") is None
    assert reg.is_duplicate(b"b")
    reg.on_goodbye(b"b", wire.Goodbye("i0"))
    assert view.get("i0").state == "alive"
    reg.on_goodbye(b"a", wire.Goodbye("i0"))
    assert view.get("i0").state == "stopping"


def test_an_order_counts_on_both_instances_until_its_result_and_fails_at_once_when_its_source_dies():
    async def scenario():
        view, sent, ids = cluster_of("i0", "i1"), [], iter(range(1, 100))
        orders = Orders(Shared(CFG, view, Policies(CFG), VirtualTimeLoop().clock(),
                               send=lambda r, m: sent.append((r.instance_id, m)), spawn=asyncio.ensure_future),
                        next_id=lambda: next(ids), lookup=None, lookup_timeout_s=10.0)
        start = wire.MigrateStart(0, dst="i1", dst_address="inproc://i1", count=2)
        task = asyncio.ensure_future(orders.order_migration(view.get("i0"), start, 2))
        await asyncio.sleep(0)
        [(to, msg)] = sent
        assert to == "i0" and msg.query_id == 1 and view.get("i0").orders == view.get("i1").orders == 2
        outcomes = [wire.MigrationOutcome("r", "i0", "i1", "committed")]
        orders.on_migrate_result(wire.MigrateResult(1, "i0", outcomes))
        assert (await task).outcomes == outcomes
        assert view.get("i0").orders == view.get("i1").orders == 0 and orders.in_flight == 0
        task = asyncio.ensure_future(orders.order_migration(view.get("i0"), start, 1))
        await asyncio.sleep(0)
        orders.fail_migrations_from("i0")
        assert await task == "source instance i0 died during the migration"

    asyncio.run(scenario())


def test_a_drain_sets_the_flag_tells_the_instance_and_restarts_its_backoff():
    view, sent, drained = cluster_of("i0"), [], []
    clock = VirtualTimeLoop().clock()
    launcher = Launcher(CFG.scaling, CFG.manager.address, lambda: set(view.instances), clock)
    life = Lifecycle(Shared(CFG, view, Policies(CFG), clock, send=lambda r, m: sent.append(m), spawn=None), launcher,
                     new_drain=drained.append)
    reply = life.on_drain(wire.DrainQuery(1, "i0"))
    assert isinstance(reply, wire.DrainReply) and reply.instance.drain_reason == "operator"
    assert drained == ["i0"] and sent == [wire.SetDraining(True, "operator", False, False)]  # nobody else to take it
    assert isinstance(life.on_drain(wire.DrainQuery(2, "nope")), wire.ErrorReply)
    life.on_drain(wire.DrainQuery(3, "i0", drain=False))
    assert not view.get("i0").draining and sent[-1].draining is False


def test_the_rescheduler_is_built_without_the_manager():
    view = cluster_of("i0")
    shared = Shared(CFG, view, Policies(CFG), VirtualTimeLoop().clock(), send=lambda r, m: None,
                    spawn=lambda c: c.close())
    r = Rescheduler(shared, next_id=lambda: 1, lookup=None, lookup_timeout_s=10.0, started=0.0)
    assert r.counters() == {"ordered_migrations": {}, "scale_outs": 0, "scale_ins": 0, "launching": 0}
    assert r.plan(0.0) == []  # one idle instance: nothing to pair
