"""The manager's rescheduling: migration orders (its own and operators'), drain and remove, auto-scaling.

Every ``scheduling.migration_interval_s`` the pairing policy turns the cluster view into (source,
destination) pairs, and each source is ordered to send some of its requests (it picks which, see
policy/migration.py). Draining instances (drained by an operator, being removed or scaled in, or stopping
after SIGTERM) are always sources; balancing pairs only when the dispatch policy is llumnix and pairing is
on. A removed or scaled-in instance is told to stop once nothing is left on it. Auto-scaling watches the
cluster's average freeness and launches (launcher.py) or retires instances.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections import Counter as Tally
from typing import TYPE_CHECKING

import msgspec

from daemons import metrics, policy, wire
from daemons.manager.launcher import LaunchError, Launcher

if TYPE_CHECKING:
    from daemons.manager import InstanceRecord, Manager

log = logging.getLogger("llumnix.manager")

M_ORDERED = metrics.counter("manager", "llumnix_manager_migrations_total",
                            "Manager-ordered migrations that ended, by reason and outcome", ["reason", "outcome"])
M_ORDERS_IN_FLIGHT = metrics.gauge("manager", "llumnix_manager_migrations_in_flight",
                                   "Requests the manager ordered to migrate, not yet reported")
M_SCALING = metrics.counter("manager", "llumnix_manager_scaling_total", "Auto-scaling actions, by direction",
                            ["direction"], preset=[("out",), ("in",)])
M_CLUSTER_FREENESS = metrics.gauge("manager", "llumnix_cluster_freeness",
                                   "Average freeness of the normal-priority load (the auto-scaling signal)")
M_PAIRING_ROUND = metrics.histogram("manager", "llumnix_manager_pairing_round_seconds",
                                    "Duration of one pairing round: pair the instances and send the migration orders",
                                    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
                                             0.25, 0.5, 1.0, 2.5))


class Rescheduler:
    def __init__(self, manager: Manager):
        self.m = manager
        self.sc = manager.cfg.scheduling
        self.scfg = manager.cfg.scaling
        self.outcomes: Tally[str] = Tally()  # "reason/outcome" -> ended manager-ordered migrations
        self.scale_outs = 0
        self.scale_ins = 0
        self.launcher = Launcher(self.scfg, manager.mc.address, lambda: set(manager.instances))
        self.scaler = policy.Scaler(self.scfg.scale_up_threshold, self.scfg.scale_down_threshold,
                                    self.scfg.sustain_s, self.scfg.cooldown_s, self.scfg.min_instances,
                                    self.scfg.max_instances,
                                    not_before=manager.started + self.scfg.launch_timeout_s)
        self._migrations: dict[int, tuple[asyncio.Future, str]] = {}  # MigrateStart id -> (result, source id)
        self.retiring: set[str] = set()
        self.in_flight = 0  # requests ordered to migrate, not yet reported
        self._turn = 0
        self.kv_bytes_per_token = 0.0  # seen in committed migrations (cross_node_kv_bytes_per_token unset)

    # ------------------------------------------------------------------ migration orders

    async def pairing_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sc.migration_interval_s)
            start = time.perf_counter()
            self.pair_once()
            M_PAIRING_ROUND.observe(time.perf_counter() - start)

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

    def plan(self, now: float, drains_only: bool = False) -> list[tuple[policy.Pair, wire.MigrateStart]]:
        """This interval's pairs and the order each source gets, from the current view (no side effects
        but the pairing turn; the virtual-time simulator, llumnixctl/simulate.py, runs this too)."""
        live = [r for r in self.m.instances.values() if r.state != "dead"]
        states = [dataclasses.replace(self.m.state(r, now), host=r.info.host) for r in live]
        pairs = policy.pair(states, self.sc.high_priority_headroom,
                            self.sc.migrate_out_threshold, self.sc.migrate_in_threshold,
                            self.sc.max_migrations_per_instance, balance=self.m.migrating and not drains_only,
                            turn=self._turn, cross_node=self.cross_node())
        self._turn += 1
        orders = []
        for p in pairs:
            dst = self.m.instances[p.dst]
            orders.append((p, wire.MigrateStart(
                0, dst=p.dst, dst_address=dst.info.request_address, count=p.count,
                reason="drain" if p.drain else "balance", selection=self.m.request_selection, drain=p.drain,
                src_usage=p.src_usage, dst_usage=p.dst_usage, dst_blocks=p.dst_blocks,
                headroom=self.sc.high_priority_headroom, cooldown_s=self.sc.migration_cooldown_s,
                dst_free_blocks=p.dst_free)))
        return orders

    def pair_once(self, drains_only: bool = False) -> list[policy.Pair]:
        orders = self.plan(self.m.clock.monotonic(), drains_only)
        for p, start in orders:
            log.debug("pair %s -> %s (%s, up to %d%s)", p.src, p.dst, start.reason, p.count,
                      f"; across hosts, at most {p.budget_blocks:.0f} blocks" if p.cross_node else "")
            self.m.spawn(self._run_order(self.m.instances[p.src], start))
        return [p for p, _ in orders]

    async def _run_order(self, src: InstanceRecord, start: wire.MigrateStart) -> None:
        result = await self.order_migration(src, start, start.count)
        if start.drain:  # a drain goes on at once rather than at the next interval
            self.pair_once(drains_only=True)
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
        mig = self.m.cfg.migration
        return 5.0 + max(count, 1) * mig.timeout_s * (mig.max_stages + 3)

    async def on_migrate(self, msg: wire.MigrateQuery) -> wire.Message:
        dst = self.m.instances.get(msg.dst)
        if dst is None or dst.state != "alive":
            return wire.ErrorReply(msg.query_id, f"destination {msg.dst!r} is not a live instance (see llumnixctl status)")
        if dst.draining or dst.cordoned:
            flag, undo = ("draining", "undrain") if dst.draining else ("cordoned", "uncordon")
            return wire.ErrorReply(msg.query_id, f"destination {msg.dst} is {flag}: it takes no requests "
                                                 f"(llumnixctl {undo} {msg.dst} first)")
        if msg.request_id:
            held = await self.m.on_requests(wire.RequestsQuery(0), want=msg.request_id)
            row = next((q for q in held.requests if q.request_id == msg.request_id), None)
            if row is None:
                busy = (f"; instance(s) {', '.join(held.unreachable)} did not answer within "
                        f"{self.m.lookup_timeout():g}s" if held.unreachable else "")
                return wire.ErrorReply(msg.query_id, f"request {msg.request_id!r} is not on any instance "
                                                     f"(finished, or never started; see llumnixctl requests){busy}")
            if row.state == "migrating":
                return wire.ErrorReply(msg.query_id, f"request {msg.request_id!r} is migrating out of "
                                                     f"{row.instance_id} right now; try again once it has landed "
                                                     "(llumnixctl requests shows where)")
            src_id = row.instance_id
        else:
            src_id = msg.src
        src = self.m.instances.get(src_id)
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
        qid = next(self.m.query_ids)
        fut = asyncio.get_running_loop().create_future()
        self._migrations[qid] = (fut, src.instance_id)
        self.count_orders(src.instance_id, start.dst, count)
        try:
            self.m.send(src, msgspec.structs.replace(start, query_id=qid))
            result = await asyncio.wait_for(fut, self.migrate_timeout(count))
        except asyncio.TimeoutError:
            return f"instance {src.instance_id} did not report the migration's outcome in time"
        finally:
            self._migrations.pop(qid, None)
            self.count_orders(src.instance_id, start.dst, -count)
        if result is None:
            return f"source instance {src.instance_id} died during the migration"
        return result

    def on_migrate_result(self, msg: wire.MigrateResult) -> None:
        fut, _ = self._migrations.get(msg.query_id, (None, ""))
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def fail_migrations_from(self, instance_id: str) -> None:
        for fut, src in self._migrations.values():
            if src == instance_id and not fut.done():
                fut.set_result(None)

    def count_orders(self, src_id: str, dst_id: str, count: int) -> None:
        """Count ``count`` (negative: done) migrations in flight on both instances of an order."""
        for iid in (src_id, dst_id):
            r = self.m.instances.get(iid)
            if r is not None:
                r.orders = max(0, r.orders + count)
        self.in_flight += count
        M_ORDERS_IN_FLIGHT.set(self.in_flight)

    # ------------------------------------------------------------------ drain, cordon, remove

    def tell(self, r: InstanceRecord) -> None:
        now = self.m.clock.monotonic()
        elsewhere = any(x is not r and self.m.state(x, now).dispatchable for x in self.m.instances.values())
        self.m.send(r, wire.SetDraining(bool(r.drain_reason), r.drain_reason, r.cordoned, elsewhere))
        self.m.update_gauges(r)

    def on_drain(self, msg: wire.DrainQuery) -> wire.Message:
        r = self.m.instances.get(msg.instance_id)
        if r is None:
            return wire.ErrorReply(msg.query_id, f"unknown instance {msg.instance_id!r} (see llumnixctl status)")
        if r.state == "dead":
            return wire.ErrorReply(msg.query_id, f"instance {msg.instance_id} is dead (see llumnixctl status)")
        verb = ("cordon" if msg.drain else "uncordon") if msg.cordon_only else ("drain" if msg.drain else "undrain")
        if msg.cordon_only:
            r.cordoned = msg.drain
        elif msg.drain:
            r.drain_reason = r.drain_reason or "operator"
        else:
            if r.state == "stopping":
                return wire.ErrorReply(msg.query_id, f"instance {msg.instance_id} is stopping; it cannot be undrained")
            r.drain_reason = ""  # a remove or scale-in waiting on it gives up
        log.info("instance %s: %s (llumnixctl)", r.instance_id, verb)
        self.tell(r)
        now = self.m.clock.monotonic()
        return wire.DrainReply(msg.query_id, next(v for v in self.m.view(now) if v.instance_id == r.instance_id))

    async def on_remove(self, msg: wire.RemoveQuery) -> wire.Message:
        r = self.m.instances.get(msg.instance_id)
        if r is None:
            return wire.ErrorReply(msg.query_id, f"unknown instance {msg.instance_id!r} (see llumnixctl status)")
        if r.state == "dead":
            self.m.forget(r, "removed by llumnixctl (it was dead)")
            return wire.RemoveReply(msg.query_id, msg.instance_id, 0.0, was_dead=True)
        outcome = await self.retire(msg.instance_id, "remove", msg.timeout_s)
        if isinstance(outcome, str):
            return wire.ErrorReply(msg.query_id, outcome)
        drained_s, migrated = outcome
        return wire.RemoveReply(msg.query_id, msg.instance_id, round(drained_s, 3), migrated)

    def resume_retirement(self, r: InstanceRecord) -> None:
        """An instance that was being removed or scaled in when the manager restarted: finish the job."""
        log.info("instance %s was being retired (%s) before we restarted; going on", r.instance_id, r.drain_reason)
        if r.drain_reason == "scale-in":
            self.m.spawn(self.scale_in(r.instance_id))
        else:
            self.m.spawn(self.retire(r.instance_id, r.drain_reason, self.scfg.launch_timeout_s))

    async def retire(self, instance_id: str, reason: str, timeout_s: float,
                     undrain_on_timeout: bool = False) -> tuple[float, int] | str:
        """Drain the instance until nothing is left on it, then tell it to stop and wait until it said
        goodbye. Returns (seconds drained, migrations out that committed) or why it did not happen."""
        r = self.m.instances[instance_id]
        if instance_id in self.retiring:
            return f"instance {instance_id} is already being removed"
        self.retiring.add(instance_id)
        try:
            start = self.m.clock.monotonic()
            committed0 = r.load.migrations_committed
            if r.drain_reason in ("", "operator"):
                r.drain_reason = reason
            self.tell(r)
            log.info("instance %s: draining for %s", instance_id, reason)
            poll = min(0.05, self.m.mc.heartbeat_interval_s / 4)
            while True:
                r = self.m.instances.get(instance_id)
                if r is None or r.state == "dead":
                    return f"instance {instance_id} went away while draining"
                if not r.draining:
                    return f"instance {instance_id} was undrained before it was empty; not stopped"
                ld = r.load
                if ld.running == ld.waiting == ld.migrating_out == ld.migrating_in == 0 and not r.pending and not r.orders:
                    break
                if self.m.clock.monotonic() - start > timeout_s:
                    if undrain_on_timeout:
                        r.drain_reason = ""
                        self.tell(r)
                    return (f"instance {instance_id} still has {ld.running} running and {ld.waiting} queued requests "
                            f"after {timeout_s:g}s; " + ("it serves again" if undrain_on_timeout else
                                                         f"it stays draining (llumnixctl undrain {instance_id} to cancel)"))
                await asyncio.sleep(poll)
            drained_s = self.m.clock.monotonic() - start
            migrated = r.load.migrations_committed - committed0
            log.info("instance %s drained in %.2fs (%d migrations out); telling it to stop", instance_id, drained_s, migrated)
            self.m.send(r, wire.Shutdown(reason))
            deadline = self.m.clock.monotonic() + max(10.0, 4 * self.m.dead_after())
            while self.m.clock.monotonic() < deadline:
                r = self.m.instances.get(instance_id)
                if r is None or r.state != "alive":
                    return drained_s, migrated
                await asyncio.sleep(poll)
            return f"instance {instance_id} was drained but did not stop within {deadline - start - drained_s:.0f}s"
        finally:
            self.retiring.discard(instance_id)

    # ------------------------------------------------------------------ adding instances

    async def on_add(self, msg: wire.AddQuery) -> wire.Message:
        if not self.scfg.launcher.strip():
            return wire.ErrorReply(msg.query_id, "no launcher is configured: set scaling.launcher in the manager's "
                                                 "config (e.g. \"systemctl start llumnix-instance@{n}\")")
        results = await asyncio.gather(*(self.launcher.launch(msg.timeout_s) for _ in range(max(1, msg.count))),
                                       return_exceptions=True)
        ids = [x for x in results if isinstance(x, str)]
        errors = [str(x) for x in results if isinstance(x, LaunchError)]
        unexpected = [x for x in results if isinstance(x, BaseException) and not isinstance(x, LaunchError)]
        for exc in unexpected:
            log.error("launch failed unexpectedly: %r", exc)
            errors.append(f"internal error: {exc!r}")
        if errors:
            started = f" (started: {', '.join(ids)})" if ids else ""
            return wire.ErrorReply(msg.query_id, "; ".join(errors) + started)
        return wire.AddReply(msg.query_id, ids)

    # ------------------------------------------------------------------ auto-scaling

    async def scaling_loop(self) -> None:
        period = min(1.0, self.m.mc.heartbeat_interval_s)
        while True:
            await asyncio.sleep(period)
            self.scale_once(self.m.clock.monotonic())

    def scaling_decision(self, now: float, launching: int) -> tuple[str | None, float | None, int, list]:
        """(decision "up"/"down"/None, the average freeness, instances serving, the states) from the
        current view; the virtual-time simulator (llumnixctl/simulate.py) runs this too."""
        states = [self.m.state(r, now) for r in self.m.instances.values()]
        avg = policy.average_freeness(states)
        M_CLUSTER_FREENESS.set(math.nan if avg is None else avg)
        serving = len(policy.scaling.serving(states))
        if self.m.scaling_policy == "off":
            self.scaler.reset()
            return None, avg, serving, states
        return self.scaler.observe(now, avg, serving, launching), avg, serving, states

    def scale_once(self, now: float) -> str | None:
        decision, avg, serving, states = self.scaling_decision(now, len(self.launcher.launches))
        if decision == "up":
            if not self.scfg.launcher.strip():
                log.warning("auto-scaling wants another instance, but scaling.launcher is empty")
                return None
            log.info("auto-scaling out: average freeness %s, %d serving", "n/a" if avg is None else f"{avg:.2f}", serving)
            self.m.spawn(self._scale_out())
        elif decision == "down":
            victim = policy.scale_in_victim(states)
            if victim is None:
                return None
            log.info("auto-scaling in: average freeness %.2f, %d serving; retiring %s", avg, serving, victim)
            self.m.spawn(self.scale_in(victim))
        return decision

    async def scale_in(self, instance_id: str) -> None:
        outcome = await self.retire(instance_id, "scale-in", self.scfg.launch_timeout_s, undrain_on_timeout=True)
        if isinstance(outcome, str):
            log.warning("auto-scaling in: %s", outcome)
            return
        self.scale_ins += 1
        M_SCALING.labels("in").inc()

    async def _scale_out(self) -> None:
        try:
            await self.launcher.launch()
        except LaunchError as exc:
            log.warning("auto-scaling out failed: %s", exc)
            return
        self.scale_outs += 1
        M_SCALING.labels("out").inc()
