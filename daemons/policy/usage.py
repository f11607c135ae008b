"""Virtual usage and freeness: the one load measure every policy reads (docs/architecture.md "Scheduling").

Virtual usage of an instance, in KV blocks: the blocks its requests really hold, plus the blocks of
dispatches not yet in its reports, plus the full demand of its head-of-line queued request
(de-fragmentation: a long prompt that does not fit makes its instance look full), plus headroom for every
running high-priority request (execution priority: normal requests move away from it), minus a credit
while a new instance is being filled, plus (the slo policy) the usage its predicted TPOT adds as it nears
the target (daemons/policy/slo.py). A draining instance carries a fake request of infinite usage.

Freeness F = (M - sum V) / B: free blocks per request in the batch. Higher is freer, everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

INF = math.inf


@dataclass(frozen=True)
class InstanceState:
    """One instance as the policies see it: its last load report and the manager's flags, plain values."""

    instance_id: str
    blocks_total: int
    blocks_used: int = 0  # real usage: running, suspended (migrating out) and reserved (migrating in) blocks
    running: int = 0
    waiting: int = 0
    hol_demand: int = 0  # blocks the head-of-line queued request needs to be admitted
    high_priority: int = 0  # running requests of high execution priority
    pending_blocks: int = 0  # dispatched to it, not yet visible in its reports
    pending_requests: int = 0
    alive: bool = True
    draining: bool = False  # drained by an operator, scaled in or stopping: its requests all move out
    cordoned: bool = False  # takes no new requests, keeps what it runs
    credit: float = 0.0  # blocks of negative usage: a new instance is filled first
    migrations: int = 0  # manager-ordered migrations in flight with it as source or destination
    block_size: int = 16  # tokens per block
    host: str = ""  # the host it runs on (instance.host; empty: unknown, taken as the same host as every other)
    scale_in_protected: bool = False  # auto-scaling never picks it to retire
    # The SLO's inputs (daemons/policy/slo.py), from its load report:
    batch_size: int = 0  # most requests it runs at once
    waiting_tokens: int = 0  # prompt tokens queued
    waiting_high: int = 0  # queued requests of high priority, and their prompt tokens
    waiting_high_tokens: int = 0
    context_tokens: int = 0  # tokens its running requests hold
    latency: object = None  # its fitted step-time model (wire.LatencyFit; None: none yet)
    slo_usage: float = 0.0  # blocks of virtual usage its predicted TPOT adds (slo.latency_usage; 0: off)
    role: str = "mixed"  # "mixed" | "prefill" | "decode" (daemons/policy/disagg.py)
    outlook: object = None  # what its requests will still claim (wire.Outlook; None: not reported)
    pending_final_blocks: int = 0  # KV our pending dispatches will hold at their expected final lengths
    pending_cached_tokens: int = 0  # prompt tokens of our pending dispatches it holds cached (no prefill to wait for)
    adapters: tuple[str, ...] = ()  # the LoRA adapters it holds (daemons/policy/residency.py)
    adapter_slots: int = 0  # its open adapter slots (free, or holding an adapter no request runs with)
    restore_ms_per_block: float = 0.0  # a block from its host KV tier back into its engine (0: not measured)
    retained_blocks: int = 0  # blocks it retains for idle sessions (engine and tier): what re-homing may move
    tier_capacity: int = 0  # its host KV tier's size in blocks (0: none: nothing can be re-homed to it)
    block_nbytes: int = 0  # bytes of one KV block, every layer (0: unknown): what pricing a pull or a restore reads

    @property
    def batch(self) -> int:
        """B of freeness: the requests it serves, queued and dispatched-but-unreported included."""
        return self.running + self.waiting + self.pending_requests

    @property
    def dispatchable(self) -> bool:
        return self.alive and not self.draining and not self.cordoned

    @property
    def busy(self) -> bool:
        return self.running + self.waiting > 0


def freeness(blocks_total: int, usage: float, batch_size: int) -> float:
    """F = (M - sum V) / B: KV blocks left per request in the batch (how long it can keep decoding)."""
    return (blocks_total - usage) / max(batch_size, 1)


