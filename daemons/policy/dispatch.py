"""Dispatch: which instance a new request goes to."""

from __future__ import annotations

from dataclasses import replace

from daemons.policy.usage import InstanceState, blocks_for, instance_freeness, real_freeness

DISPATCH_POLICIES = ("llumnix", "infaas++", "rr", "flood")
# The baselines dispatch without virtual usage and never migrate to rebalance (drains still migrate).
MIGRATING_POLICIES = ("llumnix",)


def dispatch(policy: str, states: list[InstanceState], turn: int, headroom: float = 0.0, priority: int = 0) -> str | None:
    """Pick the instance for a new request of ``priority``, or None when no instance may take one.

    ``turn`` is a counter the caller advances on every dispatch: round-robin uses it, and the freeness
    policies use it to rotate among equally free instances, so that ties do not starve anyone.

    The high-priority headroom is there to keep *normal* requests away from instances running high-priority
    ones; a high-priority request itself is placed by virtual usage without it, so high-priority requests
    gather where normal load is light instead of each one spreading headroom over another instance.
    """
    if policy not in DISPATCH_POLICIES:
        raise ValueError(f"unknown dispatch policy {policy!r} (known: {', '.join(DISPATCH_POLICIES)})")
    eligible = sorted((s for s in states if s.dispatchable), key=lambda s: s.instance_id)
    if not eligible:
        return None
    if policy == "rr":
        return eligible[turn % len(eligible)].instance_id
    if policy == "flood":
        return eligible[0].instance_id
    if priority > 0:
        headroom = 0.0
    score = (lambda s: instance_freeness(s, headroom)) if policy == "llumnix" else real_freeness
    scored = [(score(s), s.instance_id) for s in eligible]
    best = max(f for f, _ in scored)
    ties = [iid for f, iid in scored if best - f <= 1e-9 * max(1.0, abs(best))]
    return ties[turn % len(ties)]


def dispatch_batch(policy: str, states: list[InstanceState], requests: list[tuple[int, int]], turn: int,
                   headroom: float = 0.0) -> list[str | None]:
    """Dispatch requests that arrived together, given as (priority, prompt tokens): higher
    scheduling priority first, each to the freest instance once the ones before it are counted there.
    Returns the chosen instance per request, in the order given."""
    by_id = {s.instance_id: s for s in states}
    order = sorted(range(len(requests)), key=lambda i: -requests[i][0])  # stable: arrival order within a priority
    chosen: list[str | None] = [None] * len(requests)
    for k, i in enumerate(order):
        iid = dispatch(policy, list(by_id.values()), turn + k, headroom, requests[i][0])
        chosen[i] = iid
        if iid is not None:
            s = by_id[iid]
            by_id[iid] = replace(s, pending_blocks=s.pending_blocks + blocks_for(requests[i][1], s.block_size),
                                 pending_requests=s.pending_requests + 1)
    return chosen
