"""Admin queries that fan out to the instances: which requests run where (``llumnixctl requests``,
``describe``), and the lookup of one request before an operator's migration."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable

from daemons import wire
from daemons.config import ManagerConfig
from daemons.manager.records import InstanceRecord
from daemons.manager.view import ClusterView

LOOKUP_TIMEOUT_S = 10.0  # how long a lookup of one request waits for busy instances (it ends once one holds it)


def lookup_timeout(mc: ManagerConfig) -> float:
    return max(mc.query_timeout_s, LOOKUP_TIMEOUT_S)


@dataclass
class Fanout:
    """A ListRequests query out to instances."""

    done: asyncio.Future
    missing: set[str]  # instances that have not answered yet
    results: dict[str, wire.RequestList]  # answers by instance id
    want: str = ""  # one request id: done as soon as an instance holds it


class Queries:
    """Owns the fan-outs out (by query id)."""

    def __init__(self, cluster: ClusterView, mc: ManagerConfig, send: Callable[[InstanceRecord, wire.Message], None],
                 next_id: Callable[[], int]):
        """``send``: to an instance. ``next_id``: a query id (shared with the migration orders)."""
        self.cluster = cluster
        self.mc = mc
        self.send = send
        self.next_id = next_id
        self.fanouts: dict[int, Fanout] = {}

    async def on_requests(self, msg: wire.RequestsQuery, want: str = "") -> wire.RequestsReply:
        """Every request on every live instance. A request that migrated while the query was out can be in
        neither answer (the destination answered before its commit, the source after it): the source names
        it among its recent moves, and the destination is asked again. ``want``: one request id; the answer
        may stop at the first instance that holds it, and busy instances are given longer (a lookup before
        an operator's migration must not miss a request on an instance in the middle of a long step)."""
        alive = {r.instance_id: r for r in self.cluster.records() if r.state != "dead"}  # stopping ones still serve
        timeout = self.lookup_timeout() if want else self.mc.query_timeout_s
        results, missing = await self._list(alive, timeout, want)
        listed = {q.request_id for rl in results.values() for q in rl.requests}
        if not (want and want in listed):
            by_address = {r.info.request_address: r for r in alive.values()}
            again = {}
            for rl in list(results.values()):
                for rid, address in rl.moved.items():
                    dst = by_address.get(address)
                    if rid not in listed and (not want or rid == want) and dst is not None:
                        again[dst.instance_id] = dst
            if again:
                more, _ = await self._list(again, timeout, want)
                results.update(more)
        rows: dict[str, wire.RequestInfo] = {}
        for rl in results.values():
            for q in rl.requests:
                seen = rows.get(q.request_id)
                if seen is not None and seen.state != "migrating":
                    continue  # listed by both ends of a migration that committed meanwhile: the new owner's row
                rows[q.request_id] = wire.RequestInfo(
                    request_id=q.request_id, instance_id=rl.instance_id, state=q.state, output_tokens=q.output_tokens,
                    prompt_tokens=q.prompt_tokens, blocks=q.blocks, priority=q.priority)
        return wire.RequestsReply(msg.query_id, requests=list(rows.values()), unreachable=sorted(missing))

    async def lookup(self, request_id: str) -> wire.RequestsReply:
        """Where one request is (before an operator's migration of it)."""
        return await self.on_requests(wire.RequestsQuery(0), want=request_id)

    def lookup_timeout(self) -> float:
        return lookup_timeout(self.mc)

    async def _list(self, instances: dict[str, InstanceRecord], timeout: float,
                    want: str = "") -> tuple[dict[str, wire.RequestList], set[str]]:
        """Ask ``instances`` for their requests; (answers by instance, those that did not answer in time)."""
        qid = self.next_id()
        fan = Fanout(asyncio.get_running_loop().create_future(), set(instances), {}, want)
        self.fanouts[qid] = fan
        for r in instances.values():
            self.send(r, wire.ListRequests(qid))
        try:
            if instances:
                await asyncio.wait_for(asyncio.shield(fan.done), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            self.fanouts.pop(qid, None)
        return fan.results, fan.missing

    def on_request_list(self, msg: wire.RequestList) -> None:
        fan = self.fanouts.get(msg.query_id)
        if fan is None:
            return  # late answer to a finished query
        if msg.instance_id in fan.missing:
            fan.missing.discard(msg.instance_id)
            fan.results[msg.instance_id] = msg
        found = fan.want and any(q.request_id == fan.want and q.state != "migrating" for q in msg.requests)
        if (not fan.missing or found) and not fan.done.done():
            fan.done.set_result(None)
