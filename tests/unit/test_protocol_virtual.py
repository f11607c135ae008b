"""The migration protocol end to end, in one process on virtual time (tests/support/cluster.py): the real
manager, instances (sim engine, llumlet, migrator) and the proxy's cluster client over in-process ZeroMQ, KV
moved in memory. Each race that tests/e2e/test_e2e_failures.py provokes with real timing (a commit later than the
source waits, a lost commit acknowledgement) is scripted here by fault injection on virtual time, so it goes
the same way on every run: one outcome is asserted, not either of two."""

from __future__ import annotations

import asyncio
import logging

import pytest

from daemons import wire
from daemons.watchdog import Faults
from tests.support.cluster import VirtualCluster

PACED = ["instance.min_step_s=0.02", "manager.dispatch_policy=flood"]  # flood: every request on i0
FENCING = PACED + ["migration.timeout_s=4", "migration.dest_idle_timeout_s=20"]


def ids(outs: list[wire.TokenOut]) -> list[int]:
    return [o.token_id for o in outs]


async def moved(c: VirtualCluster, s, dst: str) -> None:
    """Migrate the stream's request to ``dst``; it commits and the proxy follows it there."""
    reply = await c.migrate(s.request_id, dst)
    assert [o.outcome for o in reply.outcomes] == ["committed"], reply
    await c.until(lambda: s.instance_id == dst, 5, f"the proxy did not follow the request to {dst}")


def idle(c: VirtualCluster) -> dict[str, tuple[int, int, int]]:
    """(requests, blocks used, migrations in flight) of every instance."""
    out = {}
    for iid, inst in c.instances.items():
        load = inst.engine.load()
        out[iid] = (len(inst.requests), load.blocks_used, inst.migrator.busy)
    return out


def test_a_migrated_stream_equals_the_unmigrated_one_and_frees_the_source():
    async def scenario(c: VirtualCluster):
        s = await c.request(max_tokens=300)
        await c.tokens(s, 20)
        assert c.holders(s.request_id) == ["i0"]
        reply = await c.migrate(s.request_id, "i1")
        assert [(o.outcome, o.ended) for o in reply.outcomes] == [("committed", "committed")], reply
        assert c.holders(s.request_id) == ["i1"]
        assert ids(await c.result(s)) == c.expected(s, 300)
        await c.until(lambda: all(v == (0, 0, 0) for v in idle(c).values()), 5, f"not idle: {idle(c)}")

    VirtualCluster.run(scenario, sets=PACED)


def test_the_destinations_wait_to_commit_is_reported_as_the_join_part_of_the_downtime(monkeypatch):
    """The destination's commit waits 1.5 s (as behind a long engine step), within the source's timeout: the
    migration commits, and its outcome splits the downtime into that wait (join_ms) and the copy."""
    monkeypatch.setenv("LLUMNIX_FAULTS", "i1:slow_commit_s=1.5")

    async def scenario(c: VirtualCluster):
        s = await c.request(max_tokens=600)
        await c.tokens(s, 10)
        (o,) = (await c.migrate(s.request_id, "i1")).outcomes
        assert o.outcome == "committed", o
        assert 1500 <= o.join_ms <= o.downtime_ms, o
        assert o.downtime_ms - o.join_ms < 500, o  # the copy of one block, a round trip on virtual time
        assert ids(await c.result(s)) == c.expected(s, 600)

    VirtualCluster.run(scenario, sets=FENCING)


def test_a_commit_later_than_the_source_waits_leaves_exactly_one_copy_on_the_source(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="llumnix")  # the daemons' INFO lines, whatever ran in this process before
    """The destination's commit waits 10 s; the source gives up after 4 s, says so (MigAbort) and resumes
    under epoch+1. The destination sees the abort before its commit and refuses to commit."""
    monkeypatch.setenv("LLUMNIX_FAULTS", "i1:slow_commit_s=10")

    async def scenario(c: VirtualCluster):
        s = await c.request(max_tokens=1000)
        await c.tokens(s, 10)
        reply = await c.migrate(s.request_id, "i1")
        (o,) = reply.outcomes
        assert o.outcome == "aborted" and o.ended == "uncertain" and "did not answer the commit" in o.reason, o
        assert c.holders(s.request_id) == ["i0"]
        await c.until(lambda: c.instances["i1"].migrator.busy == 0, 30, "the destination's migration did not end")
        assert c.holders(s.request_id) == ["i0"] and idle(c)["i1"] == (0, 0, 0)
        assert ids(await c.result(s)) == c.expected(s, 1000)

    VirtualCluster.run(scenario, sets=FENCING)
    text = caplog.text
    assert "the source aborted the migration before the commit" in text
    assert "no answer to its last stage" in text


