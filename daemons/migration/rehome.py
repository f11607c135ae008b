"""Idle sessions re-homed between turns (issue #52 item 5): a hot instance's sessions with no turn running, whose
blocks it retains after their last turn (daemons/engine/tier.py ``Retention``), move to a cooler instance's host tier,
and the prefix index follows them (the cool instance publishes its tier's new blocks; the hot one's become ordinary
cache, evicted first when it needs room).

    manager                     hot instance                               cool instance
    Rehome(dst, count)   ->     its least recently used idle sessions:
                                RehomePull(session, hashes, retain left) ->
                                                                           the pull machinery without a request
                                                                    <-     (pulls.py ``fetch``): PullAsk(session)
                                exports the blocks, sends them; then it
                                stops retaining the session                imports them into its tier, retains them
                                                                           for what was left of the session's TTL

A turn of the session that comes meanwhile finds its blocks on either instance (the hot one keeps them as cache
until it needs the room). Any failure only means the session's blocks stay where they were (or get recomputed)."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from daemons import wire
from daemons.migration.pulls import Pulls
from daemons.migration.side import Parts
from daemons.migration.telemetry import M_PULL_BYTES, M_REHOMED

log = logging.getLogger("llumnix.migration")


class Rehome:
    """Both ends of re-homing: the hot instance's order (``on_order``) and the cool one's pulls (``on_pull``).
    Owns its counts (``sent``: sessions offered to others; ``taken``: sessions pulled in here)."""

    def __init__(self, parts: Parts, pulls: Pulls, spawn: Callable):
        self.host, self.engine, self.boundary, self.peers = parts.host, parts.engine, parts.boundary, parts.peers
        self.requests = parts.requests
        self.pulls, self.spawn = pulls, spawn
        self.sent = 0
        self.taken = 0

    def _retention(self):
        """The engine's sessions' retention (kept with its host tier; None: no tier, or no retention)."""
        tier = self.engine.tier
        return tier.retention if tier is not None else None

    # ---------------------------------------------------------------- the hot instance

    def on_order(self, msg: wire.Rehome) -> None:
        """(Event loop, the manager's order) Offer up to ``msg.count`` idle sessions to ``msg.dst``."""
        retention = self._retention()
        if retention is None or msg.dst == self.host.instance_id or msg.count <= 0:
            return
        self.spawn(self._offer(msg, retention))

    async def _offer(self, msg: wire.Rehome, retention) -> None:
        idle = await self.boundary(lambda: retention.idle(self.requests.sessions(), msg.count))
        for session, left_s, hashes in idle:
            if left_s <= 0 or not hashes:
                continue
            if self.peers.send(msg.dst_address, wire.RehomePull(self.host.instance_id, self.host.request_address,
                                                                session, hashes, left_s)):
                self.sent += 1
        if idle:
            log.info("offered %d idle session(s) to %s", len(idle), msg.dst)

    # ---------------------------------------------------------------- the cool instance

    def on_pull(self, msg: wire.RehomePull) -> None:
        self.spawn(self._pull(msg))

    async def _pull(self, msg: wire.RehomePull) -> None:
        if self.engine.tier is None:
            log.info("session %s not re-homed here from %s: no host KV tier", msg.session, msg.instance_id)
            return
        outcome, got = "failed", 0
        try:
            outcome, got = await asyncio.wait_for(self.pulls.fetch(msg.address, msg.hashes, msg.session),
                                                  self.pulls.timeout_s)
        except asyncio.TimeoutError:
            outcome = "timeout"
        except Exception as exc:  # a transfer or an engine call failed: the session stays where it was
            log.info("re-homing session %s from %s failed: %s", msg.session, msg.instance_id, exc)
        if got:
            M_PULL_BYTES.inc(got)
        if outcome != "pulled":
            log.info("session %s not re-homed here from %s: %s", msg.session, msg.instance_id, outcome)
            return
        retention = self._retention()
        if retention is not None:
            await self.boundary(lambda: retention.turn_ended(msg.session, list(msg.hashes), msg.retain_s))
        self.taken += 1
        M_REHOMED.inc()
        log.info("session %s re-homed here from %s (%d bytes)", msg.session, msg.instance_id, got)
