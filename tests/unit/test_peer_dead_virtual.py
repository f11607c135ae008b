"""A peer known dead is let go at once (issue #38: "failures lose nothing and strand nothing"). The manager marks
an instance dead and tells every other instance (wire.PeerDead); a destination releases at once the reservation
of a move whose source died, a source aborts at once the move whose destination died and resumes the request it
had suspended for it. Timeouts are set to a minute here, so that only the manager's word can end those waits
within the few virtual seconds these scenarios allow: the manager (virtual time, in-process ZeroMQ, which it
does not watch) finds a killed instance dead after manager.dead_after_missed heartbeats of silence."""

from __future__ import annotations

import asyncio
import logging

from daemons import wire
from daemons.links import DOWN
from daemons.migration.telemetry import M_RELEASED
from tests.support.cluster import VirtualCluster
from tests.support.manager import Bench, capture

PACED = ["instance.min_step_s=0.02", "manager.dispatch_policy=flood"]  # flood: every request on i0
PATIENT = PACED + ["migration.timeout_s=60", "migration.dest_idle_timeout_s=60"]
SLOW_KV = 40_000.0  # bytes per virtual second: a 600-token prompt's blocks take ~10 s to copy


def ids(outs: list[wire.TokenOut]) -> list[int]:
    return [o.token_id for o in outs]


def released(role: str, cause: str) -> float:
    return M_RELEASED.labels(role, cause)._value.get()


async def dead(c: VirtualCluster, iid: str) -> float:
    """Wait until the manager marks ``iid`` dead; when it did (virtual time)."""
    await c.until(lambda: c.manager.instances[iid].state == "dead", 10, f"{iid} was not marked dead")
    return c.loop.time()


def test_a_reservation_whose_source_is_declared_dead_is_released_at_once(caplog):
    caplog.set_level(logging.INFO, logger="llumnix")
    before = released("destination", "peer_dead")

    async def scenario(c: VirtualCluster):
        s = await c.request(max_tokens=250, prompt_tokens=600)
        await c.tokens(s, 3)
        moving = asyncio.ensure_future(c.migrate(s.request_id, "i1"))
        dst = c.instances["i1"]
        await c.until(lambda: dst.migrator.busy > 0 and dst.engine.load().blocks_used > 0, 5, "no reservation")
        c.kill("i0")
        at = await dead(c, "i0")
        # The copy had seconds to go and the lease is a minute: only the manager's word frees it this soon.
        took = await c.until(lambda: dst.migrator.busy == 0, 1, "the reservation was not released")
        assert took <= 0.05, took
        assert released("destination", "peer_dead") == before + 1
        assert not [k for k in c.instances["i1"].kv.pairs if k.startswith("i0>")]  # its KV pair closed too
        reply = await moving
        assert isinstance(reply, wire.ErrorReply) and "died during the migration" in reply.message, reply
        assert ids(await c.result(s)) == c.expected(s, 250)  # the proxy continued it on i1 by re-prefill
        assert s.failovers == 1 and s.instance_id == "i1"
        await c.until(lambda: (len(dst.requests), dst.engine.load().blocks_used) == (0, 0), 5, "i1 kept blocks")
        assert c.loop.time() - at < 30

    VirtualCluster.run(scenario, sets=PATIENT, kv_bytes_per_s=SLOW_KV)
    assert "the source was declared dead; releasing its reservation" in caplog.text


def test_a_request_suspended_for_a_destination_that_dies_resumes_with_identical_tokens():
    """The destination's commit waits (a long step there): the source has sent the last stage and holds the
    request suspended. The destination dies; the source resumes the request at once, and its stream goes on
    from the source with the tokens an unmigrated run streams."""
    before = released("source", "peer_dead")

    async def scenario(c: VirtualCluster):
        s = await c.request(max_tokens=400)
        await c.tokens(s, 10)
        moving = asyncio.ensure_future(c.migrate(s.request_id, "i1"))
        src = c.instances["i0"]
        await c.until(lambda: not src.engine.load().running and src.migrator.busy, 5, "never suspended")
        at_kill = s.next_index
        c.kill("i1")
        at = await dead(c, "i1")
        reply = await moving
        (o,) = reply.outcomes
        assert o.outcome == "aborted" and "declared dead" in o.reason, o
        assert c.loop.time() - at < 0.05  # not the minute of migration.timeout_s
        assert released("source", "peer_dead") == before + 1
        assert c.holders(s.request_id) == ["i0"]
        assert ids(await c.result(s)) == c.expected(s, 400)
        assert s.instance_id == "i0" and s.failovers == 0 and at_kill < 400
        assert src.migrator.peers.sockets == {}  # our socket to the dead peer is closed, not kept for 5 minutes
        await c.until(lambda: (len(src.requests), src.engine.load().blocks_used) == (0, 0), 5, "i0 kept blocks")

    VirtualCluster.run(scenario, sets=PATIENT, faults={"i1": "slow_commit_s=30"})


