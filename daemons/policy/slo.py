"""Serving to an SLO: predicted time to first token (TTFT) and time per output token (TPOT), on which the admission
rule (daemons/policy/admit.py) decides. Pure functions over plain values (an instance's load report and its fitted step-time model).

The model (wire.LatencyFit, fitted by each instance from its own steps: daemons/instance/predictor.py) is the sim
engine's latency model: a step that prefills P tokens and decodes D requests holding C context tokens takes

    prefill_ms + prefill_ms_per_token * P   (when P > 0)
  + decode_ms + decode_ms_per_seq * D + decode_ms_per_token * C   (when D > 0)

Predicted TTFT of a new request on an instance: what is left of the step running when it arrives, the wait for a
batch slot and KV cache (the requests that must finish first, at the rate requests finish there), then the prefill
of everything queued ahead of it plus its own prompt, in steps of at most ``chunk_tokens``, each also decoding the
running batch. A high-priority request queues behind the high-priority work only. Predicted TPOT: the decode step of
the batch it would join (what runs, and what is queued ahead of it, up to the batch size) plus the recent mean of
what else the steps did (others' prefills).

Admission (admit.py ``admit``): a request of a class is admitted when some instance is predicted to meet its class's TTFT
target and, with it joining its batch, its TPOT target (reason "tpot" when only the second fails), and (higher class first) only while a request of every higher class would be admitted at the same moment,
unless its class holds less than its reserved share of the cluster's requests (no class starves another below
its share). Each class is bounded by its own target: admitted work never grows past what meets it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import msgspec

from daemons.policy.lengths import expected_output
from daemons.policy.usage import InstanceState, blocks_for, state_of

HIGH, NORMAL = 1, 0
TIE_S = 1e-4  # dispatch by SLO: what each request on an instance with no model yet weighs (seconds)
UNKNOWN_WAIT_S = 3600.0  # a queue that cannot drain as far as we know (nothing has finished yet): "very long"


@dataclass(frozen=True)
class Targets:
    """One request's SLO, in seconds (0: no target of that kind)."""

    ttft_s: float = 0.0
    tpot_s: float = 0.0

    @property
    def on(self) -> bool:
        return self.ttft_s > 0 or self.tpot_s > 0

    def tighter(self, other: "Targets") -> "Targets":
        """The tighter of the two, per kind (an API key may carry a tighter class than its priority's)."""

        def pick(a: float, b: float) -> float:
            return min(a, b) if a > 0 and b > 0 else (a or b)

        return Targets(pick(self.ttft_s, other.ttft_s), pick(self.tpot_s, other.tpot_s))


def class_targets(slo) -> dict[int, Targets]:
    """The targets per priority class from the [slo] settings (daemons/config.py SloConfig): {0: normal, 1: high}."""
    normal = Targets(slo.ttft_ms / 1000.0, slo.tpot_ms / 1000.0)
    high = Targets((slo.high_ttft_ms or slo.ttft_ms) / 1000.0, (slo.high_tpot_ms or slo.tpot_ms) / 1000.0)
    return {NORMAL: normal, HIGH: high}


def class_of(priority: int) -> int:
    """A request's SLO class by its scheduling priority: HIGH for any priority above normal, else NORMAL."""
    return HIGH if priority > 0 else NORMAL


@dataclass(frozen=True)
class RequestSlo:
    """A request's SLO class and targets, computed once where the request enters a process (``Classes.of``) and
    carried with it: ``targets``, its class's ([slo]: what dispatch and admission schedule by); ``own``, what it
    is judged against (its class's, tightened by its API key's)."""

    cls: int = NORMAL
    targets: Targets = Targets()
    own: Targets = Targets()

    @property
    def high(self) -> bool:
        return self.cls > NORMAL


NO_SLO = RequestSlo()


class Classes:
    """The [slo] targets per class, read once per process: ``of`` gives each request its ``RequestSlo``."""

    def __init__(self, slo_cfg):
        self.targets = class_targets(slo_cfg)

    def of(self, priority: int, key: Targets | None = None) -> RequestSlo:
        """The class and targets of a request of ``priority`` (``key``: its API key's own targets, if any)."""
        cls = class_of(priority)
        mine = self.targets[cls]
        return RequestSlo(cls, mine, mine.tighter(key) if key is not None and key.on else mine)


