"""LoRA residency: among the instances a request may go to, those that hold its adapter, or, when none holds it or
every holder is hot, those that may load it (within lora.max_replicas). The dispatch policy in force then picks
within that pool (daemons/policy/dispatch.py ``place``): residency narrows where a request may go, the policy
(virtual usage, the SLO's predictions, the prefix cache) still decides."""

from __future__ import annotations

from daemons.policy.usage import InstanceState


def serves_adapters(s: InstanceState) -> bool:
    """The instance holds LoRA adapters or has slots open for them (lora.slots > 0)."""
    return s.adapter_slots > 0 or bool(s.adapters)


def hot(s: InstanceState) -> bool:
    """A request sent there now would queue: some already wait, or its batch is full with our dispatches."""
    return s.waiting > 0 or (s.batch_size > 0 and s.running + s.pending_requests >= s.batch_size)


def adapter_pool(states: list[InstanceState], adapter: str, max_replicas: int = 0) -> list[InstanceState]:
    """The instances a request for ``adapter`` ("": the base model, every instance) is dispatched among: the
    holders that are not hot. When every holder is hot (or none holds it) and fewer than ``max_replicas`` hold it
    (0 = no bound): the holders and the instances that could load it now (an open slot: free, or holding an
    adapter no request runs with) and are not hot; when none is, the holders alone (a load would only join a
    queue), or with no holder, those that could load it, else every instance that serves adapters."""
    if not adapter:
        return states
    able = [s for s in states if s.dispatchable and serves_adapters(s)]
    holders = [s for s in able if adapter in s.adapters]
    cool = [s for s in holders if not hot(s)]
    if cool:
        return cool
    replicas = sum(1 for s in states if s.alive and adapter in s.adapters)
    if holders and max_replicas and replicas >= max_replicas:
        return holders
    open_ = [s for s in able if adapter not in s.adapters and s.adapter_slots > 0]
    room = [s for s in open_ if not hot(s)]
    if room:
        return holders + room
    return holders or open_ or able
