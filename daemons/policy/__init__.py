"""Scheduling policy: pure functions over load snapshots. No sockets, clocks or engines in here.

One sign convention everywhere: *freeness*, higher is freer.

- usage.py: virtual usage, freeness, the imbalance potential
- registry.py: every policy as an object (name, help, the settings it reads, its behaviour), one registry per
  choice: DISPATCH, PAIRING, SELECTION, SCALING
- plugins/: policies in modules of their own, each registered as the registry imports it (a new policy is one
  file there and its test: least_requests.py is the example)
- dispatch.py: where a new request goes, composed once: the pool (disagg.py), then the instance by the policy (llumnix, llumnix-cache,
  infaas++, rr, flood, slo, and the plugins')
- migration.py: which instances pair up, which requests a source sends
- scaling.py: when to add or remove an instance
- disagg.py: prefill/decode roles: where a request prefills, where it is handed over
- slo.py: predicted TTFT and TPOT, and the SLO's share of virtual usage
- admit.py: the SLO's admission rule over those predictions (admitted, or refused with a reason and a retry time)
- sessions.py: a request's cached blocks priced by tier (engine, host, a pull, prefill) and a session's turn placed
  where its KV is, with bounded load
- residency.py: LoRA requests among the instances that hold their adapter, or may load it
"""

from daemons.policy import disagg, residency, sessions
from daemons.policy.dispatch import (Ask, Placement, Rules, cache_choice,
                                     dispatch, dispatch_batch, pick, place, pool_for, rules_of, scorer,
                                     slo_cache_choice)
from daemons.policy.registry import DISPATCH, PAIRING, SCALING, SELECTION, DispatchPolicy
from daemons.policy.migration import (Choice, CrossNode, Pair, cross_node_budget_blocks,
                                      cross_node_saving_ms, crosses_hosts, pair, select_migrants, transfer_ms)
from daemons.policy.scaling import Scaler, average_freeness, scale_in_victim
from daemons.policy.usage import (INF, InstanceState, blocks_for, fading_credit, freeness, instance_freeness,
                                  move_lowers_potential, potential, real_freeness, real_usage, request_usage,
                                  scaling_freeness, state_of, virtual_usage)

__all__ = [
    "disagg", "residency", "sessions", "DISPATCH", "PAIRING", "SELECTION", "SCALING", "DispatchPolicy", "Ask", "Placement", "Rules",
    "place", "pool_for", "rules_of",
    "INF", "InstanceState", "Pair", "Choice", "CrossNode", "Scaler",
    "dispatch", "dispatch_batch", "pick", "scorer", "cache_choice", "slo_cache_choice", "pair", "select_migrants", "average_freeness", "scale_in_victim",
    "crosses_hosts", "cross_node_budget_blocks", "cross_node_saving_ms", "transfer_ms",
    "blocks_for", "fading_credit", "freeness", "instance_freeness", "move_lowers_potential", "potential",
    "real_freeness", "real_usage", "request_usage", "scaling_freeness", "state_of", "virtual_usage",
]