def test_a_lost_commit_acknowledgement_keeps_the_destination_and_fences_the_source(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="llumnix")  # the daemons' INFO lines, whatever ran in this process before
    """The destination commits (epoch+1) and tells the proxy, but its MigDone is lost; the source times out
    and resumes under epoch+1 too, and claims the request. The proxy heard the destination's claim first: it
    keeps that copy and aborts the source's by epoch."""
    monkeypatch.setenv("LLUMNIX_FAULTS", "i1:drop_commit_ack=1")

    async def scenario(c: VirtualCluster):
        s = await c.request(max_tokens=800)
        await c.tokens(s, 10)
        epoch = s.epoch
        reply = await c.migrate(s.request_id, "i1")
        (o,) = reply.outcomes
        assert o.outcome == "aborted" and o.ended == "uncertain" and "did not answer the commit" in o.reason, o
        await c.until(lambda: c.holders(s.request_id) == ["i1"], 10, "the source's copy was not aborted")
        assert s.instance_id == "i1" and s.epoch == epoch + 1
        assert ("i0", epoch + 1) in s.fenced
        assert ids(await c.result(s)) == c.expected(s, 800)
        await c.until(lambda: all(v == (0, 0, 0) for v in idle(c).values()), 5, f"not idle: {idle(c)}")

    VirtualCluster.run(scenario, sets=FENCING)
    assert "claims epoch" in caplog.text


@pytest.mark.parametrize("at", [0, 1, 50])
def test_a_request_migrated_twice_streams_every_index_once(at):
    async def scenario(c: VirtualCluster):
        s = await c.request(max_tokens=200)
        await c.tokens(s, at)
        for dst in ("i1", "i0"):
            reply = await c.migrate(s.request_id, dst)
            assert [o.outcome for o in reply.outcomes] == ["committed"], reply
            await c.tokens(s, s.next_index + 5)
        assert ids(await c.result(s)) == c.expected(s, 200)

    VirtualCluster.run(scenario, sets=PACED)


def test_a_destination_killed_right_after_the_commit_fails_the_stream_back_over_exactly(caplog):
    caplog.set_level(logging.INFO, logger="llumnix")  # the daemons' INFO lines, whatever ran in this process before
    async def scenario(c: VirtualCluster):
        s = await c.request(max_tokens=300)
        await c.tokens(s, 10)
        await moved(c, s, "i1")
        at_kill = s.next_index
        c.kill("i1")  # as kill -9: nothing said; the manager's heartbeat rules find it dead
        assert ids(await c.result(s)) == c.expected(s, 300)  # continued on i0 by re-prefill, exact tokens
        assert s.failovers == 1 and s.instance_id == "i0" and at_kill < 300
        await c.until(lambda: idle(c)["i0"] == (0, 0, 0), 5, f"not idle: {idle(c)}")

    VirtualCluster.run(scenario, sets=PACED)
    assert "instance i1 marked dead" in caplog.text
    assert "failed over to us" in caplog.text


SLOW_KV = 40_000.0  # bytes per virtual second: a prompt of a few blocks takes seconds to copy


def test_a_client_that_leaves_after_a_move_has_its_request_aborted_on_the_destination():
    async def scenario(c: VirtualCluster):
        s = await c.request(max_tokens=3000)
        await c.tokens(s, 5)
        await moved(c, s, "i1")
        c.proxy.finish(s)  # the client went away: the abort goes to where the request is now
        await c.until(lambda: all(v == (0, 0, 0) for v in idle(c).values()), 2, f"not freed: {idle(c)}")

    VirtualCluster.run(scenario, sets=PACED)


