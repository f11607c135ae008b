"""Instances joining, reporting and saying goodbye: the records the cluster view holds, the duplicates of a
live instance's id, and the prefix index fed by the instances' cache events."""

from __future__ import annotations

import logging
from typing import Callable

from daemons import prefix, wire
from daemons.clock import Clock
from daemons.config import ManagerConfig, SchedulingConfig
from daemons.manager.handover_links import tp_refusal
from daemons.manager.records import M_PREFIX_INDEX, InstanceRecord
from daemons.manager.view import ClusterView

log = logging.getLogger("llumnix.manager")

Send = Callable[[InstanceRecord, wire.Message], None]


class Registry:
    """Registrations, load reports, goodbyes and cache events, into the cluster view. Owns the connections
    refused as duplicates, when each unknown reporter was last asked to register, and ``cache_index`` (which
    instance caches which prompt blocks, daemons/prefix.py; a restarted manager asks each instance for its
    whole cache at its first report)."""

    def __init__(self, cluster: ClusterView, clock: Clock, mc: ManagerConfig, sc: SchedulingConfig, send: Send,
                 watch: Callable[[InstanceRecord, InstanceRecord | None], None],
                 joined: Callable[[InstanceRecord, bool], None]):
        """``send``: to an instance. ``watch(rec, old)``: watch a registered instance's connection (liveness.py).
        ``joined(rec, new)``: after a registration (the rescheduler repeats flags, resumes a retirement)."""
        self.cluster = cluster
        self.clock = clock
        self.mc = mc
        self.sc = sc
        self.send = send
        self.watch = watch
        self.joined = joined
        self.asked_to_register: dict[str, float] = {}  # instance id -> when we last asked it to register
        # Connections whose registration named the id of another live instance: their reports are not that
        # instance's (connection identity -> the id it asked for; the oldest forgotten past 10,000).
        self.duplicates: dict[bytes, str] = {}
        self.cache_index = prefix.Follower(self._ask_cache, clock.monotonic, mc.heartbeat_interval_s)
        cluster.on_forget(lambda r: self.cache_index.forget(r.instance_id))

    def is_duplicate(self, ident: bytes) -> bool:
        """Whether the connection ``ident`` registered with the id of another live instance."""
        return ident in self.duplicates

    def on_register(self, ident: bytes, msg: wire.Register, principal: str = "") -> wire.Message | None:
        """``principal``: role:name of the sender's key (CURVE), "" without keys."""
        if msg.wire_version != wire.WIRE_VERSION:
            log.warning("instance %s speaks wire version %d, we speak %d: refused", msg.instance_id, msg.wire_version, wire.WIRE_VERSION)
            return wire.RegisterAck(msg.instance_id, accepted=False, final=True,
                                    reason=f"wire version {msg.wire_version} != {wire.WIRE_VERSION}")
        now = self.clock.monotonic()
        old = self.cluster.get(msg.instance_id)
        if old is not None and old.state != "dead" and old.principal != principal:
            log.warning("refused a registration of instance %s by key %s: it is registered by key %s and alive",
                        msg.instance_id, principal or "(none)", old.principal or "(none)")
            return wire.RegisterAck(msg.instance_id, accepted=False, final=True,
                                    reason=f"instance id {msg.instance_id} is taken by another key's live instance")
        if old is not None and old.state != "dead" and (old.info.host, old.info.pid, old.info.request_address) != (
                msg.host, msg.pid, msg.request_address):
            # Another process with a live instance's id: two instances configured alike, or a restart that
            # came before we saw the old process go. Its registration waits (it is asked again each heartbeat)
            # until that instance is dead; meanwhile its reports are not taken for the live one's.
            first = ident not in self.duplicates
            self.duplicates[ident] = msg.instance_id
            if len(self.duplicates) > 10_000:
                self.duplicates.pop(next(iter(self.duplicates)))
            if first:
                log.warning("instance id %s is in use by a live instance (%s pid %d at %s); refused the same id from "
                            "%s pid %d at %s until that one is gone", msg.instance_id, old.info.host, old.info.pid,
                            old.info.request_address, msg.host, msg.pid, msg.request_address)
            return None
        refusal = tp_refusal(msg, self.cluster.records())
        if refusal and not msg.load.requests_received:  # joining: refused (it exits, saying why)
            log.warning("%s", refusal)
            return wire.RegisterAck(msg.instance_id, accepted=False, final=True, reason=refusal)
        if refusal:  # one that served already registers again (we restarted): kept, and said
            log.warning("%s (it has served already: kept)", refusal)
        self.duplicates.pop(ident, None)
        rec = InstanceRecord(info=msg, identity=ident, load=msg.load, last_seen=now, registered_at=now,
                             credit_age0=msg.uptime_s)
        rec.dispatched_n = msg.load.requests_received
        rec.principal = principal
        rec.cordoned = msg.cordoned
        rec.drain_reason = "" if msg.drain_reason == "stopping" else msg.drain_reason
        if msg.drain_reason == "stopping":
            rec.state = "stopping"
        if old is not None:
            rec.drain_reason = rec.drain_reason or old.drain_reason
            rec.cordoned = rec.cordoned or old.cordoned
            rec.orders, rec.credit0, rec.credit_age0, rec.registered_at = old.orders, old.credit0, old.credit_age0, old.registered_at
            log.info("instance %s re-registered (pid %d, was %s)", msg.instance_id, msg.pid, old.state)
        else:
            # A new instance joining a cluster that has work is filled first (negative usage for a while).
            if any(r.state == "alive" and (r.load.running or r.load.waiting) for r in self.cluster.records()):
                rec.credit0 = self.sc.new_instance_credit * msg.load.blocks_total
            log.info("instance %s registered: %s pid %d at %s, %d blocks%s", msg.instance_id, msg.host, msg.pid,
                     msg.request_address, msg.load.blocks_total,
                     f", credit {rec.credit(now, self.sc.new_instance_credit_s):.0f} blocks" if rec.credit0 else "")
        self.cluster.put(rec, now)
        self.watch(rec, old)
        self.joined(rec, old is None)
        return wire.RegisterAck(msg.instance_id)

    def on_report(self, ident: bytes, msg: wire.LoadReport) -> wire.Message | None:
        rec = self.cluster.get(msg.instance_id)
        duplicate = ident in self.duplicates and ident != (rec.identity if rec is not None else None)
        if rec is None or (rec.state == "dead" and ident != rec.identity) or duplicate:
            # We restarted, or it was removed, or a new process took a dead one's id (its address and pid
            # differ): ask it to register again, once per heartbeat at most, so that reports it queued while
            # we were away do not each cost a registration.
            now = self.clock.monotonic()
            if now - self.asked_to_register.get(msg.instance_id, -1e9) < self.mc.heartbeat_interval_s:
                return None
            self.asked_to_register[msg.instance_id] = now
            if len(self.asked_to_register) > 10_000:
                self.asked_to_register.clear()
            return wire.RegisterAck(msg.instance_id, accepted=False, reason="unknown instance: register again")
        now = self.clock.monotonic()
        rec.identity, rec.load, rec.last_seen = ident, msg.load, now
        rec.reports += 1
        self.cache_index.on_beat(msg.instance_id, msg.cache_epoch, msg.cache_seq)
        # Dispatches we never heard of (a proxy's notice lost while we were away) must not make the ones we
        # hear of later look reported already.
        rec.dispatched_n = max(rec.dispatched_n, msg.load.requests_received)
        if rec.state == "dead":
            log.info("instance %s is reporting again: alive", msg.instance_id)
            rec.state = "alive"
        rec.retire_pending(now, self.mc.pending_dispatch_ttl_s)
        self.cluster.update_gauges(rec, now)
        return None

    def on_goodbye(self, ident: bytes, msg: wire.Goodbye) -> None:
        """The instance is stopping: no more dispatches; its requests migrate out while it finishes. (Not
        from a connection refused as a duplicate: that one is not the instance.)"""
        rec = self.cluster.get(msg.instance_id)
        if rec is not None and rec.state != "stopping" and not self.is_duplicate(ident):
            rec.state = "stopping"
            rec.pending.clear()
            log.info("instance %s is stopping (%s); no more dispatches, its requests move out", msg.instance_id,
                     msg.reason or "shutdown")
            self.cluster.update_gauges(rec)

    def on_cache_events(self, ident: bytes, msg: wire.CacheEvents) -> None:
        """An instance's prefix-cache changes, taken only from the connection it reports on."""
        rec = self.cluster.get(msg.instance_id)
        if rec is not None and rec.identity == ident and rec.state != "dead":
            self.cache_index.on_events(msg)
            M_PREFIX_INDEX.set(self.cache_index.index.entries())

    def _ask_cache(self, instance_id: str) -> None:
        rec = self.cluster.get(instance_id)
        if rec is not None and rec.state != "dead":
            self.send(rec, wire.CacheSync())
