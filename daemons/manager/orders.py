"""Migration orders: every ``scheduling.migration_interval_s`` the pairing policy turns the cluster view into
(source, destination) pairs, and each source is ordered to send some of its requests (it picks which, see
daemons/policy/migration.py); an operator's ``llumnixctl migrate`` is one more order. Draining instances
(drained by an operator, being removed or scaled in, or stopping after SIGTERM) are always sources; balancing
pairs only when the dispatch policy is llumnix and pairing is on."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter as Tally
from typing import Awaitable, Callable

import msgspec

from daemons import metrics, policy, wire
from daemons.manager.records import InstanceRecord
from daemons.manager.shared import Shared

log = logging.getLogger("llumnix.manager")

DRAIN_BACKOFF_MAX_S = 30.0  # the longest a draining source whose orders move nothing waits between tries

M_ORDERED = metrics.counter("manager", "llumnix_manager_migrations_total",
                            "Manager-ordered migrations that ended, by reason and outcome", ["reason", "outcome"])
M_ORDERS_IN_FLIGHT = metrics.gauge("manager", "llumnix_manager_migrations_in_flight",
                                   "Requests the manager ordered to migrate, not yet reported")
M_PAIRING_ROUND = metrics.histogram("manager", "llumnix_manager_pairing_round_seconds",
                                    "Duration of one pairing round: pair the instances and send the migration orders",
                                    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
                                             0.25, 0.5, 1.0, 2.5))

Lookup = Callable[[str], Awaitable[wire.RequestsReply]]


class Orders:
    """Owns the orders in flight (their results awaited by query id), the tally of their outcomes, the
    pairing turn, each draining source's backoff, and the KV size seen in committed migrations."""

    def __init__(self, shared: Shared, next_id: Callable[[], int], lookup: Lookup, lookup_timeout_s: float):
        """``next_id``: a query id. ``lookup(request_id)``: which instance holds a request (queries.py), which
        may take ``lookup_timeout_s``."""
        self.sc, self.mig = shared.cfg.scheduling, shared.cfg.migration
        self.cluster, self.policies, self.clock = shared.cluster, shared.policies, shared.clock
        self.send, self.spawn = shared.send, shared.spawn
        self.next_id = next_id
        self.lookup = lookup
        self.lookup_timeout_s = lookup_timeout_s
        self.outcomes: Tally[str] = Tally()  # "reason/outcome" -> ended manager-ordered migrations
        self.waiting: dict[int, tuple[asyncio.Future, str]] = {}  # MigrateStart id -> (result, source id)
        self.in_flight = 0  # requests ordered to migrate, not yet reported
        self.turn = 0
        self.kv_bytes_per_token = 0.0  # seen in committed migrations (cross_node_kv_bytes_per_token unset)
        # draining source -> (drain orders in a row that moved nothing, monotonic time before which it waits)
        self.drain_backoff: dict[str, tuple[int, float]] = {}

    async def pairing_loop(self) -> None:
        while True:
            await self.clock.sleep(self.sc.migration_interval_s)
            start = self.clock.monotonic()
            self.pair_once()
            M_PAIRING_ROUND.observe(self.clock.monotonic() - start)

    def cross_node(self) -> policy.CrossNode:
        """The cross-host cost check's figures: the settings, and the KV size migrations showed."""
        sc = self.sc
        return policy.CrossNode(sc.cross_node_bandwidth_gbps, sc.cross_node_kv_bytes_per_token or self.kv_bytes_per_token,
                                sc.cross_node_recompute_ms_per_token, sc.cross_node_overhead_ms)

    def learn(self, src: InstanceRecord | None, outcomes: list[wire.MigrationOutcome]) -> None:
        """KV bytes per token, from what committed migrations moved (for the cross-host check)."""
        block_size = src.load.block_size if src is not None else 0
        for o in outcomes:
            if o.outcome == "committed" and o.blocks > 0 and o.bytes > 0 and block_size > 0:
                self.kv_bytes_per_token = o.bytes / (o.blocks * block_size)

    def new_drain(self, instance_id: str) -> None:
        """An operator drains ``instance_id`` anew: it tries at once, whatever its last drain's backoff."""
        self.drain_backoff.pop(instance_id, None)

    def plan(self, now: float, drains_only: bool = False) -> list[tuple[policy.Pair, wire.MigrateStart]]:
        """This interval's pairs and the order each source gets, from the current view (no side effects
        but the pairing turn; the virtual-time simulator, llumnixctl/experiments/sim/simulate.py, runs this too)."""
        live = [r for r in self.cluster.records() if r.state != "dead"]
        for gone in [iid for iid in self.drain_backoff if self.cluster.get(iid) is None]:
            del self.drain_backoff[gone]
        states = [dataclasses.replace(self.cluster.state(r, now), host=r.info.host) for r in live]
        if policy.disagg.active(states) and any(s.role != "prefill" and s.dispatchable for s in states):
            # Prefill instances hand over what decodes: balance the others, and drain into them (with no decode
            # or mixed instance left, prefill ones serve whole requests and take drains too).
            states = [s for s in states if s.role != "prefill" or s.draining]
        pairs = policy.pair(states, self.sc.high_priority_headroom,
                            self.sc.migrate_out_threshold, self.sc.migrate_in_threshold,
                            self.sc.max_migrations_per_instance, balance=self.policies.migrating and not drains_only,
                            turn=self.turn, cross_node=self.cross_node())
        self.turn += 1
        orders = []
        for p in pairs:
            if p.drain and self.drain_backoff.get(p.src, (0, 0.0))[1] > now:
                continue  # its last drain orders moved nothing: it waits out its backoff
            dst = self.cluster.instances[p.dst]
            orders.append((p, wire.MigrateStart(
                0, dst=p.dst, dst_address=dst.info.request_address, count=p.count,
                reason="drain" if p.drain else "balance", selection=self.policies.request_selection, drain=p.drain,
                src_usage=p.src_usage, dst_usage=p.dst_usage, dst_blocks=p.dst_blocks,
                headroom=self.sc.high_priority_headroom, cooldown_s=self.sc.migration_cooldown_s,
                dst_free_blocks=p.dst_free)))
        return orders

    def pair_once(self, drains_only: bool = False) -> list[policy.Pair]:
        orders = self.plan(self.clock.monotonic(), drains_only)
        for p, start in orders:
            log.debug("pair %s -> %s (%s, up to %d%s)", p.src, p.dst, start.reason, p.count,
                      f"; across hosts, at most {p.budget_blocks:.0f} blocks" if p.cross_node else "")
            self.spawn(self._run_order(self.cluster.instances[p.src], start))
        return [p for p, _ in orders]

    async def run_order(self, src: InstanceRecord, start: wire.MigrateStart) -> None:
        """Order ``start`` of ``src`` and count its outcomes by its reason (a handover, daemons/manager/roles.py)."""
        await self._run_order(src, start)

    async def _run_order(self, src: InstanceRecord, start: wire.MigrateStart) -> None:
        result = await self.order_migration(src, start, start.count)
        if start.drain:
            if not isinstance(result, str) and any(o.outcome == "committed" for o in result.outcomes):
                self.drain_backoff.pop(src.instance_id, None)
                self.pair_once(drains_only=True)  # a drain that moves goes on at once, not at the next interval
            else:  # nothing moved (refused, aborted, lost): back off, doubling, before this source drains again
                fails = self.drain_backoff.get(src.instance_id, (0, 0.0))[0] + 1
                wait = min(self.sc.migration_interval_s * 2 ** fails, DRAIN_BACKOFF_MAX_S)
                self.drain_backoff[src.instance_id] = (fails, self.clock.monotonic() + wait)
                if fails in (1, 4) or wait == DRAIN_BACKOFF_MAX_S and fails % 10 == 0:
                    log.warning("drain of %s: %d order(s) in a row moved nothing; next try in %gs", src.instance_id,
                                fails, wait)
        if isinstance(result, str):
            log.warning("%s order %s -> %s: %s", start.reason, src.instance_id, start.dst, result)
            self.outcomes[f"{start.reason}/lost"] += 1
            M_ORDERED.labels(start.reason, "lost").inc()
            return
        self.learn(src, result.outcomes)
        for o in result.outcomes:
            self.outcomes[f"{start.reason}/{o.outcome}"] += 1
            M_ORDERED.labels(start.reason, o.outcome).inc()

    def migrate_timeout(self, count: int) -> float:
        """How long a source may take to report ``count`` migrations (each step has its own timeout there)."""
        return 5.0 + max(count, 1) * self.mig.timeout_s * (self.mig.max_stages + 3)

    async def on_migrate(self, msg: wire.MigrateQuery) -> wire.Message:
        """``llumnixctl migrate``: one request (found by a lookup), or ``count`` from a source, to ``dst``."""
        dst = self.cluster.get(msg.dst)
        if dst is None or dst.state != "alive":
            return wire.ErrorReply(msg.query_id, f"destination {msg.dst!r} is not a live instance (see llumnixctl status)")
        if dst.draining or dst.cordoned:
            flag, undo = ("draining", "undrain") if dst.draining else ("cordoned", "uncordon")
            return wire.ErrorReply(msg.query_id, f"destination {msg.dst} is {flag}: it takes no requests "
                                                 f"(llumnixctl {undo} {msg.dst} first)")
        if msg.request_id:
            held = await self.lookup(msg.request_id)
            row = next((q for q in held.requests if q.request_id == msg.request_id), None)
            if row is None:
                busy = (f"; instance(s) {', '.join(held.unreachable)} did not answer within "
                        f"{self.lookup_timeout_s:g}s" if held.unreachable else "")
                return wire.ErrorReply(msg.query_id, f"request {msg.request_id!r} is not on any instance "
                                                     f"(finished, or never started; see llumnixctl requests){busy}")
            if row.state == "migrating":
                return wire.ErrorReply(msg.query_id, f"request {msg.request_id!r} is migrating out of "
                                                     f"{row.instance_id} right now; try again once it has landed "
                                                     "(llumnixctl requests shows where)")
            src_id = row.instance_id
        else:
            src_id = msg.src
        src = self.cluster.get(src_id)
        if src is None or src.state == "dead":
            return wire.ErrorReply(msg.query_id, f"source {src_id!r} is not a live instance (see llumnixctl status)")
        if src_id == msg.dst:
            return wire.ErrorReply(msg.query_id, f"the request is already on {msg.dst}")
        start = wire.MigrateStart(0, dst=msg.dst, dst_address=dst.info.request_address,
                                  request_ids=[msg.request_id] if msg.request_id else [],
                                  count=0 if msg.request_id else msg.count, blocking=msg.blocking)
        result = await self.order_migration(src, start, 1 if msg.request_id else msg.count)
        if isinstance(result, str):
            return wire.ErrorReply(msg.query_id, result)
        self.learn(src, result.outcomes)
        return wire.MigrateReply(msg.query_id, result.outcomes)

    async def order_migration(self, src: InstanceRecord, start: wire.MigrateStart, count: int) -> wire.MigrateResult | str:
        """Send a MigrateStart to the source and wait for its result; a string says why there is none."""
        qid = self.next_id()
        fut = asyncio.get_running_loop().create_future()
        self.waiting[qid] = (fut, src.instance_id)
        self.count_orders(src.instance_id, start.dst, count)
        try:
            self.send(src, msgspec.structs.replace(start, query_id=qid))
            result = await asyncio.wait_for(fut, self.migrate_timeout(count))
        except asyncio.TimeoutError:
            return f"instance {src.instance_id} did not report the migration's outcome in time"
        finally:
            self.waiting.pop(qid, None)
            self.count_orders(src.instance_id, start.dst, -count)
        if result is None:
            return f"source instance {src.instance_id} died during the migration"
        return result

    def on_migrate_result(self, msg: wire.MigrateResult) -> None:
        fut, _ = self.waiting.get(msg.query_id, (None, ""))
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def fail_migrations_from(self, instance_id: str) -> None:
        for fut, src in self.waiting.values():
            if src == instance_id and not fut.done():
                fut.set_result(None)

    def count_orders(self, src_id: str, dst_id: str, count: int) -> None:
        """Count ``count`` (negative: done) migrations in flight on both instances of an order."""
        self.cluster.count_orders(src_id, count)
        self.cluster.count_orders(dst_id, count)
        self.in_flight += count
        M_ORDERS_IN_FLIGHT.set(self.in_flight)
