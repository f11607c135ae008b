"""Prefill/decode disaggregation: which pool a new request prefills in, where a prefilled request is handed over,
and which requests a prefill instance still holds that belong elsewhere. Pure functions over InstanceState.

Roles (``InstanceState.role``): ``mixed`` serves whole requests; ``prefill`` takes requests whose prefill pays off
remotely and hands each over, by live migration, at its first token; ``decode`` takes handovers and the requests
that prefill where they decode. A cluster with no prefill instance dispatches as if there were no roles; one with
no decode (or mixed) instance lets its prefill instances serve whole requests: never a hang.

The decision per request (``decide``): prefill remotely only when it pays: the prompt's part that the best decode
candidate does not cache is long enough (``Rules.min_uncached_tokens``) and a large enough part of the prompt
(``min_uncached_fraction``: a cache-hot prompt stays local), and the prefill pool is not the bottleneck (its
least loaded instance has at most ``prefill_busy_tokens`` queued; with a TTFT target, it is not predicted to miss
the target where a decode instance would meet it). Otherwise the request prefills where it will decode.
"""

from __future__ import annotations

from dataclasses import dataclass

from daemons.policy.slo import HIGH, class_of, fitted, predict_tpot, predict_ttft, pooled
from daemons.policy.usage import InstanceState, blocks_for, instance_freeness

ROLES = ("mixed", "prefill", "decode")
DECISIONS = ("remote", "local_short", "local_cached", "local_prefill_busy", "no_prefill_pool", "no_decode_pool")


@dataclass(frozen=True)
class Rules:
    """The decision's thresholds ([disagg] settings) and the TTFT target of the request's class (0: none)."""

    min_uncached_tokens: int = 256
    min_uncached_fraction: float = 0.5
    prefill_busy_tokens: int = 16384
    ttft_target_s: float = 0.0


def rules_of(disagg, ttft_target_s: float = 0.0) -> Rules:
    """Rules from the [disagg] settings (daemons/config.py DisaggConfig)."""
    return Rules(disagg.min_uncached_tokens, disagg.min_uncached_fraction, disagg.prefill_busy_tokens, ttft_target_s)


@dataclass(frozen=True)
class Decision:
    """Where a request prefills: ``decision`` (one of DECISIONS, counted) and the pool to dispatch it among."""

    decision: str
    pool: list[InstanceState]

    @property
    def remote(self) -> bool:
        return self.decision == "remote"


def active(states: list[InstanceState]) -> bool:
    """Whether any instance has a role other than mixed (else dispatch ignores roles)."""
    return any(s.role != "mixed" for s in states)


def pools(states: list[InstanceState]) -> tuple[list[InstanceState], list[InstanceState]]:
    """The dispatchable instances as (prefill pool, decode pool); mixed instances decode (and prefill locally)."""
    pre = [s for s in states if s.dispatchable and s.role == "prefill"]
    dec = [s for s in states if s.dispatchable and s.role != "prefill"]
    return pre, dec


def decide(states: list[InstanceState], prompt_tokens: int, hits: dict[str, int] | None, rules: Rules,
           priority: int = 0) -> Decision:
    """Where a new request of ``prompt_tokens`` prefills. ``hits``: its cached leading blocks per instance (the
    prefix index; None: unknown). The pool returned holds only dispatchable instances (may be empty)."""
    pre, dec = pools(states)
    if not pre:
        return Decision("no_prefill_pool", dec)
    if not dec:
        return Decision("no_decode_pool", pre)
    cached = 0
    if hits:
        cached = max((hits.get(s.instance_id, 0) * s.block_size for s in dec), default=0)
    cached = min(cached, prompt_tokens)
    uncached = prompt_tokens - cached
    if uncached < rules.min_uncached_tokens:
        return Decision("local_cached" if cached else "local_short", dec)
    if uncached < rules.min_uncached_fraction * prompt_tokens:
        return Decision("local_cached", dec)
    if prefill_busy(pre, dec, uncached, rules, class_of(priority) == HIGH):
        return Decision("local_prefill_busy", dec)
    return Decision("remote", pre)


