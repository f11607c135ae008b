"""The instance's side of the manager protocol (registration, drain flags, re-dispatch of queued requests),
its load reports and heartbeats, and the liveness of the proxies it serves."""

from __future__ import annotations

import asyncio
import logging
import os
import socket

import msgspec

from daemons import runtime, wire
from daemons.instance.telemetry import (
    M_BAD_FRAMES, M_BEAT_LATE, M_BLOCKS_TOTAL, M_BLOCKS_USED, M_HEALTHY, M_KV_USAGE, M_ORPHANED, M_PREFIX_BLOCKS,
    M_PREFIX_HIT, M_PREFIX_QUERIED, M_REDISPATCHED, M_RUNNING, M_WAITING)
from daemons.requests import AbortAction

log = logging.getLogger("llumnix.instance")


class ControlMixin:
    """Of the Instance: talks to the manager on ``msock``; beats the proxies on ``proxies``."""

    def register_msg(self) -> wire.Register:
        return wire.Register(
            instance_id=self.instance_id, host=self.ic.host or socket.gethostname(), pid=os.getpid(),
            request_address=self.request_address, backend=self.engine.backend, model=self.cfg.model.name,
            load=self.last_load, metrics_address=self.metrics_address, max_model_len=self.engine.max_model_len,
            drain_reason="stopping" if not self.accepting else self.draining, cordoned=self.cordoned,
            uptime_s=round(self.clock.monotonic() - self.started, 3), scale_in_protected=self.ic.scale_in_protected,
        )

    async def serve_manager(self) -> None:
        while True:
            frame = await self.manager.recv()
            msg = wire.decode(frame)
            if isinstance(msg, wire.RegisterAck):
                if not msg.accepted and msg.final:
                    raise runtime.StartupError(f"the manager refused our registration: {msg.reason}")
                if not msg.accepted:
                    log.info("manager asks us to register (%s)", msg.reason)
                    self._tell_manager(self.register_msg())
            elif isinstance(msg, wire.ListRequests):
                self.on_list_requests(msg.query_id)
            elif isinstance(msg, wire.MigrateStart):
                self.migrator.spawn(self.migrate_command(msg))
            elif isinstance(msg, wire.SetDraining):
                self.set_draining(msg)
            elif isinstance(msg, wire.CacheSync):
                self.on_cache_sync("")
            elif isinstance(msg, wire.Shutdown):
                log.info("the manager asks us to stop (%s)", msg.reason or "no reason given")
                self.stop_reason = f"stopped by the manager ({msg.reason})" if msg.reason else "stopped by the manager"
                self.stop.set()
            else:
                M_BAD_FRAMES.inc()

    def set_draining(self, msg: wire.SetDraining) -> None:
        was = self.draining
        self.draining = (msg.reason or "operator") if msg.draining else ""
        self.cordoned = msg.cordoned
        self.elsewhere = msg.elsewhere
        self.load_changed.set()  # proxies dispatching from their own views hear of it with the next report
        if self.draining and not was:
            log.info("draining (%s): running requests migrate out; queued ones go back to their proxies%s",
                     self.draining, "" if msg.elsewhere else " once another instance takes requests")
            if msg.elsewhere:  # else the manager's drain orders give them back when there is a destination
                self.boundary(self.redispatch_queued)
        elif was and not self.draining:
            log.info("no longer draining")

    def redispatch_queued(self, only: set[str] | None = None) -> int:
        """Give queued requests that produced nothing back to their proxies, which dispatch them again
        (at a step boundary: the engine is touched). ``only``: just these. Returns how many went."""
        gone = 0
        for r in self.engine.requests():
            rid = r.request_id
            entry = self.requests.get(rid)
            if (r.state != "waiting" or r.output_tokens or entry is None or entry.emitted
                    or (only is not None and rid not in only)):
                continue
            self.requests.forget(rid)
            self.phases.drop(rid)
            self.engine.abort_request(rid)
            self._send(entry.reply_to, wire.Redispatch(rid, self.instance_id, self.draining or "rebalancing"))
            M_REDISPATCHED.inc()
            gone += 1
        if gone:
            log.info("gave %d queued request(s) back for re-dispatch", gone)
        return gone

    async def report_loop(self) -> None:
        """Report on change, at most once per min interval, and at least once per heartbeat."""
        heartbeat = self.cfg.manager.heartbeat_interval_s
        while True:
            await runtime.wait_event(self.load_changed, heartbeat)
            self.load_changed.clear()
            load = self.last_load
            self.report_seq += 1
            pub = self.cache_pub
            if pub is not None:
                self.collect_cache()
                batch = pub.take()
                if batch is not None:  # before the report and heartbeats that give its number
                    self._tell_manager(batch)
                    self.proxies.broadcast(batch)
            self._tell_manager(wire.LoadReport(self.instance_id, self.report_seq, load,
                                               *((pub.epoch, pub.seq) if pub is not None else ())))
            self.beat_proxies(not self.watchdog.stalled)
            M_BLOCKS_USED.set(load.blocks_used)
            if pub is not None:
                self.cache_metrics()
            M_BLOCKS_TOTAL.set(load.blocks_total)
            M_KV_USAGE.set(load.blocks_used / load.blocks_total if load.blocks_total else 0.0)
            M_RUNNING.set(load.running)
            M_WAITING.set(load.waiting)
            self.preemptions.update(load.preemptions)
            if len(self.phases) > len(self.requests):  # some left by migration or a failure
                self.phases.prune(self.requests)
            await asyncio.sleep(self.ic.load_report_min_interval_s)

    async def proxy_loop(self) -> None:
        """Each heartbeat: tell every proxy we serve that we are alive (and whether healthy); abort the
        requests of proxies that are gone. Also the event loop's tick for the watchdog."""
        period = min(self.cfg.manager.heartbeat_interval_s, self.ic.step_timeout_s / 4)
        due = self.clock.monotonic()
        while True:
            now = self.clock.monotonic()
            M_BEAT_LATE.observe(max(now - due, 0.0))
            due = now + period
            self.watchdog.loop_beat = now
            healthy = not self.watchdog.stalled
            M_HEALTHY.set(1 if healthy else 0)
            if not healthy and not self.last_load.stalled:
                self.last_load = msgspec.structs.replace(self.last_load, stalled=True)
                self.load_changed.set()  # the manager stops dispatching to us now, not at the next step
            self.beat_proxies(healthy)
            # Every proxy we know, with requests here or not: a gone one's link (and our heartbeats to it) goes too.
            for address, why in self.proxies.gone(self.requests.proxies() | set(self.proxies.links)):
                self.boundary(lambda address=address, why=why: self.abort_orphans(address, why))
            await asyncio.sleep(period)

    def cache_metrics(self) -> None:
        cache = self.engine.cache
        M_PREFIX_BLOCKS.set(len(cache))
        queried, hit = self._cache_counted
        M_PREFIX_QUERIED.inc(cache.query_tokens - queried)
        M_PREFIX_HIT.inc(cache.hit_tokens - hit)
        self._cache_counted = (cache.query_tokens, cache.hit_tokens)

    def collect_cache(self) -> None:
        """The engine's prefix-cache changes into the publisher, unless a step is running on the engine thread
        (then the boundary collects them)."""
        if self.cache_pub is not None and not (self.stepping and self.executor is not None):
            self.cache_pub.add(self.engine.cache_events())

    def on_cache_sync(self, reply_to: str) -> None:
        """A proxy (``reply_to``, its token address) or the manager ("") asks for our whole prefix cache: sent
        at the next boundary (the engine idle), to a proxy we serve only, once per half heartbeat per asker."""
        if self.cache_pub is None or (reply_to and reply_to not in self.proxies.links):
            return
        now = self.clock.monotonic()
        if now - self._cache_syncs.get(reply_to, -1e18) < self.cfg.manager.heartbeat_interval_s / 2:
            return
        self._cache_syncs[reply_to] = now
        if len(self._cache_syncs) > 1000:
            self._cache_syncs = {a: t for a, t in self._cache_syncs.items() if a == reply_to or a in self.proxies.links}

        def answer() -> None:
            self.collect_cache()
            full = self.cache_pub.full(self.engine.cache_snapshot())
            if reply_to:
                self.proxies.send(reply_to, full)
            else:
                self._tell_manager(full)
        self.boundary(answer)

    def beat_proxies(self, healthy: bool) -> None:
        """Liveness and load to every proxy we serve: each heartbeat, and (from the report loop) on every load
        change, so that proxies dispatch from a current view. ``taken`` and the load are of the same step
        boundary, which lets a proxy retire exactly the dispatches the load already counts."""
        accepting = self.accepting and not self.draining and not self.cordoned
        pub = self.cache_pub
        self.proxies.heartbeat(wire.Heartbeat(self.instance_id, self.request_address, healthy, self.last_load,
                                              accepting, cache_epoch=pub.epoch if pub is not None else 0,
                                              cache_seq=pub.seq if pub is not None else 0), self.taken)

    def abort_orphans(self, address: str, why: str) -> int:
        rids = self.requests.of_proxy(address)
        aborted = [rid for rid in rids if self.requests.abort(rid) is AbortAction.HERE and self.abort_local(rid)]
        n = len(aborted)
        if rids:
            M_ORPHANED.inc(n)
            log.warning("proxy %s is gone (%s): aborted its %d request(s)", address, why, n)
        for rid in aborted:  # a proxy that was only slow hears why, and places them again, rather than waiting
            self.fail(rid, address, f"aborted on instance {self.instance_id}: its proxy was taken for gone ({why})",
                      True)
        self.proxies.drop(address)
        self.taken.pop(address, None)
        return n
