"""Every policy, declared once, as an object: its name (the string config files and ``llumnixctl policy`` use),
what it does (its help: the settings' help, the daemons' ``--help`` and the man pages are made from it), the
settings it reads, and its behaviour. Nothing outside this module compares a policy's name: code asks the policy
object (``DISPATCH.get(name).migrates``), so that a new policy is one entry here, or one module of its own in
daemons/policy/plugins/ that registers it (``DISPATCH.register(...)``; each module there is imported once this
module is, see daemons/policy/plugins/least_requests.py). tests/unit/test_structure.py checks that no other
module compares a policy name as a string.

Four registries, one per choice: ``DISPATCH`` (manager.dispatch_policy), ``PAIRING`` (scheduling.pairing_policy),
``SELECTION`` (scheduling.request_selection) and ``SCALING`` (scaling.policy). The first policy registered is a
registry's default; the plugins' come after this module's, by module name.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from itertools import chain
from typing import Callable, Generic, Iterator, TypeVar

from daemons.policy import sessions
from daemons.policy.slo import slo_score
from daemons.policy.usage import InstanceState, instance_freeness, real_freeness


@dataclass(frozen=True)
class Policy:
    """A policy's name, its one-line help, and the settings it reads besides the one that selects it."""

    name: str
    help: str
    reads: tuple[str, ...] = ()


P = TypeVar("P", bound=Policy)


class Registry(Generic[P]):
    """The policies of one choice (``setting``), by name, in the order they are listed."""

    def __init__(self, kind: str, setting: str, *policies: P):
        self.kind, self.setting = kind, setting
        self._by_name: dict[str, P] = {}
        self.names: tuple[str, ...] = ()
        for p in policies:
            self.register(p)

    def register(self, policy: P) -> P:
        """Add ``policy``, listed last (a module of daemons/policy/plugins/ registers its own); returns it."""
        if policy.name in self._by_name:
            raise ValueError(f"{self.kind} {policy.name!r} is registered twice")
        self._by_name[policy.name] = policy
        self.names = tuple(self._by_name)
        return policy

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[P]:
        return iter(self._by_name.values())

    @property
    def default(self) -> P:
        return next(iter(self._by_name.values()))

    def get(self, name: str) -> P:
        """The policy named ``name``; ValueError naming the known ones."""
        try:
            return self._by_name[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r} (known: {', '.join(self.names)})") from None

    def listing(self) -> str:
        """The names, as a sentence lists them: "a, b or c"."""
        return _sentence(list(self.names))

    def described(self, intro: str) -> str:
        """``intro``, then each name with its help: the setting's help (daemons/config.py)."""
        return f"{intro}: " + _sentence([f"{p.name} ({p.help})" for p in self])


