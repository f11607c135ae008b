"""Admin queries that fan out to the instances (which requests run where), and run-time policy changes."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from daemons import policy, wire
from daemons.manager.records import InstanceRecord

log = logging.getLogger("llumnix.manager")

LOOKUP_TIMEOUT_S = 10.0  # how long a lookup of one request waits for busy instances (it ends once one holds it)


@dataclass
class Fanout:
    """A ListRequests query out to instances."""

    done: asyncio.Future
    missing: set[str]  # instances that have not answered yet
    results: dict[str, wire.RequestList]  # answers by instance id
    want: str = ""  # one request id: done as soon as an instance holds it


class QueriesMixin:
    """Of the Manager: owns ``_fanouts`` and ``query_ids``; ``on_policy`` sets the policies in force."""

    async def on_requests(self, msg: wire.RequestsQuery, want: str = "") -> wire.RequestsReply:
        """Every request on every live instance. A request that migrated while the query was out can be in
        neither answer (the destination answered before its commit, the source after it): the source names
        it among its recent moves, and the destination is asked again. ``want``: one request id; the answer
        may stop at the first instance that holds it, and busy instances are given longer (a lookup before
        an operator's migration must not miss a request on an instance in the middle of a long step)."""
        alive = {r.instance_id: r for r in self.instances.values() if r.state != "dead"}  # stopping ones still serve
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

    def lookup_timeout(self) -> float:
        return max(self.mc.query_timeout_s, LOOKUP_TIMEOUT_S)

    async def _list(self, instances: dict[str, InstanceRecord], timeout: float,
                    want: str = "") -> tuple[dict[str, wire.RequestList], set[str]]:
        """Ask ``instances`` for their requests; (answers by instance, those that did not answer in time)."""
        qid = next(self.query_ids)
        fan = Fanout(asyncio.get_running_loop().create_future(), set(instances), {}, want)
        self._fanouts[qid] = fan
        for r in instances.values():
            self.send(r, wire.ListRequests(qid))
        try:
            if instances:
                await asyncio.wait_for(asyncio.shield(fan.done), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            self._fanouts.pop(qid, None)
        return fan.results, fan.missing

    def on_request_list(self, msg: wire.RequestList) -> None:
        fan = self._fanouts.get(msg.query_id)
        if fan is None:
            return  # late answer to a finished query
        if msg.instance_id in fan.missing:
            fan.missing.discard(msg.instance_id)
            fan.results[msg.instance_id] = msg
        found = fan.want and any(q.request_id == fan.want and q.state != "migrating" for q in msg.requests)
        if (not fan.missing or found) and not fan.done.done():
            fan.done.set_result(None)

    def on_policy(self, msg: wire.PolicyQuery) -> wire.Message:
        changes = {"dispatch_policy": (msg.dispatch_policy, policy.DISPATCH_POLICIES),
                   "pairing_policy": (msg.pairing_policy, policy.PAIRING_POLICIES),
                   "request_selection": (msg.request_selection, policy.SELECTION_POLICIES),
                   "scaling_policy": (msg.scaling_policy, policy.SCALING_POLICIES)}
        for name, (value, known) in changes.items():
            if value and value not in known:
                return wire.ErrorReply(msg.query_id, f"unknown {name.replace('_', ' ')} {value!r} (known: {', '.join(known)})")
        for name, (value, _) in changes.items():
            if value and value != getattr(self, name):
                log.info("%s: %s -> %s (llumnixctl policy)", name.replace("_", " "), getattr(self, name), value)
                setattr(self, name, value)
        return wire.PolicyReply(msg.query_id, self.dispatch_policy, self.pairing_policy, self.request_selection,
                                self.scaling_policy, self.migrating)
