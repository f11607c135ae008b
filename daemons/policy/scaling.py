"""Auto-scaling: keep the cluster's average freeness inside [scale_up, scale_down].

``Scaler`` is a small state machine driven with explicit times (no clock inside), so the rule is tested
with plain values: below the band for ``sustain_s`` adds an instance, above it for ``sustain_s`` drains
the freest one, always within [min_instances, max_instances], at most one action per ``cooldown_s``.
Below ``min_instances`` (instances died) it adds without waiting for a sustained signal, but not before
``not_before`` (the manager's start plus time for the instances of a starting cluster, or of a restarted
manager, to register).

Instances count as serving while they are alive and not draining: a cordoned instance still serves what
it runs, and is the operator's business, not the scaler's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from daemons.policy.usage import InstanceState, scaling_freeness


def serving(states: list[InstanceState]) -> list[InstanceState]:
    return [s for s in states if s.alive and not s.draining]


def average_freeness(states: list[InstanceState]) -> float | None:
    """Mean freeness of the normal-priority load over the serving instances; None if there are none."""
    xs = serving(states)
    if not xs:
        return None
    return sum(scaling_freeness(s) for s in xs) / len(xs)


def scale_in_victim(states: list[InstanceState]) -> str | None:
    """The serving instance with the least normal-priority load to move (ties: the highest id, usually the
    newest), never one that is scale-in protected (None if every serving one is). Not by virtual usage: a new
    instance's credit would make it look freest."""
    xs = [s for s in serving(states) if not s.scale_in_protected]
    if not xs:
        return None
    return max(xs, key=lambda s: (scaling_freeness(s), s.instance_id)).instance_id


@dataclass
class Scaler:
    up_threshold: float
    down_threshold: float
    sustain_s: float
    cooldown_s: float
    min_instances: int
    max_instances: int
    not_before: float = -1e18
    below_since: float | None = field(default=None)
    above_since: float | None = field(default=None)
    last_action: float = field(default=-1e18)

    def observe(self, now: float, avg: float | None, serving: int, launching: int) -> str | None:
        """"up", "down" or None, given the average freeness now, the instances taking requests and those
        launched but not yet registered. The caller acts on "up"/"down" and the scaler starts its cooldown."""
        cooling = now - self.last_action < self.cooldown_s
        if serving + launching < self.min_instances:
            ok = now >= self.not_before and not cooling and serving + launching < self.max_instances
            return self._act(now, "up") if ok else None
        if avg is None:
            self.reset()
            return None
        self.below_since = (self.below_since if self.below_since is not None else now) if avg < self.up_threshold else None
        self.above_since = (self.above_since if self.above_since is not None else now) if avg > self.down_threshold else None
        if cooling:
            return None
        if self.below_since is not None and now - self.below_since >= self.sustain_s and serving + launching < self.max_instances:
            return self._act(now, "up")
        if (self.above_since is not None and now - self.above_since >= self.sustain_s and launching == 0
                and serving > self.min_instances):
            return self._act(now, "down")
        return None

    def reset(self) -> None:
        """Forget the signal seen so far (scaling was switched off, or there is nothing to measure)."""
        self.below_since = self.above_since = None

    def _act(self, now: float, what: str) -> str:
        self.last_action = now
        self.reset()
        return what