def real_usage(s: InstanceState) -> float:
    """Blocks in use plus dispatches not yet reported: what a load-aware dispatcher without migration sees."""
    return s.blocks_used + s.pending_blocks


def headroom_blocks(blocks_total: int, headroom: float) -> float:
    """The virtual usage one running high-priority request adds to an instance of ``blocks_total`` blocks."""
    return headroom * blocks_total


def virtual_usage(s: InstanceState, headroom: float) -> float:
    if s.draining:
        return INF
    return (real_usage(s) + s.hol_demand + s.high_priority * headroom_blocks(s.blocks_total, headroom)
            - s.credit + s.slo_usage)


def instance_freeness(s: InstanceState, headroom: float) -> float:
    """Freeness by virtual usage: what dispatch (llumnix), pairing and the status table use."""
    return freeness(s.blocks_total, virtual_usage(s, headroom), s.batch)


def real_freeness(s: InstanceState) -> float:
    """Freeness by real usage only (the infaas++ baseline)."""
    return freeness(s.blocks_total, real_usage(s), s.batch)


def scaling_freeness(s: InstanceState) -> float:
    """Freeness of the normal-priority load: virtual usage without priority headroom or new-instance credit."""
    return freeness(s.blocks_total, real_usage(s) + s.hol_demand + s.slo_usage, s.batch)


def request_usage(blocks: int, high: bool, blocks_total: int, headroom: float) -> float:
    """Virtual usage of one running request on an instance of ``blocks_total`` blocks."""
    return blocks + (headroom_blocks(blocks_total, headroom) if high else 0.0)


def potential(usages: list[tuple[float, int]]) -> float:
    """The imbalance potential sum V_i^2 / M_i over (V_i, M_i) (sum V_i^2 / M on equal instances). It is
    least when every instance carries usage in proportion to its size; every balancing move lowers it."""
    return sum(v * v / max(m, 1) for v, m in usages)


def move_lowers_potential(src_usage: float, src_blocks: int, dst_usage: float, dst_blocks: int,
                          out: float, into: float) -> bool:
    """Would taking ``out`` blocks of virtual usage off the source and adding ``into`` to the destination
    lower the potential? Always, from a draining (infinitely used) source."""
    if math.isinf(src_usage):
        return True
    before = potential([(src_usage, src_blocks), (dst_usage, dst_blocks)])
    after = potential([(src_usage - out, src_blocks), (dst_usage + into, dst_blocks)])
    return after < before - 1e-9 * max(1.0, before)


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // max(block_size, 1))


def fading_credit(blocks: float, age_s: float, window_s: float) -> float:
    """A new instance's credit at ``age_s``: ``blocks`` at first, fading linearly to 0 over ``window_s``."""
    if window_s <= 0 or age_s >= window_s or age_s < 0:
        return 0.0
    return blocks * (1.0 - age_s / window_s)


def state_of(instance_id: str, load, **flags) -> InstanceState:
    """An InstanceState from a load report (wire.InstanceLoad) and the manager's flags."""
    return InstanceState(instance_id, load.blocks_total, blocks_used=load.blocks_used, running=load.running,
                         waiting=load.waiting, hol_demand=load.hol_demand_blocks, high_priority=load.high_priority,
                         block_size=load.block_size, batch_size=load.batch_size, waiting_tokens=load.waiting_tokens,
                         waiting_high=load.waiting_high, waiting_high_tokens=load.waiting_high_tokens,
                         context_tokens=load.context_tokens, latency=load.latency,
                         role=getattr(load, "role", "mixed") or "mixed", outlook=getattr(load, "outlook", None),
                         adapters=tuple(getattr(load, "adapters", ())), adapter_slots=getattr(load, "adapter_slots", 0),
                         restore_ms_per_block=getattr(load, "restore_ms_per_block", 0.0) or 0.0,
                         retained_blocks=getattr(load, "retained_blocks", 0) or 0,
                         tier_capacity=getattr(load, "tier_capacity", 0) or 0,
                         block_nbytes=getattr(load, "block_nbytes", 0) or 0, **flags)
