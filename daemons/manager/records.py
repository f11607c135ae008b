"""What the manager holds of each instance (``InstanceRecord``), the policies in force (``Policies``), and the
manager's metrics."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from daemons import metrics, policy, wire
from daemons.config import Config, ManagerConfig

log = logging.getLogger("llumnix.manager")

M_INSTANCES = metrics.gauge("manager", "llumnix_manager_instances", "Instances in the cluster view, by state", ["state"],
                            preset=[("alive",), ("stopping",), ("dead",)])
M_DISPATCHES = metrics.counter("manager", "llumnix_manager_dispatches_total", "Dispatch decisions, by instance",
                               ["instance_id"])
M_DISAGG = metrics.disagg_decisions("manager", "Dispatches answered")
M_CACHE_DISPATCHES = metrics.cache_dispatches("manager")
M_NO_INSTANCE = metrics.counter("manager", "llumnix_manager_dispatch_failures_total",
                                "Dispatch queries with no eligible instance")
M_DEATHS = metrics.counter("manager", "llumnix_manager_instance_deaths_total",
                           "Instances marked dead: their connection went down, or (connection not watched, or up "
                           "but silent past manager.silent_dead_s) they stopped reporting")
M_LATE = metrics.counter("manager", "llumnix_manager_late_instances_total",
                         "Times an instance missed manager.dead_after_missed heartbeats while its connection was "
                         "up: late, kept in dispatch, not marked dead")
M_LINKS_HEALED = metrics.links_healed("manager", "manager.link_timeout_s", "not marked dead")
# Per instance, what only the manager knows. What an instance knows of itself (blocks used, running and waiting
# requests) is exported by the instance alone: llumnix_instance_kv_blocks_used, _running_requests, _waiting_requests.
M_PREFIX_INDEX = metrics.prefix_index_blocks("manager", "the manager's")
M_FREENESS = metrics.gauge("manager", "llumnix_instance_freeness",
                           "Freeness (M - sum V) / B as the manager computes it (-Inf while draining)", ["instance_id"])
M_USAGE = metrics.gauge("manager", "llumnix_instance_virtual_usage_blocks",
                        "Virtual usage sum V in blocks (+Inf while draining)", ["instance_id"])
M_DRAINING = metrics.gauge("manager", "llumnix_instance_draining",
                           "1 while the instance drains (drain, remove, scale-in, stopping)", ["instance_id"])
M_CORDONED = metrics.gauge("manager", "llumnix_instance_cordoned", "1 while the instance takes no new requests",
                           ["instance_id"])
M_ROLE = metrics.gauge("manager", "llumnix_instance_role",
                       "1 for the instance's role (label role: mixed, prefill or decode), 0 for the others",
                       ["instance_id", "role"])
M_BAD_FRAMES = metrics.malformed_frames("manager")
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


def dead_after(mc: ManagerConfig) -> float:
    """Seconds of silence after which an instance is late (or dead, its connection not watched)."""
    return mc.heartbeat_interval_s * mc.dead_after_missed


class Policies:
    """The policies in force: from the config, changed at run time by ``llumnixctl policy`` (``change``). The
    dispatcher, the rescheduler's parts and the snapshot read them; only ``change`` writes them."""

    NAMES = ("dispatch_policy", "pairing_policy", "request_selection", "scaling_policy")

    def __init__(self, cfg: Config):
        self.dispatch_policy = cfg.manager.dispatch_policy
        self.pairing_policy = cfg.scheduling.pairing_policy
        self.request_selection = cfg.scheduling.request_selection
        self.scaling_policy = cfg.scaling.policy

    @property
    def migrating(self) -> bool:
        """Whether balancing migrations run: the llumnix dispatch policy with pairing on (drains always run)."""
        return self.dispatch.migrates and policy.PAIRING.get(self.pairing_policy).balances

    @property
    def dispatch(self) -> policy.DispatchPolicy:
        """The dispatch policy in force, as the object that knows what it does."""
        return policy.DISPATCH.get(self.dispatch_policy)

    def change(self, msg: wire.PolicyQuery) -> wire.Message:
        """``llumnixctl policy``: the policies ``msg`` names (all or none: an unknown one changes nothing)."""
        known = {"dispatch_policy": policy.DISPATCH, "pairing_policy": policy.PAIRING,
                 "request_selection": policy.SELECTION, "scaling_policy": policy.SCALING}
        wanted = {name: getattr(msg, name) for name in self.NAMES}
        for name, value in wanted.items():
            if value and value not in known[name]:
                return wire.ErrorReply(msg.query_id, f"unknown {name.replace('_', ' ')} {value!r} "
                                                     f"(known: {', '.join(known[name].names)})")
        for name, value in wanted.items():
            if value and value != getattr(self, name):
                log.info("%s: %s -> %s (llumnixctl policy)", name.replace("_", " "), getattr(self, name), value)
                setattr(self, name, value)
        return wire.PolicyReply(msg.query_id, self.dispatch_policy, self.pairing_policy, self.request_selection,
                                self.scaling_policy, self.migrating)