def test_a_request_finishing_during_pre_copy_aborts_the_migration_and_the_destination_releases():
    async def scenario(c: VirtualCluster):
        s = await c.request(max_tokens=60, prompt_tokens=600)  # 38 blocks: ~10 s to copy; it ends first
        await c.tokens(s, 3)
        reply = await c.migrate(s.request_id, "i1")
        (o,) = reply.outcomes
        assert o.outcome == "aborted" and o.ended == "aborted-src" and "finished" in o.reason and o.downtime_ms == 0, o
        assert ids(await c.result(s)) == c.expected(s, 60)
        await c.until(lambda: all(v == (0, 0, 0) for v in idle(c).values()), 30, f"not idle: {idle(c)}")

    VirtualCluster.run(scenario, sets=PACED + ["migration.timeout_s=30"], kv_bytes_per_s=SLOW_KV)


def test_a_destination_without_room_refuses_and_the_request_streams_on():
    async def scenario(c: VirtualCluster):
        s = await c.request(max_tokens=200, prompt_tokens=300)
        await c.tokens(s, 3)
        await c.join("small", "sim.num_blocks=4")
        reply = await c.migrate(s.request_id, "small")
        (o,) = reply.outcomes
        assert o.outcome == "aborted" and o.ended == "aborted-dst" and "no room" in o.reason, o
        assert c.holders(s.request_id) == ["i0"]
        assert ids(await c.result(s)) == c.expected(s, 200)
        assert idle(c)["small"] == (0, 0, 0)

    VirtualCluster.run(scenario, instances=1, sets=PACED)


async def copying(c: VirtualCluster, max_tokens: int = 250):
    """A request with a long prompt on i0, whose move to i1 has started copying: (the stream, the move)."""
    s = await c.request(max_tokens=max_tokens, prompt_tokens=600)
    await c.tokens(s, 3)
    move = asyncio.ensure_future(c.migrate(s.request_id, "i1"))
    await c.until(lambda: c.instances["i1"].migrator.busy > 0, 5, "the copy did not start")
    return s, move


def test_a_destination_killed_mid_copy_aborts_and_the_source_keeps_the_request():
    async def scenario(c: VirtualCluster):
        s, moving = await copying(c)
        c.kill("i1")
        reply = await moving
        outcome = reply.outcomes[0] if isinstance(reply, wire.MigrateReply) else None
        assert outcome is not None and (outcome.outcome, outcome.ended) == ("aborted", "aborted-dst"), reply
        assert c.holders(s.request_id) == ["i0"]
        assert ids(await c.result(s)) == c.expected(s, 250)
        await c.until(lambda: idle(c)["i0"] == (0, 0, 0), 5, f"not idle: {idle(c)}")

    VirtualCluster.run(scenario, sets=PACED + ["migration.timeout_s=3"], kv_bytes_per_s=SLOW_KV)


def test_a_source_killed_mid_copy_has_the_destination_release_and_the_stream_fail_over_exactly():
    async def scenario(c: VirtualCluster):
        s, moving = await copying(c)
        assert c.instances["i1"].engine.load().blocks_used > 0  # reserved
        c.kill("i0")
        reply = await moving
        assert isinstance(reply, wire.ErrorReply) and "died during the migration" in reply.message, reply
        # The proxy continued the stream on i1 by re-prefill; the migration's reservation there was released.
        assert ids(await c.result(s)) == c.expected(s, 250)
        assert s.failovers == 1 and s.instance_id == "i1"
        await c.until(lambda: idle(c)["i1"] == (0, 0, 0), 30, f"not idle: {idle(c)}")

    VirtualCluster.run(scenario, sets=PACED + ["migration.timeout_s=3"], kv_bytes_per_s=SLOW_KV)


async def _streams(c: VirtualCluster, n: int, max_tokens: int, prompt_tokens: int = 48) -> list:
    return [await c.request(max_tokens=max_tokens, prompt_tokens=prompt_tokens) for _ in range(n)]