def fitted(fit) -> bool:
    return fit is not None and fit.steps > 0


def decode_ms(fit, batch: int, context_tokens: int) -> float:
    """A decode step of ``batch`` requests holding ``context_tokens``. Past the largest batch the instance has run
    (``decode_seen``) its model only extrapolates, and a batch there takes no less per request than at that largest:
    where the steps could not tell a step's fixed cost from its per-request cost (a warm-up one request at a time),
    the fit may put it all in the fixed part and call a batch of 100 as fast as one; this bound, linear through
    the origin from the largest batch run, is above the truth for any step time that grows at most linearly."""
    if batch <= 0:
        return 0.0
    ms = max(0.0, fit.decode_ms + fit.decode_ms_per_seq * batch + fit.decode_ms_per_token * context_tokens)
    seen = fit.decode_seen
    if 0 < seen < batch:
        at_seen = fit.decode_ms + fit.decode_ms_per_seq * seen + fit.decode_ms_per_token * context_tokens * seen / batch
        ms = max(ms, max(at_seen, 0.0) * batch / seen)
    return ms


def prefill_step_ms(fit, tokens: int) -> float:
    """The prefill part of a step of ``tokens`` prompt tokens; past the largest the instance has run
    (``prefill_seen``), no less per token than there (as ``decode_ms``: an upper bound where the model cannot know)."""
    if tokens <= 0:
        return 0.0
    ms = max(0.0, fit.prefill_ms + fit.prefill_ms_per_token * tokens)
    seen = fit.prefill_seen
    if 0 < seen < tokens:
        # A step of a few tokens is its fixed cost: taken as the cost of at least PREFILL_BOUND_FLOOR tokens, or the
        # bound would call a 25-token prompt ten such steps.
        per = max(fit.prefill_ms + fit.prefill_ms_per_token * seen, 0.0) / max(seen, PREFILL_BOUND_FLOOR)
        ms = max(ms, per * tokens)
    return ms


PREFILL_BOUND_FLOOR = 64  # prefill tokens below which a step's time says nothing of the per-token cost


def extrapolated(fit, prefill_tokens: int, batch: int) -> bool:
    """Whether a step of this size is past what the instance has run (its prediction is the bound, not the model)."""
    return (0 < fit.prefill_seen < prefill_tokens) or (0 < fit.decode_seen < batch)


def step_ms(fit, prefill_tokens: int, batch: int, context_tokens: int) -> float:
    """A step's time by the model (the formula of daemons/engine/sim.py's ``model_time``, bounded past the largest
    steps run)."""
    return decode_ms(fit, batch, context_tokens) + prefill_step_ms(fit, prefill_tokens)


@dataclass(frozen=True)
class Ahead:
    """The work queued on an instance ahead of a new request of one class: requests and prompt tokens."""

    requests: int
    tokens: int


def ahead_of(s: InstanceState, high: bool) -> Ahead:
    """Queued ahead of a new request: the high-priority queue for a high request, everything for a normal one
    (our own dispatches its reports do not show yet count as queued, less the prompt tokens they find cached: no
    prefill waits for those)."""
    if high:
        return Ahead(s.waiting_high, s.waiting_high_tokens)
    pending = max(s.pending_blocks * s.block_size - s.pending_cached_tokens, 0)
    return Ahead(s.waiting + s.pending_requests, s.waiting_tokens + pending)


def slot_wait_s(s: InstanceState, fit, ahead: Ahead, prompt_tokens: int, max_tokens: int = 0) -> float:
    """How long until the requests ahead and this one all have a batch slot and their KV cache. With the
    instance's outlook (wire.Outlook: its requests' KV at their expected final lengths, and when the running ones
    are expected to finish), by that: KV counts at what the requests will grow to, not what they hold now (vLLM
    admits by the prompt, and preempts what it admitted as the batch's KV grows); else the requests that must
    finish first, at the instance's recent finish rate. ``max_tokens``: the request's (0: not known)."""
    if s.outlook is not None:
        return outlook_wait_s(s, fit, ahead, prompt_tokens, max_tokens)
    free_slots = max(s.batch_size - s.running, 0)
    short = ahead.requests + 1 - free_slots
    free_blocks = s.blocks_total - s.blocks_used
    short_blocks = blocks_for(ahead.tokens + prompt_tokens + 1, s.block_size) - free_blocks
    if short_blocks > 0:
        per_request = s.blocks_used / max(s.running, 1)  # what a finishing request gives back, on average
        short = max(short, math.ceil(short_blocks / max(per_request, 1.0)))
    if short <= 0:
        return 0.0
    if fit.finish_rate <= 0:
        return UNKNOWN_WAIT_S
    return short / fit.finish_rate


