"""The manager's request listing and lookup (``llumnixctl requests``, ``describe``, ``migrate REQ``), in-process:
instances' answers are scripted in the order that a migration racing the query produces."""

from __future__ import annotations

import asyncio

from daemons import wire
from daemons.config import load_config
from daemons.manager import InstanceRecord, Manager

LOAD = wire.InstanceLoad(blocks_total=100, blocks_used=0, running=0, waiting=0, batch_size=8, block_size=16)


class Recorder:
    """Stands in for the manager's ROUTER socket: what it sends, (instance id, message), in order."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, wire.Message]] = []

    def send_multipart(self, frames, flags: int = 0) -> None:
        self.sent.append((bytes(frames[0]).decode(), wire.decode(bytes(frames[1]))))


class Scripted:
    """A manager whose sends to instances are recorded instead of sent."""

    def __init__(self, *ids: str):
        sock = Recorder()
        self.m = Manager(load_config(None, ["manager.query_timeout_s=0.2"]), sock=sock)
        self.sent = sock.sent
        for iid in ids:
            info = wire.Register(iid, "h", 1, self.address(iid), "sim", "m", LOAD)
            self.m.cluster.put(InstanceRecord(info=info, identity=iid.encode(), load=LOAD, last_seen=0.0), 0.0)

    @staticmethod
    def address(iid: str) -> str:
        return f"tcp://127.0.0.1:{7000 + int(iid[1:])}"

    async def asked(self, iid: str, n: int) -> int:
        """The query id of the ``n``-th ListRequests sent to ``iid`` (1-based), once it is sent."""
        while True:
            qids = [msg.query_id for to, msg in self.sent if to == iid and isinstance(msg, wire.ListRequests)]
            if len(qids) >= n:
                return qids[n - 1]
            await asyncio.sleep(0)

    def close(self) -> None:
        self.m.ctx.destroy(linger=0)


def row(rid: str, state: str = "running") -> wire.RequestLoad:
    return wire.RequestLoad(rid, state, blocks=2, prompt_tokens=20, output_tokens=5)


def test_a_request_that_migrates_while_the_query_is_out_is_listed_by_its_new_owner():
    async def scenario():
        s = Scripted("i0", "i1")
        try:
            task = asyncio.create_task(s.m.queries.on_requests(wire.RequestsQuery(1)))
            q0, q1 = await s.asked("i0", 1), await s.asked("i1", 1)
            s.m.queries.on_request_list(wire.RequestList(q1, "i1", []))  # the destination, before its commit
            s.m.queries.on_request_list(wire.RequestList(q0, "i0", [], {"r": s.address("i1")}))  # the source, after it
            again = await s.asked("i1", 2)  # asked again: the source names it among its moves
            s.m.queries.on_request_list(wire.RequestList(again, "i1", [row("r")]))
            reply = await asyncio.wait_for(task, 5)
        finally:
            s.close()
        return reply

    reply = asyncio.run(scenario())
    assert [(q.request_id, q.instance_id, q.state) for q in reply.requests] == [("r", "i1", "running")]
    assert reply.unreachable == []


def test_a_row_from_both_ends_keeps_the_new_owners():
    async def scenario():
        s = Scripted("i0", "i1")
        try:
            task = asyncio.create_task(s.m.queries.on_requests(wire.RequestsQuery(1)))
            q0, q1 = await s.asked("i0", 1), await s.asked("i1", 1)
            s.m.queries.on_request_list(wire.RequestList(q0, "i0", [row("r", "migrating")]))  # before the commit
            s.m.queries.on_request_list(wire.RequestList(q1, "i1", [row("r")]))  # after it
            return await asyncio.wait_for(task, 5)
        finally:
            s.close()

    reply = asyncio.run(scenario())
    assert [(q.instance_id, q.state) for q in reply.requests] == [("i1", "running")]


def test_a_lookup_ends_at_the_instance_that_holds_it():
    async def scenario():
        s = Scripted("i0", "i1")
        try:
            task = asyncio.create_task(s.m.queries.on_requests(wire.RequestsQuery(1), want="r"))
            q1 = await s.asked("i1", 1)
            # i0 never answers: a lookup would wait for it for lookup_timeout() (10 s), past the 5 s below
            assert s.m.queries.lookup_timeout() >= 10
            s.m.queries.on_request_list(wire.RequestList(q1, "i1", [row("r")]))  # ends the lookup
            return await asyncio.wait_for(task, 5)
        finally:
            s.close()

    reply = asyncio.run(scenario())
    assert [(q.request_id, q.instance_id) for q in reply.requests] == [("r", "i1")]
    assert reply.unreachable == ["i0"]


def test_migrate_names_a_request_in_the_middle_of_a_migration():
    async def scenario():
        s = Scripted("i0", "i1", "i2")
        try:
            task = asyncio.create_task(s.m.resched.orders.on_migrate(wire.MigrateQuery(9, dst="i2", request_id="r")))
            qs = [await s.asked(i, 1) for i in ("i0", "i1", "i2")]
            s.m.queries.on_request_list(wire.RequestList(qs[0], "i0", [row("r", "migrating")]))
            s.m.queries.on_request_list(wire.RequestList(qs[1], "i1", []))
            s.m.queries.on_request_list(wire.RequestList(qs[2], "i2", []))
            return await asyncio.wait_for(task, 5)
        finally:
            s.close()

    reply = asyncio.run(scenario())
    assert isinstance(reply, wire.ErrorReply) and "migrating out of i0 right now" in reply.message, reply
