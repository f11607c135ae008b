"""The manager's protocol, in process and on virtual time (tests/support/manager.py): liveness (late is not
dead, a lost connection is, a stalled manager judges nobody), the dispatch ledger (a burst between two reports,
a view one report behind, a lost notice), restarts, drains and migration orders (a lost result, a source that
dies mid-order). Every race is scripted by event order; each scenario runs in milliseconds of real time."""

from __future__ import annotations

import asyncio
from collections import Counter

from daemons import wire
from daemons.links import DOWN
from tests.support.manager import Bench, capture


def test_a_silent_instance_whose_connection_is_up_is_late_not_dead_and_stays_in_dispatch(caplog):
    log = capture(caplog)

    async def scenario(b: Bench):
        i0, _ = b.instance("i0"), b.instance("i1")
        i0.reporting = False  # a long step holds its interpreter: no report leaves it
        await b.heartbeats(20)  # far past dead_after_missed (3) heartbeats
        assert b.state("i0") == "alive" and b.m.instances["i0"].late
        assert "i0" in b.dispatch(4)  # still dispatched to: freeness, not silence, decides
        i0.reporting = True
        await b.until(lambda: not b.m.instances["i0"].late, 2, "i0 is still late after reporting again")

    Bench.run(scenario)
    assert "i0 has not reported for" in log() and "late, not dead" in log()
    assert "i0 reports again (it was late)" in log()
    assert "marked dead" not in log()


def test_a_late_instance_is_dead_at_once_when_its_connection_goes_down(caplog):
    log = capture(caplog)

    async def scenario(b: Bench):
        i0, _ = b.instance("i0"), b.instance("i1")
        i0.reporting = False
        await b.heartbeats(10)
        assert b.state("i0") == "alive"
        b.links.set("i0", DOWN)  # its process is gone: the kernel closed the connection
        assert b.state("i0") == "dead"  # at once, not at the next heartbeat check
        assert set(b.dispatch(6)) == {"i1"}

    Bench.run(scenario)
    assert "instance i0 marked dead: its connection went down" in log()


def test_silence_with_the_connection_up_is_death_only_after_silent_dead_s(caplog):
    log = capture(caplog)

    async def scenario(b: Bench):
        i0 = b.instance("i0")
        i0.reporting = False
        took = await b.until(lambda: b.state("i0") == "dead", 10, "a wedged instance is never marked dead")
        assert 2.0 <= took <= 2.0 + b.heartbeat  # manager.silent_dead_s, judged every half heartbeat

    Bench.run(scenario, ["manager.silent_dead_s=2"])
    assert "connection up, but no report for" in log()


def test_silence_without_a_watched_connection_is_death_after_the_missed_heartbeats():
    async def scenario(b: Bench):
        i0 = b.instance("i0", link="unknown")  # its connection could not be watched
        i0.reporting = False
        took = await b.until(lambda: b.state("i0") == "dead", 10, "a silent instance is never marked dead")
        # Its last report was at registration: dead after 3 missed heartbeats, at the first check past them.
        assert 3 * b.heartbeat < took <= 3.5 * b.heartbeat + 1e-9

    Bench.run(scenario)


def test_a_stalled_manager_judges_nobody_until_it_has_read_what_queued_meanwhile(caplog):
    log = capture(caplog)

    async def scenario(b: Bench):
        i0 = b.instance("i0", link="unknown")  # silence alone would make it dead
        await b.heartbeats(1)
        i0.reporting = False  # what it sends now waits unread in the socket ...
        b.loop.stall(5.0)  # ... while the manager's own thread stalls (no CPU), far past dead_after
        while "manager stalled" not in log():
            await asyncio.sleep(0)  # its heartbeat watch wakes first, finds itself late, and skips this check
        assert b.state("i0") == "alive"
        await i0.report()  # then the queued report is read
        i0.reporting = True
        await b.heartbeats(2)
        assert b.state("i0") == "alive"

    Bench.run(scenario)
    assert "manager stalled for" in log()
    assert "marked dead" not in log()


