"""Roles (prefill/decode disaggregation, daemons/policy/disagg.py): an operator's ``llumnixctl role``, the
handovers prefill instances offer (each a migration ordered with reason "handover", or "role" for a request that
was decoding when its instance became prefill), and the adaptive rule that moves instances between the prefill
and decode roles by their predicted TTFT and TPOT against the SLO."""

from __future__ import annotations

import dataclasses
import logging

import msgspec

from daemons import metrics, wire
from daemons.manager.handover_links import tp_refusal
from daemons.manager.orders import Orders
from daemons.manager.records import InstanceRecord
from daemons.manager.shared import Shared
from daemons.policy import disagg, slo

log = logging.getLogger("llumnix.manager")

M_HANDOVERS = metrics.counter("manager", "llumnix_manager_handovers_offered_total",
                              "Requests prefill instances offered for a handover, by what the manager did: ordered "
                              "(a decode destination was chosen), no_destination (none had room: it keeps decoding "
                              "where it is and is offered again), stale (from an instance we do not know as live, or "
                              "a request whose handover is in flight)",
                              ["result"])
M_ROLE_CHANGES = metrics.counter("manager", "llumnix_manager_role_changes_total",
                                 "Role changes the manager sent, by new role and reason (operator, adaptive)",
                                 ["role", "reason"])