def test_moves_waiting_for_a_destination_that_dies_end_at_once_and_a_later_order_reaches_it_again():
    """Two moves to one destination (the second waits for the first: one at a time per pair). It dies: both
    abort at once, each request decoding on. Once an instance with that id is back, an order reaches it."""
    async def scenario(c: VirtualCluster):
        a = await c.request(max_tokens=600, prompt_tokens=600)
        b = await c.request(max_tokens=600, prompt_tokens=600)
        await c.tokens(b, 3)
        moves = [asyncio.ensure_future(c.migrate(s.request_id, "i1")) for s in (a, b)]
        await c.until(lambda: c.instances["i0"].migrator.busy == 2, 5, "the moves did not start")
        c.kill("i1")
        at = await dead(c, "i1")
        for m in moves:
            (o,) = (await m).outcomes
            assert o.outcome == "aborted" and "declared dead" in o.reason, o
        assert c.loop.time() - at < 0.05
        assert c.holders(a.request_id) == c.holders(b.request_id) == ["i0"]
        await c.join("i1")  # back (same id and address)
        await c.until(lambda: c.manager.instances["i1"].state == "alive", 5, "the manager did not see i1 back")
        reply = await c.migrate(a.request_id, "i1")
        assert isinstance(reply, wire.MigrateReply), reply
        assert [o.outcome for o in reply.outcomes] == ["committed"], reply
        for s in (a, b):
            assert ids(await c.result(s, within_s=300)) == c.expected(s, 600)

    VirtualCluster.run(scenario, sets=PATIENT, kv_bytes_per_s=SLOW_KV)


def test_the_manager_tells_every_live_instance_when_one_is_marked_dead(caplog):
    log = capture(caplog)

    async def scenario(b: Bench):
        i0, i1, i2 = b.instance("i0"), b.instance("i1"), b.instance("i2")
        i2.reporting = False
        await b.until(lambda: b.state("i2") == "dead", 10, "i2 was not marked dead")
        i0.reporting = False  # later dead too: the dead one is told nothing
        await b.until(lambda: b.state("i0") == "dead", 10, "i0 was not marked dead")
        told = {i.iid: [(m.instance_id, m.request_address) for m in b.wire.sent(i.ident, wire.PeerDead)]
                for i in (i0, i1, i2)}
        assert told == {"i0": [("i2", i2.address)], "i1": [("i2", i2.address), ("i0", i0.address)], "i2": []}

    Bench.run(scenario, ["manager.silent_dead_s=1"])
    assert "instance i2 marked dead" in log()


# ---------------------------------------------------------------- links made ahead (daemons/migration/warmup.py)


def test_links_made_ahead_are_the_ones_the_first_move_uses_and_survive_pruning():
    from daemons.migration.peers import PEER_IDLE_S

    async def scenario(c: VirtualCluster):
        src, dst = c.instances["i0"], c.instances["i1"]
        src.migrator.link("i1", "inproc://i1")
        await c.until(lambda: src.migrator.warmup.links["i1"].state == "ready", 5, "the links were not made")
        key = src.kv.pairs["i1"].key
        assert list(dst.kv.pairs) == [key] and "inproc://i1" in src.migrator.peers.sockets
        await asyncio.sleep(PEER_IDLE_S + 1)  # unused for longer than peers are kept ...
        s = await c.request(max_tokens=300)
        await c.tokens(s, 5)
        reply = await c.migrate(s.request_id, "i1")  # ... the first move uses them: no new pair at either end
        assert [o.outcome for o in reply.outcomes] == ["committed"], reply
        assert src.kv.pairs["i1"].key == key and list(dst.kv.pairs) == [key]
        assert ids(await c.result(s)) == c.expected(s, 300)
        c.kill("i1")  # declared dead: what was kept for it goes
        await dead(c, "i1")
        await c.until(lambda: "i1" not in src.kv.pairs and not src.migrator.peers.kept, 1, "kept after death")
        assert "i1" not in src.migrator.warmup.links

    VirtualCluster.run(scenario, sets=PACED)


def test_a_link_to_an_instance_with_another_kv_layout_is_refused_ahead_with_the_difference():
    async def scenario(c: VirtualCluster):
        await c.join("f32", "sim.kv_dtype=float32")
        src = c.instances["i0"]
        src.migrator.link("f32", "inproc://f32")
        await c.until(lambda: src.migrator.warmup.links["f32"].state != "linking", 5, "no answer")
        link = src.migrator.warmup.links["f32"]
        assert (link.state, link.reason) == ("refused", "KV layout differs: KV dtype differs: source float16, "
                                                        "destination float32"), link
        assert not c.instances["f32"].kv.pairs and not src.migrator.peers.kept

    VirtualCluster.run(scenario, instances=1, sets=PACED)


def test_an_instance_that_stops_is_told_to_the_others_once_forgotten(caplog):
    log = capture(caplog)

    async def scenario(b: Bench):
        i0, i1 = b.instance("i0"), b.instance("i1")
        await b.deliver(i1.ident, wire.Goodbye("i1", "SIGTERM"))
        i1.reporting = False
        assert not b.wire.sent(i0.ident, wire.PeerDead)  # stopping still serves what it has
        b.links.set("i1", DOWN)  # its process exited
        await b.until(lambda: "i1" not in b.m.instances, 10, "i1 was not forgotten")
        assert [(m.instance_id, m.request_address) for m in b.wire.sent(i0.ident, wire.PeerDead)] == [
            ("i1", i1.address)]

    Bench.run(scenario)
    assert "instance i1 forgotten: it stopped" in log()