def prefill_busy(pre: list[InstanceState], dec: list[InstanceState], tokens: int, rules: Rules,
                 high: bool = False) -> bool:
    """Whether the prefill pool is the bottleneck for a prompt of ``tokens`` uncached tokens."""
    least = min(s.waiting_tokens + s.pending_blocks * s.block_size for s in pre)
    if least > rules.prefill_busy_tokens:
        return True
    if rules.ttft_target_s <= 0:
        return False
    pre_f, dec_f = pooled(pre), pooled(dec)
    if not any(fitted(s.latency) for s in pre_f) or not any(fitted(s.latency) for s in dec_f):
        return False
    best_pre = min(predict_ttft(s, tokens, high) for s in pre_f)
    best_dec = min(predict_ttft(s, tokens, high) for s in dec_f)
    return best_pre > rules.ttft_target_s >= best_dec


def handover_destination(states: list[InstanceState], src: str, prompt_tokens: int, blocks: int,
                         tpot_target_s: float = 0.0, headroom: float = 0.0, priority: int = 0) -> str | None:
    """The decode instance a prefilled request of ``prompt_tokens`` (holding ``blocks``) on ``src`` moves to,
    chosen now (at its first token): among the dispatchable decode (and mixed) instances other than ``src`` with
    room for its blocks, with a TPOT target and fitted models the best predicted TPOT with it joining (those
    predicted within the target first), else the freest by virtual usage. None: no instance can take it (it keeps
    decoding where it is)."""
    _, dec = pools(states)
    fits = [s for s in dec if s.instance_id != src
            and s.blocks_total - s.blocks_used - s.pending_blocks >= max(blocks, 1)]
    if not fits:
        return None
    fits.sort(key=lambda s: s.instance_id)
    if tpot_target_s > 0 and all(fitted(s.latency) for s in pooled(fits)):
        scored = []
        for s in pooled(fits):
            tpot = predict_tpot(s, prompt_tokens)
            scored.append((tpot > tpot_target_s, tpot, -instance_freeness(s, 0.0), s.instance_id))
        return min(scored)[3]
    h = 0.0 if class_of(priority) == HIGH else headroom
    return max(fits, key=lambda s: instance_freeness(s, h)).instance_id  # (the first in id order on a tie)


def misplaced(role: str, output_tokens: int) -> bool:
    """Whether a running request that has produced ``output_tokens`` belongs elsewhere on an instance of ``role``:
    a prefill instance hands over what decodes (when a decode instance exists)."""
    return role == "prefill" and output_tokens > 0


def handover_blocks(prompt_tokens: int, block_size: int) -> int:
    """Blocks a just-prefilled request holds (its prompt and first token)."""
    return blocks_for(prompt_tokens + 1, block_size)


# ------------------------------------------------------------------ adaptive roles
#
# Instances move between the prefill and decode roles by the SLO: the prefill pool is short while a new request's
# predicted TTFT on its best instance is over (1 + margin) of the TTFT target, or its steps are longer than that of
# the TPOT target (its requests' first tokens come at that pace until they are handed over), and the decode pool has
# slack (its mean predicted TPOT, with a request joining, under (1 - margin) of the TPOT target, even with one
# instance fewer); the decode pool is short in the reverse case. Only an imbalance that has held ``sustain_s`` changes a role, at most one change per
# ``interval_s``, and every change restarts both timers (what follows a change is judged on what was seen after
# it: no flip-flop on a prediction the change has not had time to move). Mixed instances are never changed; a
# draining, cordoned or dead instance is never picked; a pool never shrinks below its minimum. Without both
# targets nothing changes.

REFERENCE_PROMPT = 512  # the prompt predicted for when none is queued on the prefill pool (slo.REFERENCE_PROMPT_TOKENS)


