"""Re-homing idle sessions (issue #52 item 5): which hot instances send which cooler ones their idle sessions' KV.

An instance is hot by the migration pairing's rule (its freeness, by virtual usage, below
scheduling.migrate_out_threshold) and has blocks retained for sessions (wire.InstanceLoad ``retained_blocks``);
a destination is cool by the same rule the other way (dispatchable, freeness above scheduling.migrate_in_threshold)
and has a host KV tier to take them in. The least free hot instance goes with the freest cool one, the next with the
next, each instance in at most one pair, and only where the destination is freer. Each hot instance is then told
to move up to ``count`` idle sessions (sessions.rehome_sessions): its next turns find their KV where there is room,
and the hot instance's memory is freed of KV that waits on people and tools."""

from __future__ import annotations

from dataclasses import dataclass

from daemons.policy.usage import InstanceState, instance_freeness


@dataclass(frozen=True)
class RehomePair:
    src: str  # the hot instance
    dst: str  # the cool one
    count: int  # most sessions to move


def rehome_pairs(states: list[InstanceState], headroom: float, out_threshold: float, in_threshold: float,
                 count: int) -> list[RehomePair]:
    """This round's (hot, cool) pairs (module text); none when ``count`` is 0."""
    if count <= 0:
        return []
    free = {s.instance_id: instance_freeness(s, headroom) for s in states}
    hot = sorted((s for s in states if s.alive and s.retained_blocks > 0 and free[s.instance_id] < out_threshold),
                 key=lambda s: (free[s.instance_id], s.instance_id))
    cool = sorted((s for s in states if s.dispatchable and s.tier_capacity > 0 and free[s.instance_id] > in_threshold),
                  key=lambda s: (-free[s.instance_id], s.instance_id))
    pairs, used = [], set()
    for src in hot:
        for dst in cool:
            if dst.instance_id in used or dst.instance_id == src.instance_id:
                continue
            if free[dst.instance_id] > free[src.instance_id]:
                pairs.append(RehomePair(src.instance_id, dst.instance_id, count))
                used.update((src.instance_id, dst.instance_id))
                break
    return pairs