def test_a_drain_moves_running_requests_out_and_gives_queued_ones_back_with_no_error():
    async def scenario(c: VirtualCluster):
        streams = await _streams(c, 9, 300)  # flood: all on i0, 6 running and 3 queued
        await c.until(lambda: c.instances["i0"].engine.load().running == 6, 5, "i0's slots did not fill")
        assert c.instances["i0"].engine.load().waiting == 3
        reply = c.manager.resched.lifecycle.on_drain(wire.DrainQuery(1, "i0"))
        assert isinstance(reply, wire.DrainReply) and reply.instance.draining
        await c.until(lambda: idle(c)["i0"] == (0, 0, 0), 30, f"i0 was not emptied: {idle(c)}")
        for s in streams:
            assert ids(await c.result(s)) == c.expected(s, 300), s.request_id
        assert sum(s.given_back for s in streams) == 3  # the queued ones went back to the proxy ...
        assert c.manager.resched.orders.outcomes["drain/committed"] == 6  # ... the running ones migrated
        later = await _streams(c, 4, 5)
        assert all(s.instance_id != "i0" for s in later)  # a drained instance takes nothing new
        for s in later:
            await c.result(s)

    VirtualCluster.run(scenario, instances=3, sets=PACED + ["sim.max_num_seqs=6"])


def test_draining_the_only_instance_keeps_its_queue_until_another_joins():
    async def scenario(c: VirtualCluster):
        streams = await _streams(c, 8, 600)
        await c.until(lambda: c.instances["i0"].engine.load().running == 4, 5, "i0's slots did not fill")
        c.manager.resched.lifecycle.on_drain(wire.DrainQuery(1, "i0"))
        await asyncio.sleep(1.0)
        assert c.instances["i0"].engine.load().waiting == 4  # nowhere else to go: giving them back would fail them
        assert sum(s.given_back for s in streams) == 0
        await c.join("i1")
        await c.until(lambda: idle(c)["i0"] == (0, 0, 0), 30, "the drain did not empty i0")
        for s in streams:
            assert ids(await c.result(s)) == c.expected(s, 600), s.request_id
        assert all(s.instance_id == "i1" for s in streams)
        assert sum(s.given_back for s in streams) + c.manager.resched.orders.outcomes["drain/committed"] == 8

    VirtualCluster.run(scenario, instances=1, sets=PACED + ["sim.max_num_seqs=4"])


def test_a_cordoned_instance_keeps_what_it_runs_and_takes_nothing_new():
    async def scenario(c: VirtualCluster):
        first = await _streams(c, 4, 300)
        await c.until(lambda: c.instances["i0"].engine.load().running == 4, 5, "i0's requests did not start")
        reply = c.manager.resched.lifecycle.on_drain(wire.DrainQuery(1, "i0", cordon_only=True))
        assert reply.instance.cordoned and not reply.instance.draining
        await c.until(lambda: all(v.instance_id != "i0" for v in c.proxy.alive()), 2, "the proxy never saw the cordon")
        later = await _streams(c, 6, 5)
        assert all(s.instance_id == "i1" for s in later)
        for s in later + first:
            await c.result(s)
        assert all(s.instance_id == "i0" and s.failovers == 0 for s in first)  # it kept what it ran

    VirtualCluster.run(scenario, sets=PACED)


def test_a_destination_with_another_kv_layout_refuses_with_the_difference():
    async def scenario(c: VirtualCluster):
        s = await c.request(max_tokens=200)
        await c.tokens(s, 3)
        await c.join("f32", "sim.kv_dtype=float32")
        reply = await c.migrate(s.request_id, "f32")
        (o,) = reply.outcomes
        assert o.outcome == "aborted" and "KV layout differs: KV dtype differs: source float16, destination float32" \
            in o.reason, o
        assert c.holders(s.request_id) == ["i0"] and idle(c)["f32"] == (0, 0, 0)
        assert ids(await c.result(s)) == c.expected(s, 200)

    VirtualCluster.run(scenario, instances=1, sets=PACED)


