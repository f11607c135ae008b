"""Instances joining, reporting, saying goodbye and being forgotten: the records of the cluster view."""

from __future__ import annotations

import logging

from daemons import runtime, wire
from daemons.manager.records import M_DISPATCHES, M_PREFIX_INDEX, PER_INSTANCE_GAUGES, InstanceRecord

log = logging.getLogger("llumnix.manager")


class RegistryMixin:
    """Of the Manager: writes ``instances`` (one InstanceRecord per instance id)."""

    # ------------------------------------------------------------------ instances

    def send(self, r: InstanceRecord, msg: wire.Message) -> None:
        """To an instance; never waits (a full queue means it is gone, and heartbeats will say so)."""
        if not runtime.send_now(self.sock, [r.identity, wire.encode(msg)]):
            log.warning("could not send a %s to instance %s", type(msg).__name__, r.instance_id)

    def on_register(self, ident: bytes, msg: wire.Register) -> wire.Message:
        if msg.wire_version != wire.WIRE_VERSION:
            log.warning("instance %s speaks wire version %d, we speak %d: refused", msg.instance_id, msg.wire_version, wire.WIRE_VERSION)
            return wire.RegisterAck(msg.instance_id, accepted=False, final=True,
                                    reason=f"wire version {msg.wire_version} != {wire.WIRE_VERSION}")
        now = self.clock.monotonic()
        old = self.instances.get(msg.instance_id)
        principal = self.sender
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
            first = ident not in self._duplicates
            self._duplicates[ident] = msg.instance_id
            if len(self._duplicates) > 10_000:
                self._duplicates.pop(next(iter(self._duplicates)))
            if first:
                log.warning("instance id %s is in use by a live instance (%s pid %d at %s); refused the same id from "
                            "%s pid %d at %s until that one is gone", msg.instance_id, old.info.host, old.info.pid,
                            old.info.request_address, msg.host, msg.pid, msg.request_address)
            return None
        self._duplicates.pop(ident, None)
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
            if any(r.state == "alive" and (r.load.running or r.load.waiting) for r in self.instances.values()):
                rec.credit0 = self.sc.new_instance_credit * msg.load.blocks_total
            log.info("instance %s registered: %s pid %d at %s, %d blocks%s", msg.instance_id, msg.host, msg.pid,
                     msg.request_address, msg.load.blocks_total,
                     f", credit {rec.credit(now, self.sc.new_instance_credit_s):.0f} blocks" if rec.credit0 else "")
            self.resched.launcher.registered(msg.instance_id)
        self.instances[msg.instance_id] = rec
        self._probe(rec, old)
        self.update_gauges(rec, now)
        if rec.drain_reason or rec.cordoned:  # it forgot (restarted) or we did: say it again
            self.resched.tell(rec)
        if old is None and rec.drain_reason in ("remove", "scale-in"):  # we restarted in the middle of it
            self.resched.resume_retirement(rec)
        return wire.RegisterAck(msg.instance_id)

    def on_report(self, ident: bytes, msg: wire.LoadReport) -> wire.Message | None:
        rec = self.instances.get(msg.instance_id)
        duplicate = ident in self._duplicates and ident != (rec.identity if rec is not None else None)
        if rec is None or (rec.state == "dead" and ident != rec.identity) or duplicate:
            # We restarted, or it was removed, or a new process took a dead one's id (its address and pid
            # differ): ask it to register again, once per heartbeat at most, so that reports it queued while
            # we were away do not each cost a registration.
            now = self.clock.monotonic()
            if now - self._asked_to_register.get(msg.instance_id, -1e9) < self.mc.heartbeat_interval_s:
                return None
            self._asked_to_register[msg.instance_id] = now
            if len(self._asked_to_register) > 10_000:
                self._asked_to_register.clear()
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
        self.update_gauges(rec, now)
        return None

    def on_goodbye(self, msg: wire.Goodbye) -> None:
        """The instance is stopping: no more dispatches; its requests migrate out while it finishes."""
        rec = self.instances.get(msg.instance_id)
        if rec is not None and rec.state != "stopping":
            rec.state = "stopping"
            rec.pending.clear()
            log.info("instance %s is stopping (%s); no more dispatches, its requests move out", msg.instance_id,
                     msg.reason or "shutdown")
            self.update_gauges(rec)

    def on_cache_events(self, ident: bytes, msg: wire.CacheEvents) -> None:
        """An instance's prefix-cache changes, taken only from the connection it reports on."""
        rec = self.instances.get(msg.instance_id)
        if rec is not None and rec.identity == ident and rec.state != "dead":
            self.cache_index.on_events(msg)
            M_PREFIX_INDEX.set(self.cache_index.index.entries())

    def _ask_cache(self, instance_id: str) -> None:
        rec = self.instances.get(instance_id)
        if rec is not None and rec.state != "dead":
            self.send(rec, wire.CacheSync())

    def forget(self, rec: InstanceRecord, why: str) -> None:
        self.cache_index.forget(rec.instance_id)
        self._unprobe(rec)
        del self.instances[rec.instance_id]
        log.info("instance %s forgotten: %s", rec.instance_id, why)
        for gauge in PER_INSTANCE_GAUGES:
            gauge.remove(rec.instance_id)  # (nothing to remove if it never reported)
        M_DISPATCHES.remove(rec.instance_id)
        self._update_gauges_states()
