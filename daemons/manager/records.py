"""What the manager holds of each instance (``InstanceRecord``) and the manager's metrics."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from daemons import metrics, policy, wire

M_INSTANCES = metrics.gauge("manager", "llumnix_manager_instances", "Instances in the cluster view, by state", ["state"],
                            preset=[("alive",), ("stopping",), ("dead",)])
M_DISPATCHES = metrics.counter("manager", "llumnix_manager_dispatches_total", "Dispatch decisions, by instance",
                               ["instance_id"])
M_CACHE_DISPATCHES = metrics.counter("manager", "llumnix_manager_cache_dispatches_total",
                                     "llumnix-cache dispatches of requests cached somewhere, by what decided: cache (another "
                                     "instance than llumnix would pick) or load (the same)", ["decided_by"],
                                     preset=[("cache",), ("load",)])
M_NO_INSTANCE = metrics.counter("manager", "llumnix_manager_dispatch_failures_total",
                                "Dispatch queries with no eligible instance")
M_DEATHS = metrics.counter("manager", "llumnix_manager_instance_deaths_total",
                           "Instances marked dead: their connection went down, or (connection not watched, or up "
                           "but silent past manager.silent_dead_s) they stopped reporting")
M_LATE = metrics.counter("manager", "llumnix_manager_late_instances_total",
                         "Times an instance missed manager.dead_after_missed heartbeats while its connection was "
                         "up: late, kept in dispatch, not marked dead")
M_LINKS_HEALED = metrics.counter("manager", "llumnix_manager_instance_links_healed_total",
                                 "Connections to instances dropped (no keepalive answered within "
                                 "manager.link_timeout_s) that a reconnection healed: not marked dead")
# Per instance, what only the manager knows. What an instance knows of itself (blocks used, running and waiting
# requests) is exported by the instance alone: llumnix_instance_kv_blocks_used, _running_requests, _waiting_requests.
M_PREFIX_INDEX = metrics.gauge("manager", "llumnix_manager_prefix_index_blocks",
                               "Cached blocks in the manager's prefix index, summed over the instances that hold them")
M_FREENESS = metrics.gauge("manager", "llumnix_instance_freeness",
                           "Freeness (M - sum V) / B as the manager computes it (-Inf while draining)", ["instance_id"])
M_USAGE = metrics.gauge("manager", "llumnix_instance_virtual_usage_blocks",
                        "Virtual usage sum V in blocks (+Inf while draining)", ["instance_id"])
M_DRAINING = metrics.gauge("manager", "llumnix_instance_draining",
                           "1 while the instance drains (drain, remove, scale-in, stopping)", ["instance_id"])
M_CORDONED = metrics.gauge("manager", "llumnix_instance_cordoned", "1 while the instance takes no new requests",
                           ["instance_id"])
M_BAD_FRAMES = metrics.counter("manager", "llumnix_manager_malformed_frames_total",
                               "Frames dropped because they did not decode")
M_REFUSED = metrics.counter("manager", "llumnix_manager_refused_messages_total",
                            "Messages refused because the sender's key (role) may not send them")
PER_INSTANCE_GAUGES = (M_FREENESS, M_USAGE, M_DRAINING, M_CORDONED)


@dataclass
class InstanceRecord:
    info: wire.Register
    identity: bytes
    load: wire.InstanceLoad
    last_seen: float
    state: str = "alive"  # alive | stopping (said goodbye, still serves what it has) | dead (connection lost)
    drain_reason: str = ""  # non-empty while draining: operator, remove, scale-in (stopping drains too)
    cordoned: bool = False
    registered_at: float = 0.0
    credit0: float = 0.0  # blocks of negative usage it started with (a new instance joining a loaded cluster)
    credit_age0: float = 0.0  # its age when it registered
    orders: int = 0  # manager-ordered migrations in flight with it as source or destination
    # Dispatches not yet visible in the instance's reports: (dispatch number, blocks, time). They count as
    # usage so that a burst between two reports does not all land on the same "freest" instance.
    dispatched_n: int = 0
    pending: deque = field(default_factory=deque)
    principal: str = ""  # role:name of the key it registered with (CURVE); another key cannot take its id
    gauge_state: str = ""  # its state as llumnix_manager_instances last counted it
    reports: int = 0  # load reports taken (the cached policy state below is of one of them)
    state_key: tuple = ()
    cached_state: object = None
    late: bool = False  # missed heartbeats with its connection up (logged once per episode)
    probe: object = None  # a DEALER to its request socket that only carries keepalives (daemons/links.py)

    @property
    def instance_id(self) -> str:
        return self.info.instance_id

    @property
    def draining(self) -> bool:
        return bool(self.drain_reason) or self.state == "stopping"

    def credit(self, now: float, window_s: float) -> float:
        return policy.fading_credit(self.credit0, self.credit_age0 + now - self.registered_at, window_s)

    def retire_pending(self, now: float, ttl: float) -> None:
        received = self.load.requests_received
        while self.pending and (self.pending[0][0] <= received or now - self.pending[0][2] > ttl):
            self.pending.popleft()