REFERENCE_OUTPUT_TOKENS = 256  # a request's max_tokens where it is not known (dispatch scores, status)


def final_blocks(s: InstanceState, prompt_tokens: int, max_tokens: int = 0) -> int:
    """KV blocks a new request will hold on ``s`` at its expected final length (the output lengths ``s``
    observes, capped at ``max_tokens``; all of it when ``s`` has observed none)."""
    lengths = s.outlook.lengths if s.outlook is not None else []
    return blocks_for(prompt_tokens + expected_output(lengths, 0, max_tokens or REFERENCE_OUTPUT_TOKENS),
                      s.block_size)


def outlook_wait_s(s: InstanceState, fit, ahead: Ahead, prompt_tokens: int, max_tokens: int = 0) -> float:
    """``slot_wait_s`` by the instance's outlook: short of slots or of KV (at final lengths: the requests there,
    our pending dispatches and this one), the wait is until enough slots free (``slots_free_s``) and enough KV
    (the running requests' expected finishes, then the queued ones' answers, a KV cache's worth each)."""
    o = s.outlook
    need_slots = ahead.requests + 1 - max(s.batch_size - s.running, 0)
    need_blocks = o.committed_blocks + s.pending_final_blocks + final_blocks(s, prompt_tokens, max_tokens) - s.blocks_total
    if need_slots <= 0 and need_blocks <= 0:
        return 0.0
    step_s = (decode_ms(fit, max(s.running, 1), s.context_tokens) + max(fit.extra_ms, 0.0)) / 1000.0
    # What a queued request ahead runs for once it has a slot: the instance's waiting requests' expected answers
    # where it reports them, else this request's own.
    answer = o.waiting_output or expected_output(o.lengths, 0, max_tokens or REFERENCE_OUTPUT_TOKENS)
    answer_s = answer * step_s
    slots = slots_free_s(o.drain, max(s.batch_size - s.running, 0), need_slots, step_s, answer_s)
    return max(slots, _blocks_free_s(o.drain, s.blocks_total, need_blocks, step_s, answer_s))


def slots_free_s(drain, free: int, need: int, step_s: float, answer_s: float) -> float:
    """Seconds until ``need`` more batch slots have come free (the ``free`` ones now are taken by the requests
    queued first): each running request's slot frees at its expected finish (``drain``: wire.Outlook's ranks,
    each rank's requests at its time), and every slot then frees again each ``answer_s``, as the queued request that
    took it finishes. A queue is served by slots freeing at staggered times, not in waves of a whole batch."""
    if need <= 0:
        return 0.0
    groups, prev = [], 0
    for remaining, done, _ in drain:
        if done > prev:
            groups.append((remaining * step_s, done - prev))
            prev = done
    if free > 0:
        groups.append((answer_s, free))
    if not groups:
        return 0.0
    if answer_s <= 0:  # no step time known: the running requests' slots only
        ts = sorted(groups)
        got = 0
        for t, c in ts:
            got += c
            if got >= need:
                return t
        return ts[-1][0]

    # Slot g frees at base_g + q x answer_s (q >= 0). Written as rounds of answer_s: base_g = r_g rounds + phase_g,
    # so each slot frees once per round from round r_g on, at its phase. Find the round in which the need-th
    # freeing falls, then the slot within it.
    rounds = []
    for base, c in groups:
        r = math.floor(base / answer_s)
        rounds.append((base - r * answer_s, r, c))
    rounds.sort()

    def through(m: int) -> int:  # slots freed in rounds 0..m
        return sum(c * (m - r + 1) for _, r, c in rounds if r <= m)

    per_round = sum(c for _, _, c in rounds)
    lo, hi = 0, max(0, math.ceil((need + sum(c * (r - 1) for _, r, c in rounds)) / per_round))
    while lo < hi:  # the first round through which ``need`` have freed (through() only grows)
        mid = (lo + hi) // 2
        if through(mid) >= need:
            hi = mid
        else:
            lo = mid + 1
    got = through(lo - 1) if lo > 0 else 0
    for phase, r, c in rounds:
        if r <= lo:
            got += c
            if got >= need:
                return lo * answer_s + phase
    return (lo + 1) * answer_s  # (not reached: round lo frees enough)


