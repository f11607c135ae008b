"""Migration orders from the manager or an operator: which requests go (the selection policy over the
engine's requests, less those that stay), with what the destination already caches; the pure parts are
also run by the virtual-time simulator."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from daemons import policy, wire
from daemons.instance.shared import Shared
from daemons.instance.telemetry import M_HANDOVER_BYTES, M_HANDOVER_S, M_HANDOVERS, PREFIX_QUERY_TOKENS

log = logging.getLogger("llumnix.instance")

def migrants_for(msg: wire.MigrateStart, requests: list[wire.RequestLoad], keep: set[str], load: wire.InstanceLoad,
                 block_size: int, cached: dict[str, int] | None = None) -> list[policy.Choice]:
    """What a source sends for an order: the order's selection policy over the engine's requests (an
    operator's ``--from --count``: lower priority, then fewer blocks to move, with no balance check).
    ``cached``: the leading blocks of each request that the destination holds already. Also run by the
    virtual-time simulator (llumnixctl/experiments/sim/simulate.py)."""
    operator = not msg.reason
    return policy.select_migrants(
        msg.selection or policy.SELECTION.default.name, requests, msg.count, src_usage=policy.INF if operator else msg.src_usage,
        src_blocks=load.blocks_total, dst_usage=msg.dst_usage, dst_blocks=msg.dst_blocks or load.blocks_total,
        headroom=msg.headroom, block_size=block_size, drain=msg.drain or operator, exclude=keep,
        dst_free=policy.INF if msg.dst_free_blocks < 0 else msg.dst_free_blocks, cached=cached)


def keep_for(msg: wire.MigrateStart, migrating: set[str], arrivals: dict[str, float], now: float) -> set[str]:
    """Requests that stay for this order: those migrating already and, for a balancing order, those that
    arrived by migration within its cooldown (``arrivals``: request id -> when). Also run by the simulator."""
    keep = set(migrating)
    if msg.reason and not msg.drain:
        keep |= {rid for rid, at in arrivals.items() if now - at < msg.cooldown_s}
    return keep


class Orders:
    """Turns a MigrateStart into migrations out (daemons/migration/ runs each one). Owns nothing between
    orders: it reads the engine (at boundaries, through ``mailbox``), the request table, the last load
    (``load()``), and gives queued migrants back through ``redispatch_queued``."""

    def __init__(self, shared: Shared, load: Callable[[], wire.InstanceLoad],
                 redispatch_queued: Callable[[set[str]], int], max_in_flight: int):
        self.engine, self.requests, self.mailbox, self.migrator = (shared.engine, shared.requests, shared.mailbox,
                                                                   shared.migrator)
        self.tell_manager, self.ident, self.clock = shared.tell_manager, shared.ident, shared.clock
        self.load = load
        self.redispatch_queued = redispatch_queued
        self.max_in_flight = max_in_flight

    def on_migrate_start(self, msg: wire.MigrateStart) -> None:
        self.migrator().spawn(self.migrate_command(msg))

    async def migrate_command(self, msg: wire.MigrateStart) -> None:
        """The manager's (or an operator's) order: migrate these requests, or ``count`` of our choice."""
        if msg.request_ids:
            rids = list(msg.request_ids)
        else:
            cached = await self.cached_at_destination(msg) if self.engine.prefix_caching else None
            rids = await self.mailbox.call(lambda: self.choose_migrants(msg, cached))
        slots = asyncio.Semaphore(self.max_in_flight)
        migrator = self.migrator()

        async def one(rid: str) -> wire.MigrationOutcome:
            async with slots:
                return await migrator.migrate_out(rid, msg.dst, msg.dst_address, msg.blocking,
                                                  paced=msg.reason not in ("handover", "role"))

        outcomes = await asyncio.gather(*(one(r) for r in rids))
        if msg.reason in ("handover", "role"):
            for o in outcomes:
                M_HANDOVERS.labels(msg.reason, o.outcome).inc()
                if o.outcome == "committed":
                    M_HANDOVER_S.observe(o.total_ms / 1000.0)
                    M_HANDOVER_BYTES.observe(o.bytes)
        self.tell_manager(wire.MigrateResult(msg.query_id, self.ident.instance_id, list(outcomes)))

    async def cached_at_destination(self, msg: wire.MigrateStart) -> dict[str, int]:
        """With prefix caching: of the requests that could go, the leading blocks the destination holds
        already (asked of it, wire.PrefixQuery): blocks a move would not send, which selection weighs."""

        def prompts() -> dict[str, list[int]]:
            out: dict[str, list[int]] = {}
            budget = PREFIX_QUERY_TOKENS
            requests = self.engine.requests()
            keep = self._keep(msg, requests)
            bs = self.engine.block_size
            for r in requests:
                if r.state != "running" or r.request_id in keep or r.prompt_tokens <= bs:
                    continue
                whole = r.prompt_tokens // bs * bs
                if whole > budget:
                    continue
                # one token past the whole blocks, as the destination's first hold sees the prompt (a cache
                # hit never covers a prompt's last token)
                out[r.request_id] = list(self.engine.migrating_request(r.request_id).prompt_token_ids[:whole + 1])
                budget -= whole
            return out

        asked = await self.mailbox.call(prompts)
        if not asked:
            return {}
        hits = await self.migrator().prefix_hits(msg.dst_address, list(asked.values()))
        return {rid: n for rid, n in zip(asked, hits) if n}

    def _keep(self, msg: wire.MigrateStart, requests: list[wire.RequestLoad]) -> set[str]:
        """Requests that must stay for this order: already migrating, not ours, or (balancing) just arrived."""
        keep = keep_for(msg, self.requests.migrating(), self.requests.arrivals(), self.clock.monotonic())
        return keep | {r.request_id for r in requests if r.request_id not in self.requests}

    def choose_migrants(self, msg: wire.MigrateStart, cached: dict[str, int] | None = None) -> list[str]:
        """The requests to send, by the order's selection policy (an operator's ``--from --count``: lower
        priority, then fewer blocks to move, with no balance check). Queued ones chosen are re-dispatched
        right here; the running ones are returned for migration."""
        requests = self.engine.requests()
        chosen = migrants_for(msg, requests, self._keep(msg, requests), self.load(), self.engine.block_size, cached)
        queued = {c.request_id for c in chosen if c.redispatch}
        if queued:
            self.redispatch_queued(queued)
        return [c.request_id for c in chosen if not c.redispatch]
