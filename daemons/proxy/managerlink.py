"""The proxy's link to the manager: queries and their answers, snapshots (the cluster view and our rank among
the proxies), our own view of the instances' liveness, and the manager's restarts."""

from __future__ import annotations

import asyncio
import logging

import msgspec

from daemons import policy, runtime, wire
from daemons.links import DOWN, UP
from daemons.proxy.telemetry import M_BAD_FRAMES, M_LINKS_DOWN, M_PEERS

log = logging.getLogger("llumnix.proxy")


class ManagerLinkMixin:
    """Of the ClusterClient: talks to the manager on ``manager``; keeps ``snapshot``, ``heard`` and ``beats``."""

    def manager_ok(self) -> bool:
        return self.clock.monotonic() - self.snapshot_at < max(3 * self.pc.snapshot_interval_s, 1.0)

    def alive(self) -> list[wire.InstanceView]:
        """Instances that take requests: the manager's view, less those our own view says are dead or
        unhealthy, with the load of their latest heartbeat when it is newer."""
        out = []
        for v in self.snapshot:
            beat = self.beats.get(v.instance_id)
            # A drain or cordon (or their end) reaches the instance first: its heartbeat, if newer than the
            # snapshot, says whether it takes requests.
            flagged = (v.draining or v.cordoned) and not (beat is not None and self.beat_at.get(v.instance_id, 0.0)
                                                          > self.snapshot_at and beat.accepting)
            if v.state != "alive" or flagged or self._dead(v.instance_id):
                continue
            if beat is not None and beat.load is not None:
                if not beat.healthy or not beat.accepting:
                    continue
                v = msgspec.structs.replace(v, load=beat.load)
            out.append(v)
        # Instances the manager does not show (it restarted and they have not registered again yet) but that
        # we hear from.
        known = {v.instance_id for v in self.snapshot}
        now = self.clock.monotonic()
        for iid, beat in self.beats.items():
            if (iid not in known and beat.load is not None and beat.healthy and beat.accepting
                    and now - self.heard.get(iid, 0.0) < self.pc.instance_timeout_s):
                out.append(wire.InstanceView(iid, "", 0, "alive", beat.request_address, "", "", beat.load, 0.0, 0.0))
        return out

    def instance_timeout(self) -> float:
        return self.pc.instance_timeout_s

    def _dead(self, instance_id: str, since: float = 0.0) -> bool:
        """Its connection went down (daemons/links.py). An instance whose connection is up is alive however
        late its heartbeats; one whose connection never came up is judged by silence: not heard from for
        proxy.instance_timeout_s (counting from ``since`` if later: a dispatch)."""
        link = self.links.state(self.addresses.get(instance_id, ""))
        if link != "unknown":
            return link == DOWN
        last = max(self.heard.get(instance_id, 0.0), since)
        return last > 0 and self.clock.monotonic() - last > self.pc.instance_timeout_s

    def _link_changed(self, address: str, state: str) -> None:
        if state == DOWN:
            M_LINKS_DOWN.inc()
            ids = [iid for iid, a in self.addresses.items() if a == address]
            log.warning("lost the connection to instance %s at %s (its process is gone, or it answered no keepalive "
                        "for %gs)", "/".join(ids) or "?", address, self.pc.instance_timeout_s)
            self.view.invalidate()
            self.check_streams(self.clock.monotonic())
        elif state == UP:
            self.view.invalidate()
            self._wake_waiting()

    async def _ask(self, msg, timeout: float):
        fut = asyncio.get_running_loop().create_future()
        self._queries[msg.query_id] = fut
        try:
            if not runtime.send_now(self.manager, wire.encode(msg)):
                return None
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            return None
        finally:
            self._queries.pop(msg.query_id, None)

    async def _recv_manager(self) -> None:
        while True:
            msg = wire.decode(await self.manager.recv())
            try:
                if isinstance(msg, wire.Snapshot):
                    self.snapshot, self.snapshot_at = msg.instances, self.clock.monotonic()
                    for v in msg.instances:  # the manager pinned each id to the key it registered with
                        if v.key and v.state != "dead":
                            self.owner_keys[v.instance_id] = v.key
                    self._wake_waiting()
                    self.view.invalidate()
                    self.rank, self.proxies = msg.proxy_rank, msg.proxies
                    M_PEERS.set(msg.proxies)
                    for v in msg.instances:
                        self.addresses[v.instance_id] = v.request_address
                        if v.state != "dead" and v.request_address and v.request_address not in self.instances:
                            # An instance streams its load to the proxies it knows: tell it about us now.
                            self._send_instance(v.request_address, wire.ProxyAlive(self.token_address))
                    if msg.dispatch_policy in policy.DISPATCH_POLICIES:
                        self.dispatch_policy = msg.dispatch_policy
                    self._check_gone(msg.uptime_s)
                if isinstance(msg, (wire.DispatchReply, wire.Snapshot)):
                    fut = self._queries.get(msg.query_id)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                elif msg is None:
                    M_BAD_FRAMES.inc()
            except Exception:  # this task is essential: one message must not end it (nor the proxy)
                M_BAD_FRAMES.inc()
                log.exception("a message from the manager broke its handler; dropped it")

    async def _poll_snapshot(self) -> None:
        while True:
            self._snapshot_asked_at = self.clock.monotonic()
            await self._ask(wire.SnapshotQuery(next(self._ids), self.token_address), self.pc.snapshot_interval_s)
            await asyncio.sleep(self.pc.snapshot_interval_s)

    def _check_gone(self, manager_uptime_s: float) -> None:
        """Requests on an instance the manager marked dead, or no longer knows, are re-sent or failed. A
        manager that has just (re)started does not know every instance yet: absence counts only later."""
        states = {v.instance_id: v.state for v in self.snapshot}
        mc = self.cfg.manager
        settled = manager_uptime_s > 2 * mc.heartbeat_interval_s * mc.dead_after_missed
        for stream in list(self.streams.values()):
            if stream.done or not stream.instance_id:
                continue
            iid = stream.instance_id
            state = states.get(iid)
            # The manager's word is confirmed by our own view: an instance whose tokens or heartbeats reached
            # us within the manager's own dead-after time is alive, whatever a loaded manager concluded.
            heard_lately = self.clock.monotonic() - self.heard.get(iid, 0.0) < mc.heartbeat_interval_s * mc.dead_after_missed
            # Absent: gone for good, unless we sent the request after the manager took this snapshot, or the
            # manager has only just (re)started.
            gone = state is None and settled and stream.sent_at < self._snapshot_asked_at
            if (state == "dead" or gone) and not heard_lately:
                self._instance_failed(stream, f"instance {stream.instance_id} died", cause="dead")

    def _tell_manager(self, msg: wire.Message) -> None:
        if not runtime.send_now(self.manager, wire.encode(msg)):
            log.debug("manager unreachable; it will not count a %s", type(msg).__name__)

    def _tell_manager_soon(self, msg: wire.Message) -> None:
        """Tell the manager at the end of this loop turn: the request itself goes out first, and the turn's
        messages go together. Every ZeroMQ send that finds the I/O thread asleep wakes it (tens of us on a
        loaded or virtual machine); sends in a row mostly find it awake."""
        if not self._soon:
            asyncio.get_running_loop().call_soon(self._flush_soon)
        self._soon.append(msg)

    def _flush_soon(self) -> None:
        soon, self._soon = self._soon, []
        for msg in soon:
            self._tell_manager(msg)
