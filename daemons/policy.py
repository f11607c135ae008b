"""Scheduling policy: pure functions over load snapshots. No sockets, clocks or engines in here.

One sign convention everywhere: *freeness*, higher is freer.
"""

from __future__ import annotations

from dataclasses import dataclass

from daemons.wire import InstanceLoad

DISPATCH_POLICIES = ("llumnix", "rr", "flood")


@dataclass(frozen=True)
class Candidate:
    """What dispatch needs to know about one instance."""

    instance_id: str
    blocks_total: int
    usage: float  # sum of the virtual usages of its requests, in blocks
    batch_size: int  # requests the instance serves: running, queued and dispatched-but-unreported
    alive: bool = True
    draining: bool = False

    @property
    def eligible(self) -> bool:
        return self.alive and not self.draining


def freeness(blocks_total: int, usage: float, batch_size: int) -> float:
    """F = (M - sum V) / B: KV blocks left per request in the batch (how long it can keep decoding). Higher is freer."""
    return (blocks_total - usage) / max(batch_size, 1)


def candidate(instance_id: str, load: InstanceLoad, pending_blocks: int = 0, pending_requests: int = 0,
              alive: bool = True, draining: bool = False) -> Candidate:
    """Real usage for now: blocks in use, the head-of-line request's demand, and dispatches not yet reported."""
    usage = load.blocks_used + load.hol_demand_blocks + pending_blocks
    batch = load.running + load.waiting + pending_requests
    return Candidate(instance_id, load.blocks_total, usage, batch, alive, draining)


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // max(block_size, 1))


def dispatch(policy: str, candidates: list[Candidate], turn: int) -> str | None:
    """Pick the instance for a new request, or None when no instance may take one.

    ``turn`` is a counter the caller advances on every dispatch: round-robin uses it, and the llumnix
    policy uses it to rotate among equally free instances so that ties do not starve anyone.
    """
    eligible = sorted((c for c in candidates if c.eligible), key=lambda c: c.instance_id)
    if not eligible:
        return None
    if policy == "rr":
        return eligible[turn % len(eligible)].instance_id
    if policy == "flood":
        return eligible[0].instance_id
    if policy == "llumnix":
        scored = [(freeness(c.blocks_total, c.usage, c.batch_size), c.instance_id) for c in eligible]
        best = max(f for f, _ in scored)
        ties = [iid for f, iid in scored if best - f <= 1e-9]
        return ties[turn % len(ties)]
    raise ValueError(f"unknown dispatch policy {policy!r} (known: {', '.join(DISPATCH_POLICIES)})")
