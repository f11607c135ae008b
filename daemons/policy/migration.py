"""Migration policy: which instances pair up, and which requests a source sends.

Pairing (the manager, every interval): instances whose freeness is below the migrate-out threshold, and
every draining instance, are sources; instances above the migrate-in threshold are destinations. The
least free source goes with the freest destination, the next with the next, each instance in at most
one pair, and only where the source is less free than its destination and carries more usage per block
(otherwise no move could lower the imbalance).

Selection (the source's llumlet, when ordered): which of its requests go, in the policy's order, each
only if moving it lowers the imbalance potential (sum V_i^2 / M_i) of the pair, so migrations never
overshoot into ping-pong. A draining source sends everything. With prefix caching, the cost of a move is
the blocks the destination does not hold already (the source asks it first: wire.PrefixQuery).

Across hosts (``CrossNode``, when scheduling.cross_node_bandwidth_gbps is set): a balancing move between
instances on different hosts pays only when its KV crosses the link faster than the source could
recompute what the move saves it: transfer_ms(b) + overhead_ms <= saving_ms, where transfer_ms(b) is b
blocks' KV bytes at the link's bandwidth and saving_ms is the recomputation (prefill) of an average
request of the source, the preemption that the move avoids. That bounds the blocks a cross-host order
may move (``cross_node_budget_blocks``); a source none of whose requests could pay is not paired across
hosts (another destination, maybe on its own host, is tried). Same-host pairs and drains are unaffected.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from daemons.policy.registry import SELECTION
from daemons.policy.slo import HIGH, class_of
from daemons.policy.usage import (INF, InstanceState, blocks_for, instance_freeness, move_lowers_potential,
                                  real_usage, request_usage, virtual_usage)
from daemons.wire import RequestLoad

# What a destination holds beyond a migrating request's blocks while it copies (migration.py reserves
# last_stage_max_blocks + 2: 3 at its default of 1, 4 at 2), so that the last stage needs no new reservation.
COPY_HEADROOM_BLOCKS = 4


@dataclass(frozen=True)
class CrossNode:
    """The cross-host cost check: plain values from scheduling.cross_node_* (and what migrations showed)."""

    bandwidth_gbps: float = 0.0  # what a migration between two hosts achieves, Gbit/s; 0: no check
    kv_bytes_per_token: float = 0.0  # KV bytes of one token of the served model; 0: unknown, no check
    recompute_ms_per_token: float = 0.1  # prefill time per token of context: what a preemption costs
    overhead_ms: float = 20.0  # one migration's time besides moving its bytes: stages, handshakes, downtime

    @property
    def on(self) -> bool:
        return self.bandwidth_gbps > 0 and self.kv_bytes_per_token > 0


def crosses_hosts(a: InstanceState, b: InstanceState) -> bool:
    """Whether a move between the two leaves a host. An instance of unknown host is taken as local."""
    return bool(a.host) and bool(b.host) and a.host != b.host


def transfer_ms(tokens: float, kv_bytes_per_token: float, bandwidth_gbps: float) -> float:
    """Time to move ``tokens`` tokens' KV over a link of ``bandwidth_gbps``."""
    if bandwidth_gbps <= 0:
        return INF
    return tokens * kv_bytes_per_token * 8 / (bandwidth_gbps * 1e6)


def cross_node_saving_ms(src: InstanceState, cost: CrossNode) -> float:
    """What moving a request off ``src`` saves it: the recomputation of a preempted request, taken as one
    of the source's average context (its blocks per running request)."""
    tokens = src.blocks_used / max(src.running, 1) * src.block_size
    return cost.recompute_ms_per_token * tokens


def cross_node_budget_blocks(src: InstanceState, cost: CrossNode) -> float:
    """The most KV blocks (of the source's block size) a move from ``src`` to another host pays for:
    transfer_ms + overhead_ms <= saving_ms. INF when the check is off; 0 when nothing pays."""
    if not cost.on:
        return INF
    per_block = transfer_ms(src.block_size, cost.kv_bytes_per_token, cost.bandwidth_gbps)
    return max(0.0, (cross_node_saving_ms(src, cost) - cost.overhead_ms) / per_block)


