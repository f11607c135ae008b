"""Scheduling policy: pure functions over load snapshots. No sockets, clocks or engines in here.

One sign convention everywhere: *freeness*, higher is freer.

- usage.py: virtual usage, freeness, the imbalance potential
- dispatch.py: where a new request goes (llumnix, llumnix-cache, infaas++, rr, flood, slo)
- migration.py: which instances pair up, which requests a source sends
- scaling.py: when to add or remove an instance
- disagg.py: prefill/decode roles: where a request prefills, where it is handed over
- slo.py: predicted TTFT and TPOT, the SLO's admission rule and its share of virtual usage
"""

from daemons.policy import disagg
from daemons.policy.dispatch import (DISPATCH_POLICIES, MIGRATING_POLICIES, cache_choice, dispatch, dispatch_batch,
                                     pick, scorer, slo_cache_choice)
from daemons.policy.migration import (PAIRING_POLICIES, SELECTION_POLICIES, Choice, CrossNode, Pair, cross_node_budget_blocks,
                                      cross_node_saving_ms, crosses_hosts, pair, select_migrants, transfer_ms)
from daemons.policy.scaling import SCALING_POLICIES, Scaler, average_freeness, scale_in_victim
from daemons.policy.usage import (INF, InstanceState, blocks_for, fading_credit, freeness, instance_freeness,
                                  move_lowers_potential, potential, real_freeness, real_usage, request_usage,
                                  scaling_freeness, state_of, virtual_usage)

__all__ = [
    "disagg",
    "DISPATCH_POLICIES", "MIGRATING_POLICIES", "PAIRING_POLICIES", "SELECTION_POLICIES", "SCALING_POLICIES",
    "INF", "InstanceState", "Pair", "Choice", "CrossNode", "Scaler",
    "dispatch", "dispatch_batch", "pick", "scorer", "cache_choice", "slo_cache_choice", "pair", "select_migrants", "average_freeness", "scale_in_victim",
    "crosses_hosts", "cross_node_budget_blocks", "cross_node_saving_ms", "transfer_ms",
    "blocks_for", "fading_credit", "freeness", "instance_freeness", "move_lowers_potential", "potential",
    "real_freeness", "real_usage", "request_usage", "scaling_freeness", "state_of", "virtual_usage",
]
