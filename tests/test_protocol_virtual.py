"""The migration protocol end to end, in one process on virtual time (tests/support/cluster.py): the real
manager, instances (sim engine, llumlet, migrator) and the proxy's cluster client over in-process ZeroMQ, KV
moved in memory. Each race that tests/test_e2e_failures.py provokes with real timing (a commit later than the
source waits, a lost commit acknowledgement) is scripted here by fault injection on virtual time, so it goes
the same way on every run: one outcome is asserted, not either of two."""

from __future__ import annotations

import pytest

from daemons import wire
from tests.support.cluster import VirtualCluster

PACED = ["instance.min_step_s=0.02", "manager.dispatch_policy=flood"]  # flood: every request on i0
FENCING = PACED + ["migration.timeout_s=4", "migration.dest_idle_timeout_s=20"]


def ids(outs: list[wire.TokenOut]) -> list[int]:
    return [o.token_id for o in outs]


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
        assert [o.outcome for o in reply.outcomes] == ["committed"], reply
        assert c.holders(s.request_id) == ["i1"]
        assert ids(await c.result(s)) == c.expected(s, 300)
        await c.until(lambda: all(v == (0, 0, 0) for v in idle(c).values()), 5, f"not idle: {idle(c)}")

    VirtualCluster.run(scenario, sets=PACED)


def test_a_commit_later_than_the_source_waits_leaves_exactly_one_copy_on_the_source(monkeypatch, caplog):
    """The destination's commit waits 10 s; the source gives up after 4 s, says so (MigAbort) and resumes
    under epoch+1. The destination sees the abort before its commit and refuses to commit."""
    monkeypatch.setenv("LLUMNIX_FAULTS", "i1:slow_commit_s=10")

    async def scenario(c: VirtualCluster):
        s = await c.request(max_tokens=1000)
        await c.tokens(s, 10)
        reply = await c.migrate(s.request_id, "i1")
        (o,) = reply.outcomes
        assert o.outcome == "aborted" and "did not answer the commit" in o.reason, o
        assert c.holders(s.request_id) == ["i0"]
        await c.until(lambda: c.instances["i1"].migrator.busy == 0, 30, "the destination's migration did not end")
        assert c.holders(s.request_id) == ["i0"] and idle(c)["i1"] == (0, 0, 0)
        assert ids(await c.result(s)) == c.expected(s, 1000)

    VirtualCluster.run(scenario, sets=FENCING)
    text = caplog.text
    assert "the source aborted the migration before the commit" in text
    assert "no answer to its last stage" in text


def test_a_lost_commit_acknowledgement_keeps_the_destination_and_fences_the_source(monkeypatch, caplog):
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
        assert o.outcome == "aborted" and "did not answer the commit" in o.reason, o
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
    async def scenario(c: VirtualCluster):
        s = await c.request(max_tokens=300)
        await c.tokens(s, 10)
        reply = await c.migrate(s.request_id, "i1")
        assert [o.outcome for o in reply.outcomes] == ["committed"], reply
        await c.until(lambda: s.instance_id == "i1", 5, "the proxy did not follow the request to i1")
        at_kill = s.next_index
        c.kill("i1")  # as kill -9: nothing said; the manager's heartbeat rules find it dead
        assert ids(await c.result(s)) == c.expected(s, 300)  # continued on i0 by re-prefill, exact tokens
        assert s.failovers == 1 and s.instance_id == "i0" and at_kill < 300
        await c.until(lambda: idle(c)["i0"] == (0, 0, 0), 5, f"not idle: {idle(c)}")

    VirtualCluster.run(scenario, sets=PACED)
    assert "instance i1 marked dead" in caplog.text
    assert "failed over to us" in caplog.text
