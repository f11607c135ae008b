"""Migration policy: which instances pair up, and which requests a source sends.

Pairing (the manager, every interval): instances whose freeness is below the migrate-out threshold, and
every draining instance, are sources; instances above the migrate-in threshold are destinations. The
least free source goes with the freest destination, the next with the next, each instance in at most
one pair, and only where the source is less free than its destination and carries more usage per block
(otherwise no move could lower the imbalance).

Selection (the source's llumlet, when ordered): which of its requests go, in the policy's order, each
only if moving it lowers the imbalance potential (sum V_i^2 / M_i) of the pair, so migrations never
overshoot into ping-pong. A draining source sends everything.
"""

from __future__ import annotations

from dataclasses import dataclass

from daemons.policy.usage import (INF, InstanceState, blocks_for, instance_freeness, move_lowers_potential,
                                  real_usage, request_usage, virtual_usage)
from daemons.wire import RequestLoad

PAIRING_POLICIES = ("llumnix", "off")
SELECTION_POLICIES = ("llumnix", "last-running", "longest", "first-waiting")
# What a destination holds beyond a migrating request's blocks while it copies (migration.py reserves
# last_stage_max_blocks + 2 at its default of 2), so that the last stage needs no new reservation.
COPY_HEADROOM_BLOCKS = 4


@dataclass(frozen=True)
class Pair:
    src: str
    dst: str
    count: int  # most requests the source may send in this order
    drain: bool  # the source is draining: everything goes, cooldown ignored
    src_usage: float  # the two instances' virtual usage when paired (the source's selection checks moves with it)
    dst_usage: float
    dst_blocks: int
    dst_free: float  # blocks the destination really has free (what it can reserve)


def pair(states: list[InstanceState], headroom: float, out_threshold: float, in_threshold: float,
         max_per_instance: int, balance: bool = True, turn: int = 0) -> list[Pair]:
    """Source/destination pairs for this interval. ``balance`` False: only draining instances are sources
    (the baseline policies, and pairing_policy off). ``turn`` rotates the order of equally loaded instances."""
    free = {s.instance_id: instance_freeness(s, headroom) for s in states}
    usage = {s.instance_id: virtual_usage(s, headroom) for s in states}

    def rotated(xs: list[InstanceState]) -> list[InstanceState]:
        xs = sorted(xs, key=lambda s: s.instance_id)
        k = turn % len(xs) if xs else 0
        return xs[k:] + xs[:k]

    sources = [s for s in rotated(states)
               if s.alive and s.busy and s.migrations < max_per_instance
               and (s.draining or (balance and free[s.instance_id] < out_threshold))]
    sources.sort(key=lambda s: free[s.instance_id])  # stable: ties keep the rotated order
    dests = [s for s in rotated(states) if s.dispatchable and s.migrations < max_per_instance]
    dests.sort(key=lambda s: -free[s.instance_id])
    used: set[str] = set()
    pairs: list[Pair] = []
    for src in sources:
        if src.instance_id in used:
            continue
        for dst in dests:
            if dst.instance_id in used or dst.instance_id == src.instance_id:
                continue
            f_src, f_dst = free[src.instance_id], free[dst.instance_id]
            if not f_dst > f_src:
                continue
            if not src.draining:
                if f_dst <= in_threshold:
                    continue
                if usage[src.instance_id] / max(src.blocks_total, 1) <= usage[dst.instance_id] / max(dst.blocks_total, 1):
                    continue
            count = max_per_instance - max(src.migrations, dst.migrations)
            pairs.append(Pair(src.instance_id, dst.instance_id, count, src.draining, usage[src.instance_id],
                              usage[dst.instance_id], dst.blocks_total, max(0.0, dst.blocks_total - real_usage(dst))))
            used.update((src.instance_id, dst.instance_id))
            break
    return pairs


@dataclass(frozen=True)
class Choice:
    request_id: str
    redispatch: bool  # a queued request that never produced a token: sent back through dispatch, no KV to copy
    usage: float  # the virtual usage it takes off the source


def _redispatchable(r: RequestLoad) -> bool:
    return r.state == "waiting" and r.output_tokens == 0


def select_migrants(policy: str, requests: list[RequestLoad], count: int, *, src_usage: float, src_blocks: int,
                    dst_usage: float, dst_blocks: int, headroom: float, block_size: int, drain: bool = False,
                    exclude: frozenset[str] | set[str] = frozenset(), dst_free: float = INF) -> list[Choice]:
    """Up to ``count`` requests for the source to send, in the policy's order, each lowering the pair's
    potential given the ones chosen before it (a draining source: no such check).

    ``requests`` is the engine's list (running in admission order first); ``exclude`` holds requests that
    must stay (already migrating, arrived too recently). Only running requests migrate; a queued request
    that never produced a token is re-dispatched instead (first-waiting puts those first, up to ``count``;
    a drain re-dispatches all of them, besides ``count`` migrations). The migrations chosen must fit in
    ``dst_free`` blocks, with the few blocks of headroom each reserves while it copies.
    """
    if policy not in SELECTION_POLICIES:
        raise ValueError(f"unknown request selection policy {policy!r} (known: {', '.join(SELECTION_POLICIES)})")
    running = [r for r in requests if r.state == "running" and r.request_id not in exclude]
    if policy == "last-running":
        running.reverse()
    elif policy == "longest":
        running.sort(key=lambda r: -r.blocks)
    else:
        running.sort(key=lambda r: (r.priority, r.blocks))
    ordered: list[tuple[RequestLoad, bool]] = [(r, False) for r in running]
    if policy == "first-waiting" or drain:
        queued = [r for r in requests if _redispatchable(r) and r.request_id not in exclude]
        queued.sort(key=lambda r: r.priority)  # stable: queue order within a priority; high ones go last
        ordered = [(r, True) for r in queued] + ordered
    chosen: list[Choice] = []
    counted = 0
    for r, redispatch in ordered:
        if counted >= count:
            break
        if redispatch:
            out = into = float(blocks_for(r.prompt_tokens + r.output_tokens + 1, block_size))
        else:
            out = request_usage(r.blocks, r.priority > 0, src_blocks, headroom)
            into = request_usage(r.blocks, r.priority > 0, dst_blocks, headroom)
        if not drain and not move_lowers_potential(src_usage, src_blocks, dst_usage, dst_blocks, out, into):
            continue
        room = 0 if redispatch else r.blocks + COPY_HEADROOM_BLOCKS
        if room > dst_free:
            continue
        dst_free -= room
        chosen.append(Choice(r.request_id, redispatch, out))
        counted += not (drain and redispatch)
        src_usage -= out
        dst_usage += into
    return chosen