@dataclass(frozen=True)
class Pair:
    src: str
    dst: str
    count: int  # most requests the source may send in this order
    drain: bool  # the source is draining: everything goes, cooldown ignored
    src_usage: float  # the two instances' virtual usage when paired (the source's selection checks moves with it)
    dst_usage: float
    dst_blocks: int
    dst_free: float  # blocks the destination really has free (what it can reserve); for a cross-host pair
    # at most the budget (plus the copy headroom): the source's selection then skips larger requests
    cross_node: bool = False  # the two are on different hosts and the cost check is on
    budget_blocks: float = INF  # most blocks a move of this pair pays for (INF: no limit)


def pair(states: list[InstanceState], headroom: float, out_threshold: float, in_threshold: float,
         max_per_instance: int, balance: bool = True, turn: int = 0, cross_node: CrossNode | None = None) -> list[Pair]:
    """Source/destination pairs for this interval. ``balance`` False: only draining instances are sources
    (the baseline policies, and pairing_policy off). ``turn`` rotates the order of equally loaded instances.
    ``cross_node``: the cost check for pairs on different hosts (see the module docstring)."""
    cost = cross_node or CrossNode()
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
            dst_free = max(0.0, dst.blocks_total - real_usage(dst))
            remote = cost.on and not src.draining and crosses_hosts(src, dst)
            budget = cross_node_budget_blocks(src, cost) if remote else INF
            if budget < 1:
                continue  # no request of this source pays for the link: try a destination nearer by
            count = max_per_instance - max(src.migrations, dst.migrations)
            pairs.append(Pair(src.instance_id, dst.instance_id, count, src.draining, usage[src.instance_id],
                              usage[dst.instance_id], dst.blocks_total, min(dst_free, budget + COPY_HEADROOM_BLOCKS),
                              remote, budget))
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
                    exclude: frozenset[str] | set[str] = frozenset(), dst_free: float = INF,
                    cached: Mapping[str, int] | None = None) -> list[Choice]:
    """Up to ``count`` requests for the source to send, in the policy's order, each lowering the pair's
    potential given the ones chosen before it (a draining source: no such check).

    ``requests`` is the engine's list (running in admission order first); ``exclude`` holds requests that
    must stay (already migrating, arrived too recently). Only running requests migrate; a queued request
    that never produced a token is re-dispatched instead (first-waiting puts those first, up to ``count``;
    a drain re-dispatches all of them, besides ``count`` migrations). The migrations chosen must fit in
    ``dst_free`` blocks, with the few blocks of headroom each reserves while it copies.

    ``cached``: by request, the leading blocks the destination's prefix cache holds already (a shared
    prompt prefix), which a move would not send. The llumnix and first-waiting orders weigh a request by
    the blocks that would move (fewest first); its room at the destination counts only those.
    """
    cached = cached or {}
    chosen_policy = SELECTION.get(policy)
    running = [r for r in requests if r.state == "running" and r.request_id not in exclude]
    ordered: list[tuple[RequestLoad, bool]] = [(r, False) for r in chosen_policy.order(running, cached)]
    if chosen_policy.queued_first or drain:
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
            high = class_of(r.priority) == HIGH
            out = request_usage(r.blocks, high, src_blocks, headroom)
            into = request_usage(r.blocks, high, dst_blocks, headroom)
        if not drain and not move_lowers_potential(src_usage, src_blocks, dst_usage, dst_blocks, out, into):
            continue
        room = 0 if redispatch else r.blocks - min(cached.get(r.request_id, 0), r.blocks) + COPY_HEADROOM_BLOCKS
        if room > dst_free:
            continue
        dst_free -= room
        chosen.append(Choice(r.request_id, redispatch, out))
        counted += not (drain and redispatch)
        src_usage -= out
        dst_usage += into
    return chosen