@dataclass(frozen=True)
class AdaptRules:
    """Adaptive roles' settings ([disagg] adapt_*, min_prefill, min_decode) and the normal class's [slo]
    targets in seconds (0: none; without both, nothing changes)."""

    interval_s: float = 10.0
    sustain_s: float = 5.0
    margin: float = 0.2
    min_prefill: int = 1
    min_decode: int = 1
    ttft_target_s: float = 0.0
    tpot_target_s: float = 0.0

    @property
    def on(self) -> bool:
        return self.ttft_target_s > 0 and self.tpot_target_s > 0


def adapt_rules_of(disagg, slo_cfg) -> AdaptRules:
    """AdaptRules from the [disagg] and [slo] settings (daemons/config.py DisaggConfig, SloConfig)."""
    return AdaptRules(disagg.adapt_interval_s, disagg.adapt_sustain_s, disagg.adapt_margin, disagg.min_prefill,
                      disagg.min_decode, slo_cfg.ttft_ms / 1000.0, slo_cfg.tpot_ms / 1000.0)


@dataclass(frozen=True)
class AdaptMemory:
    """What the rule remembers between two calls: since when the prefill pool (``prefill_short_since``) and the
    decode pool (``decode_short_since``) have been short (None: not now), and the last change (when, and
    ``direction``: the role an instance was given; "" before the first)."""

    prefill_short_since: float | None = None
    decode_short_since: float | None = None
    last_change: float | None = None
    direction: str = ""


@dataclass(frozen=True)
class RoleChange:
    """Give ``instance_id`` the role ``role`` (its requests that no longer fit move by migration)."""

    instance_id: str
    role: str
    reason: str


@dataclass(frozen=True)
class Pressure:
    """Each pool's prediction against its target: ``ttft`` (a new request's TTFT on the best prefill instance /
    the TTFT target), ``pace`` (the prefill pool's mean TPOT with a request joining / the TPOT target: a request
    prefilled there makes its first tokens at that pace until its handover commits, so a prefill pool whose steps
    are long costs the TPOT target too) and ``tpot`` (the decode pool's mean TPOT with a request joining / the TPOT
    target); 0 where nothing is predicted (no fitted model, no target, an empty pool)."""

    ttft: float
    tpot: float
    pace: float = 0.0

    @property
    def prefill(self) -> float:
        """The prefill pool's pressure: by its TTFT or by its pace, whichever is further over its target."""
        return max(self.ttft, self.pace)