def _blocks_free_s(drain, blocks_total: int, need: int, step_s: float, answer_s: float) -> float:
    """Seconds until ``need`` more KV blocks have come free: at the running requests' expected finishes, then a KV
    cache's worth per queued answer (``answer_s``)."""
    if need <= 0:
        return 0.0
    for remaining, _, freed in drain:
        if freed >= need:
            return remaining * step_s
    last_s, freed = (drain[-1][0] * step_s, drain[-1][2]) if drain else (0.0, 0)
    return last_s + (need - freed) / max(blocks_total, 1) * answer_s


def prefill_s(s: InstanceState, fit, tokens: int) -> float:
    """Time to prefill ``tokens`` queued prompt tokens, in steps of at most chunk_tokens that also decode the
    running batch."""
    steps = max(1, math.ceil(tokens / fit.chunk_tokens)) if fit.chunk_tokens > 0 else 1
    per_step = prefill_step_ms(fit, math.ceil(tokens / steps)) + decode_ms(fit, s.running, s.context_tokens)
    return max(0.0, steps * per_step) / 1000.0


def predict_ttft(s: InstanceState, prompt_tokens: int, high: bool = False, max_tokens: int = 0) -> float:
    """Seconds until a new request of ``prompt_tokens`` uncached prompt tokens gets its first token on ``s``
    (0 while the instance has no model yet, even pooled; admission then promises nothing where work is there
    already: ``unknown``)."""
    fit = s.latency
    if not fitted(fit):
        return 0.0
    ahead = ahead_of(s, high)
    # A request joins at a step boundary: while a batch runs, it first waits out what is left of the current step
    # (half of one, on average).
    boundary = 0.5 * (decode_ms(fit, s.running, s.context_tokens) + max(fit.extra_ms, 0.0)) / 1000.0 if s.running else 0.0
    # Two bottlenecks, whichever binds: the slots (and KV) that the requests ahead and this one wait for, each
    # prompt ahead prefilling as its slot frees (within that wait: the steps it is timed by carry their prefills,
    # the fit's extra_ms), then this prompt; or the prefill of every prompt queued ahead and of this one.
    wait = slot_wait_s(s, fit, ahead, prompt_tokens, max_tokens)
    return boundary + max(wait + prefill_s(s, fit, prompt_tokens), prefill_s(s, fit, ahead.tokens + prompt_tokens))


def predict_tpot(s: InstanceState, prompt_tokens: int = 0, joining: int = 1) -> float:
    """Seconds per output token on ``s`` with ``joining`` more requests of ``prompt_tokens`` in its batch
    (``joining`` 0: as it runs now)."""
    fit = s.latency
    if not fitted(fit):
        return 0.0
    # The batch it decodes in: what runs, and what is queued ahead of it (it starts before), up to the batch size.
    queued = s.waiting + s.pending_requests if joining else 0
    batch = s.running + queued + joining
    if s.batch_size:
        batch = min(batch, max(s.batch_size, s.running))
    if batch <= 0:
        return 0.0
    context = s.context_tokens + joining * prompt_tokens
    if queued:
        context += (s.waiting_tokens + s.pending_blocks * s.block_size) * min(1.0, (batch - s.running - joining) / queued)
    extra = fit.extra_ms if s.running + s.waiting > 0 else 0.0  # an idle instance prefills nobody else
    return (decode_ms(fit, batch, context) + max(extra, 0.0)) / 1000.0


