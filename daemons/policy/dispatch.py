"""Dispatch: which instance a new request goes to."""

from __future__ import annotations

from dataclasses import replace
from itertools import chain

from daemons.policy.slo import pooled, slo_score
from daemons.policy.usage import InstanceState, blocks_for, instance_freeness, real_freeness

DISPATCH_POLICIES = ("llumnix", "llumnix-cache", "infaas++", "rr", "flood", "slo")
# The baselines dispatch without virtual usage and never migrate to rebalance (drains still migrate).
MIGRATING_POLICIES = ("llumnix", "llumnix-cache", "slo")
# Scored by virtual usage (with llumnix-cache, a request's cached blocks may decide: ``cache_choice``).
VIRTUAL_USAGE_POLICIES = ("llumnix", "llumnix-cache")


def dispatch(policy: str, states: list[InstanceState], turn: int, headroom: float = 0.0, priority: int = 0,
             start: float | None = None, hits: dict[str, int] | None = None, cache_band: float = 0.25,
             cache_floor: float = 0.0, tpot_target_s: float = 0.0) -> str | None:
    """Pick the instance for a new request of ``priority``, or None when no instance may take one.

    ``turn`` is a counter the caller advances on every dispatch: round-robin uses it, and the freeness
    policies use it to rotate among equally free instances, so that ties do not starve anyone.

    ``start`` (a fraction in [0, 1)), for dispatchers that share the instances but not their dispatches
    (several proxies): the freeness policies then take the first tie at or after that point of the
    instances in id order, cyclically. Dispatchers given evenly spaced starts each fill their own stretch
    first, so that a burst that reaches them all at once fans out over equally free instances instead of
    every dispatcher choosing the same one.

    The high-priority headroom is there to keep *normal* requests away from instances running high-priority
    ones; a high-priority request itself is placed by virtual usage without it, so high-priority requests
    gather where normal load is light instead of each one spreading headroom over another instance.
    """
    eligible = sorted((s for s in states if s.dispatchable), key=lambda s: s.instance_id)
    if policy == "slo":  # each instance's model completed by the cluster's (slo.pooled)
        eligible = pooled(eligible)
    score = scorer(policy, headroom, priority, tpot_target_s)
    ids, scores = [s.instance_id for s in eligible], [score(s) for s in eligible] if score else []
    if policy == "slo" and hits:
        j = slo_cache_choice({iid: j for j, iid in enumerate(ids)}, ids, {s.instance_id: s for s in eligible},
                             scores, hits)
        if j is not None:
            return ids[j]
    if policy == "llumnix-cache" and hits:
        j = cache_choice({iid: j for j, iid in enumerate(ids)}, scores, hits, cache_band, cache_floor)
        if j is not None:
            return ids[j]
    return pick(policy, ids, scores, turn, start)


def cache_choice(at: dict[str, int], scores: list[float], hits: dict[str, int], band: float,
                 floor: float) -> int | None:
    """llumnix-cache: where the request's cache decides, or None where load does. The instances free enough
    for the cache to decide are those within ``band`` of the freest: at least ``band`` times as free when
    the freest has room (``best`` >= 0), at most ``1 - band`` of its deficit further behind when even the
    freest is overloaded (``best`` < 0: then ``band * best`` would exclude everybody). While the freest is
    at least ``floor`` free, an instance must be too. Among them the one holding most of the request's
    leading blocks (``hits``) wins, the freer on a tie. So affinity holds while there is room, and balance
    takes over when one instance is much busier than the rest: an instance that a hot prefix makes busier
    falls out of the band, the next request of that prefix goes to the freest instance, which then caches
    it too. When the whole cluster is overloaded alike, the cache still decides within the band: a hit
    saves prefill work that every queued request waits for. ``at``: each instance's place in ``scores``
    (freeness by virtual usage). Work: the instances that hold some of the request, not all of them."""
    if not hits or not scores:
        return None
    best = max(scores)
    limit = best - (1.0 - band) * abs(best)
    if best >= floor:
        limit = max(limit, floor)
    chosen, key = None, None
    for iid, h in hits.items():
        j = at.get(iid)
        if j is None or h <= 0 or scores[j] < limit:
            continue
        if key is None or (h, scores[j]) > key:
            chosen, key = j, (h, scores[j])
    return chosen


def scorer(policy: str, headroom: float = 0.0, priority: int = 0, tpot_target_s: float = 0.0):
    """What ``dispatch`` ranks instances by for a request of ``priority``: a function of an InstanceState
    (higher is freer), or None for the policies that do not look at load. A dispatcher that keeps scores
    between dispatches (a proxy's view of hundreds of instances) recomputes only the instances that changed.
    slo: minus the predicted TTFT of the queue (the request's own prompt adds the same on every instance but
    for what each caches: ``slo_cache_bonus``), behind every instance that keeps ``tpot_target_s``."""
    if policy not in DISPATCH_POLICIES:
        raise ValueError(f"unknown dispatch policy {policy!r} (known: {', '.join(DISPATCH_POLICIES)})")
    if policy in ("rr", "flood"):
        return None
    if policy == "slo":
        return lambda s: slo_score(s, 0, priority > 0, tpot_target_s)
    if policy == "infaas++":
        return real_freeness
    h = 0.0 if priority > 0 else headroom  # llumnix and llumnix-cache (where ``cache_choice`` may decide)
    return lambda s: instance_freeness(s, h)


