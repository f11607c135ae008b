"""Handovers out of a prefill instance (prefill/decode disaggregation, daemons/policy/disagg.py): while the
instance serves in role prefill, a request placed here by a proxy that has produced a token here is ready to go
to a decode instance. The manager is told (wire.HandoverReady); it chooses the destination then, and orders the
move, a live migration with reason "handover" (the request keeps decoding here meanwhile). A request the manager
does not move within the lease (no decode instance has room, the manager is away) is offered again; a request
that was running here when the role changed to prefill is offered at its next token (reason "role")."""

from __future__ import annotations

from daemons import wire
from daemons.instance.shared import Shared
from daemons.policy.disagg import handover_blocks


class Handovers:
    """Owns the requests offered to the manager and when (``offered``). Reads the role (``standing``), the request
    table (placed here or arrived by migration, prompt length, priority, SLO) and the block size."""

    def __init__(self, shared: Shared, lease_s: float):
        self.standing, self.requests, self.ident, self.tell_manager, self.clock = (
            shared.standing, shared.requests, shared.ident, shared.tell_manager, shared.clock)
        self.engine = shared.engine  # its block size only
        self.lease_s = lease_s
        self.offered: dict[str, float] = {}  # request id -> when it was offered
        self.before: set[str] = set()  # requests held when the role became prefill (moved for the role)
        self.standing.watch_role(self.role_changed)

    def role_changed(self, old: str, new: str) -> None:
        """What runs here when the role becomes prefill moves for the role; leaving prefill, nothing is offered."""
        self.offered.clear()
        self.before = {rid for rid, _ in self.requests.items()} if new == "prefill" else set()

    def outputs(self, outputs: list[wire.TokenOut]) -> None:
        """(After a step, its tokens sent) Offer the requests that decode here but belong on a decode instance."""
        if self.standing.role != "prefill":
            return
        now = self.clock.monotonic()
        for out in outputs:
            rid = out.request_id
            if out.finish_reason is not None:
                self.offered.pop(rid, None)
                self.before.discard(rid)
                continue
            at = self.offered.get(rid)
            if at is not None and now - at < self.lease_s:
                continue
            entry = self.requests.get(rid)
            if entry is None or entry.migrating:
                continue
            self.offered[rid] = now
            reason = "role" if rid in self.before or entry.arrived else "handover"
            slo_tpot_ms = entry.slo.tpot_s * 1000.0 if entry.slo is not None else 0.0
            self.tell_manager(wire.HandoverReady(
                self.ident.instance_id, rid, entry.prompt_tokens, handover_blocks(entry.prompt_tokens + out.index, self.engine.block_size),
                entry.priority, slo_tpot_ms, reason))
        if len(self.offered) + len(self.before) > 4 * max(len(self.requests), 16):
            self.offered = {r: t for r, t in self.offered.items() if r in self.requests}
            self.before = {r for r in self.before if r in self.requests}