def latency_usage(s: InstanceState, tpot_target_s: float, full: float, calm: float = 0.6) -> float:
    """Virtual usage (KV blocks) that the TPOT target adds to ``s``: none while its predicted TPOT is under ``calm``
    of the target, rising linearly to blocks_total at ``full`` of it (and on past it). Added to the memory's
    usage, an instance nearing the target looks full: dispatch avoids it and pairing moves decodes off it; nearly
    idle ones add nothing and are consolidated for scale-in by memory, as before."""
    if tpot_target_s <= 0 or not fitted(s.latency) or s.running <= 0:
        return 0.0
    ratio = predict_tpot(s, joining=0) / tpot_target_s
    return s.blocks_total * max(0.0, ratio - calm) / max(full - calm, 1e-3)


def with_latency_usage(s: InstanceState, tpot_target_s: float, full: float) -> InstanceState:
    """``s`` with the virtual usage its TPOT target gives it (``latency_usage``)."""
    usage = latency_usage(s, tpot_target_s, full)
    return replace(s, slo_usage=usage) if usage else s


def slo_score(s: InstanceState, prompt_tokens: int, high: bool, tpot_target_s: float) -> float:
    """Dispatch by SLO (higher is better, as freeness): the instance with the best predicted TTFT among those
    whose predicted TPOT with the request stays under the target; past the target, the instances still rank by
    TTFT, behind every one that meets it. Instances with no model yet all predict 0: among them the one with the
    fewest requests (running, queued and our own pending dispatches, ``TIE_S`` each) goes first, or a burst at
    start-up goes to one of them (16 simulated instances: 16 requests, given up, on one)."""
    score = -predict_ttft(s, prompt_tokens, high)
    if not fitted(s.latency):
        score -= TIE_S * (s.running + s.waiting + s.pending_requests)
    if tpot_target_s > 0 and predict_tpot(s, prompt_tokens) > tpot_target_s:
        score -= UNKNOWN_WAIT_S * 2
    return score


# ------------------------------------------------------------------ pooled fits


def pooled(states: list[InstanceState]) -> list[InstanceState]:
    """``states`` with each fitted instance's per-token prefill cost raised to the highest the cluster's fits
    give, and the instances with no model yet given that of the fit with the highest. The instances serve the
    same model, but one that has prefilled only short prompts cannot tell its per-token cost yet (its fixed
    prefill cost absorbs it, and its model says a long prompt prefills nearly free), and one that has not
    stepped predicts nothing at all (0); admission and dispatch by SLO take the best instance, so the least
    informed would decide (a start-up burst went to an instance whose model said its queue prefilled for free).
    (In the simulator, with prefill 0.2 ms per token, instances' fits went as low as 0.001 for a minute; a
    3,000-token prompt was then predicted at 33 ms and admitted against a 230 ms target.)"""
    worst = pool_reference(s.latency for s in states)
    if worst is None:
        return states
    return [pooled_state(s, worst) for s in states]


def pool_reference(fits):
    """The fit ``pooled`` completes the others' by: of the fitted ones among ``fits``, the one with the highest
    per-token prefill cost (None: none fitted)."""
    return max((f for f in fits if fitted(f)), key=lambda f: f.prefill_ms_per_token, default=None)


def pooled_state(s: InstanceState, worst) -> InstanceState:
    """One instance's state completed by the cluster's ``worst`` fit (``pool_reference``; None: as it is)."""
    if worst is None:
        return s
    if not fitted(s.latency):
        return replace(s, latency=msgspec.structs.replace(worst, finish_rate=0.0))
    if s.latency.prefill_ms_per_token < worst.prefill_ms_per_token:
        return replace(s, latency=msgspec.structs.replace(s.latency, prefill_ms_per_token=worst.prefill_ms_per_token))
    return s


# ------------------------------------------------------------------ what operators see

REFERENCE_PROMPT_TOKENS = 512  # the prompt `llumnixctl status` and the instances' gauges predict for (fixed: comparable)


def reference_prediction(instance_id: str, load) -> tuple[float | None, float | None]:
    """(TTFT, TPOT) in seconds predicted for a new request of REFERENCE_PROMPT_TOKENS on an instance with this load
    report (wire.InstanceLoad), joining its batch; None each while the instance has no step-time model yet."""
    if not fitted(load.latency):
        return None, None
    state = state_of(instance_id, load)
    return predict_ttft(state, REFERENCE_PROMPT_TOKENS), predict_tpot(state, REFERENCE_PROMPT_TOKENS, joining=1)