def slo_cache_choice(at: dict[str, int], ids: list[str], states: dict[str, InstanceState], scores: list[float],
                     hits: dict[str, int]) -> int | None:
    """slo with a prefix index: the instances' scores less the prefill each saves with the request's cached
    leading blocks (``hits``), so the predicted TTFT counts only the uncached part of the prompt. None: no
    instance caches any of it (the plain scores decide)."""
    if not hits or not scores:
        return None
    best_j, best = None, max(scores)
    for iid, h in hits.items():
        j = at.get(iid)
        s = states.get(iid)
        if j is None or h <= 0 or s is None or s.latency is None:
            continue
        score = scores[j] + h * s.block_size * s.latency.prefill_ms_per_token / 1000.0
        if score > best:
            best_j, best = j, score
    return best_j


def pick(policy: str, ids: list[str], scores: list[float], turn: int, start: float | None = None) -> str | None:
    """``dispatch``'s choice among the eligible instances ``ids`` (in id order) with their ``scores`` (by
    ``scorer``; ignored by rr and flood)."""
    if not ids:
        return None
    if policy == "rr":
        return ids[turn % len(ids)]
    if policy == "flood":
        return ids[0]
    best = max(scores)
    tol = 1e-9 * max(1.0, abs(best))
    floor = best - tol
    if start is not None:
        n = len(ids)
        first = int(start % 1.0 * n + 1e-9) % n  # (a start of k/n is k, not k - 1)
        for j in chain(range(first, n), range(first)):
            if scores[j] >= floor:
                return ids[j]
    ties = [iid for iid, f in zip(ids, scores) if f >= floor]
    return ties[turn % len(ties)]


def dispatch_batch(policy: str, states: list[InstanceState], requests: list[tuple[int, int]], turn: int,
                   headroom: float = 0.0, tpot_targets: dict[int, float] | None = None) -> list[str | None]:
    """Dispatch requests that arrived together, given as (priority, prompt tokens): higher
    scheduling priority first, each to the freest instance once the ones before it are counted there.
    Returns the chosen instance per request, in the order given.

    The same choices as calling ``dispatch`` once per request with the earlier ones counted, but each
    instance is scored once per batch and again only when a request lands on it (a manager of hundreds
    of instances answers batches of dispatches without re-scoring them all for each)."""
    if policy not in DISPATCH_POLICIES:
        raise ValueError(f"unknown dispatch policy {policy!r} (known: {', '.join(DISPATCH_POLICIES)})")
    order = sorted(range(len(requests)), key=lambda i: -requests[i][0])  # stable: arrival order within a priority
    chosen: list[str | None] = [None] * len(requests)
    eligible = sorted((s for s in states if s.dispatchable), key=lambda s: s.instance_id)
    if not eligible:
        return chosen
    if policy in ("rr", "flood"):
        for k, i in enumerate(order):
            chosen[i] = eligible[(turn + k) % len(eligible) if policy == "rr" else 0].instance_id
        return chosen
    if policy == "slo":  # each instance's model completed by the cluster's (slo.pooled)
        eligible = pooled(eligible)
    ids = [s.instance_id for s in eligible]

    def score_fn(h: float):
        if policy == "slo":  # (keyed by the priority class instead of the headroom)
            return scorer("slo", priority=int(h), tpot_target_s=(tpot_targets or {}).get(int(h), 0.0))
        return (lambda s: instance_freeness(s, h)) if policy in VIRTUAL_USAGE_POLICIES else real_freeness

    scores: dict[float, list[float]] = {}  # by the headroom used: normal requests' and high ones' (0)

    def scored(h: float) -> list[float]:
        if h not in scores:
            fn = score_fn(h)
            scores[h] = [fn(s) for s in eligible]
        return scores[h]

    for k, i in enumerate(order):
        prio, tokens = requests[i]
        h = (1 if prio > 0 else 0) if policy == "slo" else 0.0 if prio > 0 else headroom
        xs = scored(h)
        best = max(xs)
        tol = 1e-9 * max(1.0, abs(best))
        ties = [j for j, f in enumerate(xs) if best - f <= tol]
        j = ties[(turn + k) % len(ties)]
        chosen[i] = ids[j]
        s = eligible[j]
        s = eligible[j] = replace(s, pending_blocks=s.pending_blocks + blocks_for(tokens, s.block_size),
                                  pending_requests=s.pending_requests + 1)
        for hh, ys in scores.items():
            ys[j] = score_fn(hh)(s)
    return chosen