def _sentence(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


# ------------------------------------------------------------------ dispatch


Scorer = Callable[[InstanceState], float]


@dataclass(frozen=True)
class DispatchPolicy(Policy):
    """Where a new request goes (daemons/policy/dispatch.py composes it with the prefill/decode decision).

    ``migrates``: balancing migrations run under it (the baselines never rebalance; drains always run).
    ``scores_as``: the policy whose scores it ranks by (a dispatcher that keeps scores shares them).
    ``prefix_aware``: a request's cached leading blocks (the prefix index's hits) may change its choice.
    ``cache_affinity``: the cache decides within a band of the freest (dispatchers without a prefix index ask
    one that has it). ``predicts``: it ranks by the SLO's predictions: each instance's step-time model is
    completed by the cluster's (slo.pooled), and virtual usage counts the TPOT target. ``follows_sessions``: a
    request naming a session goes where its KV is, within the load bound (daemons/policy/sessions.py; the
    baselines place it as any other)."""

    migrates: bool = True
    scores_as: str = ""
    prefix_aware: bool = False
    cache_affinity: bool = False
    predicts: bool = False
    follows_sessions: bool = False

    @property
    def score_key(self) -> str:
        return self.scores_as or self.name

    def scorer(self, headroom: float = 0.0, high: bool = False, tpot_target_s: float = 0.0) -> Scorer | None:
        """What the policy ranks instances by for a request (``high``: of the high class), higher is better; None
        for a policy that does not look at load."""
        h = 0.0 if high else headroom  # headroom keeps normal requests away from high ones, not high ones
        return lambda s: instance_freeness(s, h)

    def pick(self, ids: list[str], scores: list[float], turn: int, start: float | None = None) -> str | None:
        """The choice among the eligible instances ``ids`` (in id order) with their ``scores``: the best, ties
        rotated by ``turn``, or (``start``: a dispatcher's own point of the instances, several proxies) the first
        tie at or after ``start`` of the instances, cyclically."""
        if not ids:
            return None
        best = max(scores)
        floor = best - 1e-9 * max(1.0, abs(best))
        if start is not None:
            n = len(ids)
            first = int(start % 1.0 * n + 1e-9) % n  # (a start of k/n is k, not k - 1)
            for j in chain(range(first, n), range(first)):
                if scores[j] >= floor:
                    return ids[j]
        ties = [iid for iid, f in zip(ids, scores) if f >= floor]
        return ties[turn % len(ties)]

    def cache_pick(self, at: dict[str, int], states: dict[str, InstanceState], scores: list[float],
                   hits: dict[str, int] | None, band: float, floor: float, tiers: sessions.Tiers | None = None,
                   pricing: sessions.Pricing | None = None) -> int | None:
        """Where the request's cached blocks (``hits``: leading blocks in some tier; ``tiers``: per instance, those
        in its engine and in engine or host tier, when known) decide: an index into ``scores`` (``at``: each
        instance's), or None where the plain scores do. ``states``: the instances, as scored; ``pricing``: what a
        host block's restore costs."""
        return None


@dataclass(frozen=True)
class RealFreeness(DispatchPolicy):
    def scorer(self, headroom=0.0, high=False, tpot_target_s=0.0):
        return real_freeness


@dataclass(frozen=True)
class RoundRobin(DispatchPolicy):
    def scorer(self, headroom=0.0, high=False, tpot_target_s=0.0):
        return None

    def pick(self, ids, scores, turn, start=None):
        return ids[turn % len(ids)] if ids else None


@dataclass(frozen=True)
class Flood(DispatchPolicy):
    def scorer(self, headroom=0.0, high=False, tpot_target_s=0.0):
        return None

    def pick(self, ids, scores, turn, start=None):
        return ids[0] if ids else None


@dataclass(frozen=True)
class CacheAffinity(DispatchPolicy):
    def cache_pick(self, at, states, scores, hits, band, floor, tiers=None, pricing=None):
        return cache_choice(at, scores, hits or {}, band, floor, tiers)


@dataclass(frozen=True)
class BySlo(DispatchPolicy):
    def scorer(self, headroom=0.0, high=False, tpot_target_s=0.0):
        return lambda s: slo_score(s, 0, high, tpot_target_s)

    def cache_pick(self, at, states, scores, hits, band, floor, tiers=None, pricing=None):
        return slo_cache_choice(at, states, scores, hits or {}, tiers, pricing)


def cache_choice(at: dict[str, int], scores: list[float], hits: dict[str, int], band: float,
                 floor: float, tiers: sessions.Tiers | None = None) -> int | None:
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
    (freeness by virtual usage). ``tiers``: with host tiers, of equal hits the one holding more in its engine
    (no restore) wins. Work: the instances that hold some of the request, not all of them."""
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
        k = (h, (tiers or {}).get(iid, (h, h))[0], scores[j])
        if key is None or k > key:
            chosen, key = j, k
    return chosen


def slo_cache_choice(at: dict[str, int], states: dict[str, InstanceState], scores: list[float],
                     hits: dict[str, int], tiers: sessions.Tiers | None = None,
                     pricing: sessions.Pricing | None = None) -> int | None:
    """slo with a prefix index: the instances' scores less the prefill each saves with the request's cached
    leading blocks (``hits``), so the predicted TTFT counts only the uncached part of the prompt; with ``tiers``,
    a block in a host tier saves its prefill less its restore (sessions.saved_s). None: no instance caches any
    of it (the plain scores decide)."""
    if not hits or not scores:
        return None
    best_j, best = None, max(scores)
    for iid, h in hits.items():
        j = at.get(iid)
        s = states.get(iid)
        if j is None or h <= 0 or s is None or s.latency is None:
            continue
        if tiers is not None and iid in tiers:
            score = scores[j] + sessions.saved_s(s, tiers, pricing or sessions.Pricing())
        else:
            score = scores[j] + h * s.block_size * s.latency.prefill_ms_per_token / 1000.0
        if score > best:
            best_j, best = j, score
    return best_j


DISPATCH: Registry[DispatchPolicy] = Registry(
    "dispatch policy", "manager.dispatch_policy",
    DispatchPolicy("llumnix", "freest by virtual usage; migrates", ("scheduling.high_priority_headroom",),
                   follows_sessions=True),
    CacheAffinity("llumnix-cache", "as llumnix, but among instances free enough (scheduling.cache_band, "
                  "scheduling.cache_min_freeness) the one that caches most of the request's prompt, by the cluster "
                  "prefix index of the proxy or, for dispatches it is asked for, the manager",
                  ("scheduling.high_priority_headroom", "scheduling.cache_band", "scheduling.cache_min_freeness"),
                  scores_as="llumnix", prefix_aware=True, cache_affinity=True, follows_sessions=True),
    RealFreeness("infaas++", "freest by real usage, no migration", migrates=False),
    RoundRobin("rr", "round-robin, no migration", migrates=False),
    Flood("flood", "all to one, no migration; tests", migrates=False),
    BySlo("slo", "the best predicted time to first token, counting only the uncached part of the prompt, among the "
          "instances whose predicted time per output token stays under [slo]'s target; virtual usage counts the "
          "TPOT target; migrates", ("slo.tpot_ms", "slo.high_tpot_ms", "slo.tpot_full"),
          prefix_aware=True, predicts=True, follows_sessions=True),
)


# ------------------------------------------------------------------ migration and scaling


@dataclass(frozen=True)
class PairingPolicy(Policy):
    """Which instances pair up for balancing migrations (daemons/policy/migration.py ``pair``). ``balances``:
    overloaded instances are sources (else only draining ones are)."""

    balances: bool = True


PAIRING: Registry[PairingPolicy] = Registry(
    "pairing policy", "scheduling.pairing_policy",
    PairingPolicy("llumnix", "instances below migrate_out_threshold to those above migrate_in_threshold, least free "
                  "with freest", ("scheduling.migrate_out_threshold", "scheduling.migrate_in_threshold")),
    PairingPolicy("off", "only drains migrate", balances=False),
)


@dataclass(frozen=True)
class SelectionPolicy(Policy):
    """Which requests a migration source sheds first (daemons/policy/migration.py ``select_migrants``).
    ``queued_first``: queued requests are re-dispatched first (a drain re-dispatches them whatever the policy)."""

    queued_first: bool = False

    def order(self, running: list, cached: dict[str, int]) -> list:
        """The running requests (wire.RequestLoad, in admission order) in the order they go: lower priority,
        then fewer blocks to move (``cached``: by request, the blocks the destination holds already)."""
        return sorted(running, key=lambda r: (r.priority, r.blocks - min(cached.get(r.request_id, 0), r.blocks)))


@dataclass(frozen=True)
class LastRunning(SelectionPolicy):
    def order(self, running, cached):
        return running[::-1]


@dataclass(frozen=True)
class Longest(SelectionPolicy):
    def order(self, running, cached):
        return sorted(running, key=lambda r: -r.blocks)


SELECTION: Registry[SelectionPolicy] = Registry(
    "request selection policy", "scheduling.request_selection",
    SelectionPolicy("llumnix", "lower priority, then fewer blocks"),
    LastRunning("last-running", "most recently admitted"),
    Longest("longest", "most blocks"),
    SelectionPolicy("first-waiting", "queued requests re-dispatched first, then as llumnix", queued_first=True),
)


@dataclass(frozen=True)
class ScalingPolicy(Policy):
    """When the cluster adds or removes instances (daemons/policy/scaling.py ``Scaler``). ``scales``: it does."""

    scales: bool = True


SCALING: Registry[ScalingPolicy] = Registry(
    "scaling policy", "scaling.policy",
    ScalingPolicy("off", "no auto-scaling", scales=False),
    ScalingPolicy("llumnix", "keep the average freeness between scale_up_threshold and scale_down_threshold",
                  ("scaling.scale_up_threshold", "scaling.scale_down_threshold", "scaling.sustain_s",
                   "scaling.cooldown_s", "scaling.min_instances", "scaling.max_instances", "scaling.launcher")),
)

REGISTRIES = (DISPATCH, PAIRING, SELECTION, SCALING)


def _load_plugins() -> None:
    """Import each module of daemons/policy/plugins/ (by name): each registers its policies as it loads."""
    from daemons.policy import plugins

    for m in pkgutil.iter_modules(plugins.__path__):
        importlib.import_module(f"{plugins.__name__}.{m.name}")


_load_plugins()