class Roles:
    """Owns the roles it set (``assigned``: said again when an instance registers anew) and the adaptive rule's
    memory. Reads the cluster view; orders handovers through ``orders`` and tells instances their role through
    ``send``."""

    def __init__(self, shared: Shared, orders: Orders):
        cfg = shared.cfg
        self.dc = cfg.disagg
        self.max_in_flight = cfg.migration.max_in_flight
        self.sc = cfg.scheduling
        self.classes = slo.Classes(cfg.slo)
        self.cluster, self.send, self.clock, self.spawn = shared.cluster, shared.send, shared.clock, shared.spawn
        self.orders = orders
        self.assigned: dict[str, str] = {}  # instance id -> the role we told it last
        self.handing: set[str] = set()  # request ids whose handover order is in flight
        self.incoming: dict[str, list[tuple[str, int]]] = {}  # destination -> (source, blocks) of each handover in flight
        self.adapt_rules = disagg.adapt_rules_of(cfg.disagg, cfg.slo)
        self.memory = disagg.AdaptMemory()  # the adaptive rule's memory between looks

    # ------------------------------------------------------------------ an operator's role change

    def on_role(self, msg: wire.RoleQuery) -> wire.Message:
        r = self.cluster.get(msg.instance_id)
        if r is None or r.state == "dead":
            return wire.ErrorReply(msg.query_id, f"{msg.instance_id!r} is not a live instance (see llumnixctl status)")
        current = r.load.role or "mixed"
        if not msg.role:
            return wire.RoleReply(msg.query_id, r.instance_id, current, current)
        if msg.role not in disagg.ROLES:
            return wire.ErrorReply(msg.query_id, f"unknown role {msg.role!r} (known: {', '.join(disagg.ROLES)})")
        refusal = tp_refusal(msgspec.structs.replace(r.info, load=msgspec.structs.replace(r.load, role=msg.role)),
                             self.cluster.records())
        if refusal:
            return wire.ErrorReply(msg.query_id, refusal.replace(f"instance {r.instance_id} ({msg.role}) refused",
                                                                 f"role {msg.role} for {r.instance_id} refused"))
        moving = r.load.running if msg.role == "prefill" and current != "prefill" else 0
        self.set_role(r, msg.role, "operator")
        return wire.RoleReply(msg.query_id, r.instance_id, msg.role, current, moving)

    def set_role(self, r: InstanceRecord, role: str, reason: str) -> None:
        """Tell ``r`` its new role; our view shows it at once (its next report confirms it)."""
        self.assigned[r.instance_id] = role
        self.cluster.set_role(r, role)
        self.send(r, wire.SetRole(role, reason))
        M_ROLE_CHANGES.labels(role, reason).inc()
        log.info("instance %s: role %s (%s)", r.instance_id, role, reason)

    def joined(self, r: InstanceRecord) -> None:
        """An instance registered: one that lost the role we set (it restarted) is told again."""
        role = self.assigned.get(r.instance_id)
        if role is not None and role != (r.load.role or "mixed"):
            self.send(r, wire.SetRole(role, "repeated"))
            self.cluster.set_role(r, role)

    async def loop(self) -> None:
        """With ``disagg.adaptive``, the adaptive rule looks at the cluster every second (it changes a role only on
        an imbalance sustained ``disagg.adapt_sustain_s``, at most once per ``disagg.adapt_interval_s``)."""
        while True:
            await self.clock.sleep(min(1.0, self.dc.adapt_interval_s))
            if self.dc.adaptive:
                self.adapt_once()

    def adapt_once(self) -> disagg.RoleChange | None:
        """One look of the adaptive rule (daemons/policy/disagg.py ``adapt``); the change it makes, if any."""
        now = self.clock.monotonic()
        change, self.memory = disagg.adapt(self.cluster.states(now), self.adapt_rules, self.memory, now)
        if change is not None:
            r = self.cluster.get(change.instance_id)
            if r is not None:
                log.info("adaptive roles: %s becomes %s (%s)", change.instance_id, change.role, change.reason)
                self.set_role(r, change.role, "adaptive")
        return change

    def launched(self, r: InstanceRecord) -> None:
        """An instance that auto-scaling (or ``llumnixctl add``) started registered: while instances have roles,
        it takes the role that is short (by the SLO's predictions; decode without targets)."""
        now = self.clock.monotonic()
        states = [s for s in self.cluster.states(now) if s.instance_id != r.instance_id]
        role = disagg.short_role(states, self.adapt_rules)
        if role != "mixed" and role != (r.load.role or "mixed"):
            self.set_role(r, role, "scale-out")

    # ------------------------------------------------------------------ handovers

    def on_handover(self, msg: wire.HandoverReady) -> None:
        """A prefill instance's request has its first token (or decodes where it no longer belongs): choose the
        decode instance now, by the policy in force, and order the move."""
        src = self.cluster.get(msg.instance_id)
        # (The instance offers only while in role prefill; our view may still show a report sent before our SetRole.)
        if src is None or src.state == "dead" or msg.request_id in self.handing:
            M_HANDOVERS.labels("stale").inc()
            return
        now = self.clock.monotonic()
        # The handed-over request's SLO, once, as it comes in: its own TPOT target (the Submit's), else its class's.
        tpot_s = msg.slo_tpot_ms / 1000.0 or self.classes.of(msg.priority).targets.tpot_s
        # A destination receiving from migration.max_in_flight other sources would refuse one more (a source's own
        # moves to one destination queue behind each other, so they never do).
        states = [self._with_incoming(s) for s in self.cluster.states(now) if self._takes(s.instance_id, src.instance_id)]
        dst_id = disagg.handover_destination(states, src.instance_id, msg.prompt_tokens, msg.blocks,
                                             tpot_s, self.sc.high_priority_headroom, msg.priority)
        dst = self.cluster.get(dst_id) if dst_id else None
        if dst is None:
            M_HANDOVERS.labels("no_destination").inc()
            return
        M_HANDOVERS.labels("ordered").inc()
        self.handing.add(msg.request_id)
        self.incoming.setdefault(dst.instance_id, []).append((src.instance_id, msg.blocks))
        start = wire.MigrateStart(0, dst=dst.instance_id, dst_address=dst.info.request_address,
                                  request_ids=[msg.request_id], reason=msg.reason or "handover",
                                  blocking=not self.dc.handover_precopy)
        self.spawn(self._hand_over(src, start, msg.request_id, (src.instance_id, msg.blocks)))

    def _takes(self, dst: str, src: str) -> bool:
        sources = {s for s, _ in self.incoming.get(dst, ())}
        return src in sources or len(sources) < self.max_in_flight

    def _with_incoming(self, s):
        """``s`` with the handovers in flight to it counted as its own pending dispatches: the handovers of one
        step's prefills (offered together) spread over the decode instances instead of all choosing the freest."""
        blocks = self.incoming.get(s.instance_id)
        if not blocks:
            return s
        return dataclasses.replace(s, pending_blocks=s.pending_blocks + sum(b for _, b in blocks),
                                   pending_requests=s.pending_requests + len(blocks))

    async def _hand_over(self, src: InstanceRecord, start: wire.MigrateStart, request_id: str,
                         entry: tuple[str, int]) -> None:
        try:
            await self.orders.run_order(src, start)
        finally:
            self.handing.discard(request_id)
            ledger = self.incoming.get(start.dst)
            if ledger is not None:
                ledger.remove(entry)
                if not ledger:
                    del self.incoming[start.dst]