def test_a_burst_between_two_reports_spreads_and_is_counted_once_when_the_reports_catch_up():
    async def scenario(b: Bench):
        i0, i1 = b.instance("i0"), b.instance("i1")
        await b.heartbeats(1.5)  # both have reported: equally free
        chosen = b.dispatch(8)  # one batch, no report in between: the ledger counts what it sent
        per = Counter(chosen)
        assert per == {"i0": 4, "i1": 4}, per
        assert b.view("i0").pending_dispatches == 4
        i0.took(per["i0"], blocks=4)
        i1.took(per["i1"] - 1, blocks=3)  # one of i1's is still on its way: its report is one behind
        await b.heartbeats(1.5)
        assert b.view("i0").pending_dispatches == 0  # the report covers all four: no double count
        assert b.view("i1").pending_dispatches == 1  # the one not yet seen still counts
        i1.took(1, blocks=1)
        await b.heartbeats(1.5)
        assert b.view("i1").pending_dispatches == 0
        assert b.m.dispatcher.dispatched_total == 8

    Bench.run(scenario)


def test_a_dispatch_its_instance_never_reports_stops_counting_after_the_ttl():
    async def scenario(b: Bench):
        b.instance("i0")
        b.dispatch(1)  # the request is lost on its way: i0's reports never count it
        await b.heartbeats(1)
        assert b.view("i0").pending_dispatches == 1
        took = await b.until(lambda: b.view("i0").pending_dispatches == 0, 10, "the lost dispatch counts forever")
        assert took <= 2.0 + b.heartbeat  # manager.pending_dispatch_ttl_s, retired with a report

    Bench.run(scenario, ["manager.pending_dispatch_ttl_s=2"])


def test_a_restarted_instance_is_asked_to_register_once_per_heartbeat_and_is_alive_again(caplog):
    log = capture(caplog)

    async def scenario(b: Bench):
        i0 = b.instance("i0")
        b.links.set("i0", DOWN)
        assert b.state("i0") == "dead"
        b.restart(i0)  # a new process under the same id, on a new socket, reporting before it registers
        for _ in range(5):
            await i0.report()  # five reports within one heartbeat
        asked = b.wire.sent(i0.ident, wire.RegisterAck)
        assert len(asked) == 1 and not asked[0].accepted and "register again" in asked[0].reason
        b._register(i0)
        b.links.set("i0", "up")
        assert b.state("i0") == "alive" and b.m.instances["i0"].identity == i0.ident

    Bench.run(scenario)
    assert "instance i0 re-registered" in log()


def test_a_drained_instance_is_told_and_skipped_and_its_requests_are_ordered_out():
    async def scenario(b: Bench):
        i0, i1 = b.instance("i0", running=2, blocks_used=20), b.instance("i1")
        reply = await b.ask(wire.DrainQuery(1, "i0"))
        assert isinstance(reply, wire.DrainReply) and reply.instance.draining
        told = b.wire.sent(i0.ident, wire.SetDraining)
        assert told and told[-1].draining and told[-1].reason == "operator"
        assert set(b.dispatch(4)) == {"i1"}
        await b.until(lambda: b.wire.sent(i0.ident, wire.MigrateStart), 2, "no drain order for i0")
        order = b.wire.sent(i0.ident, wire.MigrateStart)[0]
        assert order.drain and order.reason == "drain" and order.dst == "i1"
        assert not b.wire.sent(i1.ident, wire.MigrateStart)

    Bench.run(scenario, ["scheduling.migration_interval_s=0.2"])


def test_an_order_whose_result_is_lost_ends_after_its_timeout_and_frees_the_pair():
    async def scenario(b: Bench):
        i0, i1 = b.instance("i0", running=1, blocks_used=10), b.instance("i1")
        i0.migrate_after_s = None  # the source's MigrateResult never arrives
        started = b.now
        task = asyncio.ensure_future(b.m.resched.orders.order_migration(
            b.m.instances["i0"], wire.MigrateStart(0, dst="i1", dst_address=i1.address, count=1), 1))
        await b.heartbeats(1)
        assert b.m.instances["i0"].orders == 1 and b.m.instances["i1"].orders == 1
        result = await task
        assert result == "instance i0 did not report the migration's outcome in time"
        assert abs(b.now - started - b.m.resched.orders.migrate_timeout(1)) < 1e-6
        assert b.m.instances["i0"].orders == 0 and b.m.instances["i1"].orders == 0 and b.m.resched.orders.in_flight == 0

    Bench.run(scenario)