def representative_prompt(pre: list[InstanceState]) -> int:
    """The prompt the prefill pool is judged on: the mean prompt queued there, else REFERENCE_PROMPT."""
    waiting = sum(s.waiting for s in pre)
    return max(1, sum(s.waiting_tokens for s in pre) // waiting) if waiting else REFERENCE_PROMPT


def pressure(states: list[InstanceState], rules: AdaptRules) -> Pressure:
    """The two pools' predictions against their targets (the prefill pool: the decode pool's instances when
    there is no prefill instance, as they then prefill everything)."""
    if not rules.on:
        return Pressure(0.0, 0.0)
    pre, dec = pools(states)
    front = pre or dec
    ttft = tpot = pace = 0.0
    if any(fitted(s.latency) for s in front):
        prompt, completed = representative_prompt(front), pooled(front)
        ttft = min(predict_ttft(s, prompt) for s in completed) / rules.ttft_target_s
        if pre:  # the front is the prefill pool: its pace, on the same prompt
            pace = sum(predict_tpot(s, prompt) for s in completed) / len(completed) / rules.tpot_target_s
    if any(fitted(s.latency) for s in dec):
        prompt = representative_prompt(pre) if pre else REFERENCE_PROMPT
        per = [predict_tpot(s, prompt) for s in pooled(dec)]
        tpot = sum(per) / len(per) / rules.tpot_target_s
    return Pressure(ttft, tpot, pace)


def _least_loaded(states: list[InstanceState], role: str) -> InstanceState | None:
    """The instance of ``role`` to convert: dispatchable, fewest requests, then least KV used (then by id)."""
    pick = [s for s in states if s.role == role and s.dispatchable]
    return min(pick, key=lambda s: (s.running + s.waiting + s.pending_requests, s.blocks_used + s.pending_blocks,
                                    s.instance_id), default=None)


def _convert(states: list[InstanceState], source: str, role: str, short_s: float, spare: bool, rules: AdaptRules,
             pressure: str) -> RoleChange | None:
    """The pool of ``role`` has been short for ``short_s``: once that is sustained, and the pool of ``source``
    can spare one (``spare``), its least loaded instance takes ``role``."""
    if short_s < rules.sustain_s or not spare:
        return None
    s = _least_loaded(states, source)
    return None if s is None else RoleChange(s.instance_id, role, f"{role} short for {short_s:.1f} s: {pressure}")


def shortness(p: Pressure, n_prefill: int, n_decode: int, margin: float) -> tuple[bool, bool]:
    """(prefill pool short, decode pool short) now: one pool predicted over (1 + margin) of its target while the
    other would stay under (1 - margin) of its own once it has given one of its ``n`` instances away (its
    pressure times n / (n - 1): the same work on one instance fewer). A pool that would be short itself after the
    change gives nothing: at twice the capacity, more prefill instances did not shorten the prefill pool's steps
    in the simulated fleet, and taking them from the decode pool only moved the misses there."""
    hi, lo = 1.0 + margin, 1.0 - margin

    def spare(pressure: float, n: int) -> bool:
        return n > 1 and pressure * n / (n - 1) < lo

    return p.prefill > hi and spare(p.tpot, n_decode), p.tpot > hi and spare(p.prefill, n_prefill)


def adapt(states: list[InstanceState], rules: AdaptRules, memory: AdaptMemory,
          now: float) -> tuple[RoleChange | None, AdaptMemory]:
    """One look at the cluster at ``now``: the role change to make (None: none) and the memory for the next call."""
    if not rules.on or not any(s.role != "mixed" for s in states):
        return None, AdaptMemory(last_change=memory.last_change, direction=memory.direction)
    p = pressure(states, rules)
    pre, dec = pools(states)
    prefill_short, decode_short = shortness(p, len(pre), len(dec), rules.margin)
    mem = AdaptMemory(
        (memory.prefill_short_since if memory.prefill_short_since is not None else now) if prefill_short else None,
        (memory.decode_short_since if memory.decode_short_since is not None else now) if decode_short else None,
        memory.last_change, memory.direction)
    if mem.last_change is not None and now - mem.last_change < rules.interval_s:
        return None, mem
    change = None
    if prefill_short:
        change = _convert(states, "decode", "prefill", now - mem.prefill_short_since, len(dec) - 1 >= rules.min_decode,
                          rules, f"TTFT {p.ttft:.2f}x target, prefill pace {p.pace:.2f}x TPOT, TPOT {p.tpot:.2f}x")
    elif decode_short:
        change = _convert(states, "prefill", "decode", now - mem.decode_short_since, len(pre) - 1 >= rules.min_prefill,
                          rules, f"TPOT {p.tpot:.2f}x target, TTFT {p.ttft:.2f}x, prefill pace {p.pace:.2f}x TPOT")
    if change is None:
        return None, mem
    return change, AdaptMemory(None, None, now, change.role)


def short_role(states: list[InstanceState], rules: AdaptRules) -> str:
    """The role a new instance should get (auto-scaling): the pool predicted further over its target; "mixed"
    when no instance has a role; "decode" with roles but no targets (it serves whole requests too)."""
    if not any(s.role != "mixed" for s in states):
        return "mixed"
    if not rules.on:
        return "decode"
    p = pressure(states, rules)
    return "prefill" if p.prefill > p.tpot else "decode"