def test_a_drain_whose_moves_are_all_refused_backs_off_and_goes_on_once_one_can_land():
    """Every instance but the draining one refuses migrations: each drain order moves nothing, and the next
    waits twice as long (up to 30 s) instead of coming at once again and again; once a destination takes
    them, the drain goes on and empties the source."""
    async def scenario(c: VirtualCluster):
        streams = await _streams(c, 2, 3000)
        await c.until(lambda: c.instances["i0"].engine.load().running == 2, 5, "the streams did not start on i0")
        c.manager.resched.lifecycle.on_drain(wire.DrainQuery(1, "i0"))
        await asyncio.sleep(20.0)
        orders = c.manager.resched.orders.drain_backoff["i0"][0]  # in a row, each of its two requests refused
        # 0.2 s intervals doubled: orders at about 0, 0.4, 1.2, 2.8, 6, 12.4 s: six, not a hundred
        assert 4 <= orders <= 8 and c.manager.resched.orders.outcomes["drain/aborted"] == 2 * orders, orders
        c.instances["i1"].migrator.faults = Faults("i1", "")  # i1 takes them now
        await c.until(lambda: idle(c)["i0"] == (0, 0, 0), 40, f"i0 was not emptied: {idle(c)}")
        assert c.manager.resched.orders.outcomes["drain/committed"] == 2 and "i0" not in c.manager.resched.orders.drain_backoff
        for s in streams:
            assert ids(await c.result(s, within_s=300)) == c.expected(s, 3000), s.request_id

    VirtualCluster.run(scenario, sets=PACED + ["scheduling.migration_interval_s=0.2"],
                       faults={"i1": "refuse_migrations=1"})


def test_peer_sockets_and_kv_pairs_unused_for_long_are_closed_on_both_sides():
    """A fleet that replaces instances must not grow every instance's peer sockets, their tasks and KV
    pairs for ever: what no migration used for PEER_IDLE_S is closed at the next migration, on the source
    (socket, reader, watcher, pair) and on the destination (the pair it joined)."""
    from daemons.migration.peers import PEER_IDLE_S

    async def scenario(c: VirtualCluster):
        await c.join("i2")
        src = c.instances["i0"].migrator
        first = (await _streams(c, 1, 1000))[0]
        await moved(c, first, "i1")  # i0 -> i1: a socket and a pair on i0, a pair on i1
        await moved(c, first, "i0")  # back: i1 -> i0
        assert set(src.peers.sockets) == {"inproc://i1"} and set(c.instances["i0"].kv.pairs) >= {"i1"}
        tasks = src.peers.tasks["inproc://i1"]
        joined = [k for k in c.instances["i1"].kv.pairs if k.startswith("i0>")]
        assert joined
        assert ids(await c.result(first, within_s=600)) == c.expected(first, 1000)
        await asyncio.sleep(PEER_IDLE_S + 1)
        later = (await _streams(c, 1, 1000))[0]
        await moved(c, later, "i2")  # the next migration prunes what lay idle
        assert set(src.peers.sockets) == {"inproc://i2"} and "i1" not in c.instances["i0"].kv.pairs
        assert all(t.done() for t in tasks)
        await moved(c, later, "i1")  # i2 -> i1: i1 prunes the pair i0 had started with it
        assert not [k for k in c.instances["i1"].kv.pairs if k in joined]
        await moved(c, later, "i0")  # and a pruned peer is reached again when needed
        assert ids(await c.result(later, within_s=600)) == c.expected(later, 1000)

    VirtualCluster.run(scenario, sets=PACED)


def test_a_request_in_a_prefill_longer_than_the_deadlines_is_listed_and_moved_by_its_id():
    """A step longer than the manager's deadlines (a CPU prefill of thousands of tokens; a tensor-parallel step
    on a contended host): the listing and the lookup before ``migrate REQ`` are answered from the llumlet's
    request table at once, not at the step's end (which came after them: "not listed", "not on any instance")."""
    async def scenario(c: VirtualCluster):
        s = await c.request(max_tokens=50, prompt_tokens=64)
        await c.until(lambda: c.holders(s.request_id) == ["i0"], 5, "the request was not taken in")
        start = c.loop.time()
        listing = await c.manager.queries.on_requests(wire.RequestsQuery(0))
        assert c.loop.time() - start < 0.05  # no waiting for the 20 s step
        assert listing.unreachable == [], listing
        assert [(q.request_id, q.instance_id, q.state, q.prompt_tokens) for q in listing.requests] == [
            (s.request_id, "i0", "waiting", 64)]
        assert s.next_index == 0  # still in its prefill
        reply = await c.migrate(s.request_id, "i1")  # its lookup is answered at once; the move waits for the step
        assert [o.outcome for o in reply.outcomes] == ["committed"], reply
        assert c.holders(s.request_id) == ["i1"]
        assert ids(await c.result(s)) == c.expected(s, 50)

    VirtualCluster.run(scenario, sets=PACED + ["sim.prefill_ms=20000"])