def test_an_order_whose_source_dies_fails_at_once_with_that_reason():
    async def scenario(b: Bench):
        i0, i1 = b.instance("i0", running=1, blocks_used=10), b.instance("i1")
        i0.migrate_after_s = 30.0
        task = asyncio.ensure_future(b.m.resched.orders.order_migration(
            b.m.instances["i0"], wire.MigrateStart(0, dst="i1", dst_address=i1.address, count=1), 1))
        await b.heartbeats(1)
        start = b.now
        b.links.set("i0", DOWN)
        assert await task == "source instance i0 died during the migration"
        assert b.now - start < b.heartbeat  # not after the order's timeout

    Bench.run(scenario)


def test_an_order_answered_in_time_reports_its_outcomes():
    async def scenario(b: Bench):
        _, i1 = b.instance("i0", running=1, blocks_used=10), b.instance("i1")
        result = await b.m.resched.orders.order_migration(
            b.m.instances["i0"], wire.MigrateStart(0, dst="i1", dst_address=i1.address, request_ids=["r1"]), 1)
        assert isinstance(result, wire.MigrateResult)
        assert [(o.request_id, o.outcome) for o in result.outcomes] == [("r1", "committed")]
        assert b.m.resched.orders.in_flight == 0

    Bench.run(scenario)


def test_a_request_listing_names_the_instances_that_did_not_answer():
    async def scenario(b: Bench):
        i0, i1 = b.instance("i0"), b.instance("i1")
        i0.list_requests = [wire.RequestLoad("r1", "running", 2, 20, 5)]
        i1.list_requests = None  # busy: never answers
        start = b.now
        reply = await b.ask(wire.RequestsQuery(7))
        assert isinstance(reply, wire.RequestsReply) and reply.query_id == 7
        assert [(r.request_id, r.instance_id) for r in reply.requests] == [("r1", "i0")]
        assert reply.unreachable == ["i1"]
        assert abs(b.now - start - b.m.mc.query_timeout_s) < 1e-6  # it waited its query timeout, no longer

    Bench.run(scenario)


def test_remove_drains_the_instance_then_tells_it_to_stop_and_answers_once_it_said_goodbye():
    async def scenario(b: Bench):
        i0, i1 = b.instance("i0", running=2, blocks_used=20), b.instance("i1")
        reply = await b.ask(wire.RemoveQuery(3, "i0", timeout_s=60))
        assert isinstance(reply, wire.RemoveReply) and reply.instance_id == "i0" and not reply.was_dead, reply
        kinds = [type(m).__name__ for m in (m for to, m in b.wire.log if to == i0.ident)]
        # Told to drain, ordered to move its requests out, and only then told to stop.
        assert kinds.index("SetDraining") < kinds.index("MigrateStart") < kinds.index("Shutdown"), kinds
        assert b.state("i0") == "stopping" and i1.load.running == 2
        assert not b.wire.sent(i1.ident, wire.Shutdown)

    Bench.run(scenario, ["scheduling.migration_interval_s=0.2"])


def test_draining_the_only_instance_tells_it_that_no_other_takes_its_queue():
    async def scenario(b: Bench):
        i0 = b.instance("i0", running=1, blocks_used=10)
        await b.ask(wire.DrainQuery(1, "i0"))
        told = b.wire.sent(i0.ident, wire.SetDraining)[-1]
        assert told.draining and not told.elsewhere  # it keeps its queue rather than give it back
        i1 = b.instance("i1")
        await b.until(lambda: b.wire.sent(i0.ident, wire.MigrateStart), 2, "no drain order once i1 joined")
        assert b.wire.sent(i0.ident, wire.MigrateStart)[0].dst == i1.iid

    Bench.run(scenario, ["scheduling.migration_interval_s=0.2"])


def test_a_restarted_manager_learns_drains_and_cordons_from_the_registrations_and_says_them_again():
    async def scenario(b: Bench):  # a fresh manager: the instances register with what they were told before
        i0 = b.instance("i0", told={"drain_reason": "operator", "uptime_s": 100.0})
        i1 = b.instance("i1", told={"cordoned": True, "uptime_s": 100.0})
        b.instance("i2", told={"uptime_s": 100.0})
        assert b.view("i0").draining and b.view("i0").drain_reason == "operator"
        assert b.view("i1").cordoned and not b.view("i1").draining
        assert b.wire.sent(i0.ident, wire.SetDraining)[-1].draining
        assert b.wire.sent(i1.ident, wire.SetDraining)[-1].cordoned
        assert set(b.dispatch(6)) == {"i2"}

    Bench.run(scenario)
