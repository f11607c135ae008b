"""Dispatch: which instance a new request goes to, composed once for every dispatcher (the manager, the proxies'
own views, the simulator): the pool first (``pool_for``: with prefill/decode roles, where the request prefills,
daemons/policy/disagg.py; for a LoRA request, the instances that hold its adapter or may load it,
daemons/policy/residency.py), then the instance within it by the dispatch policy in force (``dispatch``: the
policy object of daemons/policy/registry.py, over the pool completed by the cluster's fits where the policy
predicts by them, slo.pooled). ``place`` is the two, with a session's turn placed where its KV is (within the
load bound) and a prefix pull chosen where it pays (daemons/policy/sessions.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from daemons.policy import disagg, residency, sessions
from daemons.policy.registry import DISPATCH, DispatchPolicy, cache_choice, slo_cache_choice
from daemons.policy.slo import NO_SLO, RequestSlo, class_of, pooled
from daemons.policy.usage import InstanceState, blocks_for

__all__ = ["Ask", "Placement", "Rules", "cache_choice", "dispatch",
           "dispatch_batch", "pick", "place", "pool_for", "rules_of", "scorer", "slo_cache_choice"]


def policy_of(policy: str | DispatchPolicy) -> DispatchPolicy:
    return policy if isinstance(policy, DispatchPolicy) else DISPATCH.get(policy)


@dataclass(frozen=True)
class Rules:
    """What dispatch reads of the settings, once per process: the high-priority headroom, llumnix-cache's band
    and floor ([scheduling]) and the disaggregation decision's thresholds ([disagg]; the TTFT target is the
    request's class's)."""

    headroom: float = 0.0
    cache_band: float = 0.25
    cache_floor: float = 0.0
    disagg: disagg.Rules = field(default_factory=disagg.Rules)
    max_replicas: int = 0  # lora.max_replicas: dispatch loads an adapter on no more instances (0: no bound)
    residency: bool = True  # lora.residency: LoRA requests among their adapter's holders (False: by load alone)
    sessions: sessions.Pricing = field(default_factory=sessions.Pricing)  # [sessions], kv_tier.pull


def rules_of(cfg) -> Rules:
    """Rules from the settings (daemons/config.py Config)."""
    sc = cfg.scheduling
    return Rules(sc.high_priority_headroom, sc.cache_band, sc.cache_min_freeness, disagg.rules_of(cfg.disagg),
                 cfg.lora.max_replicas, cfg.lora.residency, sessions.pricing_of(cfg))


@dataclass(frozen=True)
class Ask:
    """A new request as dispatch sees it: its prompt's tokens, its scheduling priority, its SLO class and targets
    (computed once where the request entered the process: slo.Classes.of) and its cached leading blocks per
    instance (the prefix index's hits, in any tier; None: unknown or none)."""

    prompt_tokens: int
    priority: int = 0
    slo: RequestSlo = NO_SLO
    hits: dict[str, int] | None = None
    adapter: str = ""  # its LoRA adapter ("": the base model)
    # Its cached leading blocks per instance by tier: (in the engine, in the engine or the host tier), from
    # prefix.match_tiers (None: not looked up; ``hits`` is then what there is).
    tiers: sessions.Tiers | None = None
    session: str = ""  # the session it names ("": none)
    home: str = ""  # the instance the session's last turn went to (a tie between holders goes there)


@dataclass(frozen=True)
class Placement:
    """Where a request goes (None: no instance may take it), the disaggregation decision ("": no roles), a prefix
    pull before it queues (``pull_blocks`` leading blocks from ``pull_from``; none: "") and, for a session's turn,
    how it was placed (sessions.HOW; "": no session)."""

    instance_id: str | None
    decision: str = ""
    pull_from: str = ""
    pull_blocks: int = 0
    how: str = ""


def pool_for(states: list[InstanceState], ask: Ask, rules: Rules) -> disagg.Decision | None:
    """The pool a request is dispatched among while some instance has a role (``disagg.decide``: prefill remotely,
    or where it will decode); None: no roles, every instance."""
    if not disagg.active(states):
        return None
    return disagg.decide(states, ask.prompt_tokens, ask.hits, replace(rules.disagg, ttft_target_s=ask.slo.targets.ttft_s),
                         ask.priority)


def place(policy: str | DispatchPolicy, states: list[InstanceState], ask: Ask, turn: int, rules: Rules,
          start: float | None = None) -> Placement:
    """Where a new request goes: the pool (``pool_for``; for a LoRA request, narrowed by residency), then the
    instance within it: a session's turn where its KV is while that instance is within the load bound and its
    target (sessions.follow, for the policies that follow sessions), else by ``policy``; then a pull of its
    prefix from the instance holding most of it, where that is predicted shorter than its prefill."""
    decision = pool_for(states, ask, rules)
    pool = states if decision is None else decision.pool
    if rules.residency:
        pool = residency.adapter_pool(pool, ask.adapter, rules.max_replicas)
    elif ask.adapter:  # the baseline: any instance that serves adapters
        pool = [s for s in pool if residency.serves_adapters(s)]
    p, pricing = policy_of(policy), rules.sessions
    went = sessions.Follow("", "new")
    if ask.session and pricing.affinity and p.follows_sessions:
        went = sessions.follow(pooled(pool), ask.prompt_tokens, ask.tiers, ask.home, pricing, ask.slo.targets.ttft_s,
                               ask.slo.high)
    chosen = went.instance_id or None
    if chosen is None:
        others = [s for s in pool if s.instance_id != went.avoid] if went.avoid else pool
        chosen = _by_policy(p, others, ask, turn, rules, start)
        if chosen is None and went.avoid:  # only its holder takes requests
            chosen = _by_policy(p, pool, ask, turn, rules, start)
    pull_from, pulled = _pull(states, chosen, ask, pricing)
    how = ("pull" if pulled else went.how) if ask.session else ""
    return Placement(chosen, "" if decision is None else decision.decision, pull_from, pulled, how)


def _by_policy(p: DispatchPolicy, pool: list[InstanceState], ask: Ask, turn: int, rules: Rules,
               start: float | None) -> str | None:
    return dispatch(p, pool, turn, rules.headroom, ask.priority, start, ask.hits, rules.cache_band, rules.cache_floor,
                    ask.slo.targets.tpot_s, ask.tiers, rules.sessions)


def _pull(states: list[InstanceState], chosen: str | None, ask: Ask, pricing: sessions.Pricing) -> tuple[str, int]:
    """sessions.pull_for to ``chosen`` from the live instances (none chosen: none)."""
    if chosen is None or not ask.tiers or not pricing.pull:
        return "", 0
    dst = next((s for s in pooled(states) if s.instance_id == chosen), None)
    if dst is None:
        return "", 0
    return sessions.pull_for(dst, [s.instance_id for s in states if s.alive], ask.tiers, ask.prompt_tokens, pricing)


def dispatch(policy: str | DispatchPolicy, states: list[InstanceState], turn: int, headroom: float = 0.0,
             priority: int = 0, start: float | None = None, hits: dict[str, int] | None = None,
             cache_band: float = 0.25, cache_floor: float = 0.0, tpot_target_s: float = 0.0,
             tiers: sessions.Tiers | None = None, pricing: sessions.Pricing | None = None) -> str | None:
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
    p = policy_of(policy)
    eligible = sorted((s for s in states if s.dispatchable), key=lambda s: s.instance_id)
    if p.predicts:  # each instance's model completed by the cluster's (slo.pooled)
        eligible = pooled(eligible)
    score = p.scorer(headroom, class_of(priority) > 0, tpot_target_s)
    ids, scores = [s.instance_id for s in eligible], [score(s) for s in eligible] if score else []
    if hits and p.prefix_aware:
        j = p.cache_pick({iid: j for j, iid in enumerate(ids)}, {s.instance_id: s for s in eligible}, scores, hits,
                         cache_band, cache_floor, tiers, pricing)
        if j is not None:
            return ids[j]
    return p.pick(ids, scores, turn, start)


def scorer(policy: str | DispatchPolicy, headroom: float = 0.0, priority: int = 0, tpot_target_s: float = 0.0):
    """What ``dispatch`` ranks instances by for a request of ``priority``: a function of an InstanceState
    (higher is freer), or None for the policies that do not look at load (the policy's own, registry.py)."""
    return policy_of(policy).scorer(headroom, class_of(priority) > 0, tpot_target_s)


def pick(policy: str | DispatchPolicy, ids: list[str], scores: list[float], turn: int,
         start: float | None = None) -> str | None:
    """``dispatch``'s choice among the eligible instances ``ids`` (in id order) with their ``scores`` (by
    ``scorer``; ignored by rr and flood)."""
    return policy_of(policy).pick(ids, scores, turn, start)


def dispatch_batch(policy: str | DispatchPolicy, states: list[InstanceState], requests: list[tuple[int, int]],
                   turn: int, headroom: float = 0.0, tpot_targets: dict[int, float] | None = None) -> list[str | None]:
    """Dispatch requests that arrived together, given as (priority, prompt tokens): higher
    scheduling priority first, each to the freest instance once the ones before it are counted there.
    Returns the chosen instance per request, in the order given. ``tpot_targets``: by SLO class.

    The same choices as calling ``dispatch`` once per request with the earlier ones counted, but each
    instance is scored once per batch and again only when a request lands on it (a manager of hundreds
    of instances answers batches of dispatches without re-scoring them all for each)."""
    p = policy_of(policy)
    order = sorted(range(len(requests)), key=lambda i: -requests[i][0])  # stable: arrival order within a priority
    chosen: list[str | None] = [None] * len(requests)
    eligible = sorted((s for s in states if s.dispatchable), key=lambda s: s.instance_id)
    if not eligible:
        return chosen
    if p.predicts:  # each instance's model completed by the cluster's (slo.pooled)
        eligible = pooled(eligible)
    ids = [s.instance_id for s in eligible]
    fns = {cls: p.scorer(headroom, cls > 0, (tpot_targets or {}).get(cls, 0.0)) for cls in (0, 1)}
    scores: dict[int, list[float]] = {}  # by SLO class: normal requests' and high ones'

    def scored(cls: int) -> list[float]:
        if cls not in scores:
            scores[cls] = [fns[cls](s) for s in eligible] if fns[cls] else []
        return scores[cls]

    for k, i in enumerate(order):
        prio, tokens = requests[i]
        xs = scored(class_of(prio))
        chosen[i] = iid = p.pick(ids, xs, turn + k)
        j = ids.index(iid) if xs else None
        if j is None:
            continue
        s = eligible[j] = replace(eligible[j], pending_blocks=eligible[j].pending_blocks + blocks_for(tokens, eligible[j].block_size),
                                  pending_requests=eligible[j].pending_requests + 1)
        for cls, ys in scores.items():
            ys[j] = fns[cls](s)
    return chosen
