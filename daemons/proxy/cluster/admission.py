"""Admission: a new request is refused at once (429) while the cluster's queued work is past the [admission]
bounds, or (503) when no instance lives; with an SLO ([slo] TTFT targets), when no instance is predicted to meet its
class's time-to-first-token target (daemons/policy/slo.py ``admit``), with a Retry-After from the predicted drain
time. ``Placing``: the requests waiting here for an instance (or for their turn in the fair queue), which count
as queued work.

Cached prompt tokens are not queued work: our dispatches count without the tokens their instance holds cached
(engine or host tier, or pulled: daemons/proxy/cluster/view.py ``pending_cached``), and a session's turn is
predicted and counted without the part of its prompt its last turn left cached (the session's last prompt's blocks,
looked up in the prefix index per instance): a conversation that reuses more is not refused sooner."""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Callable

from daemons import policy
from daemons.sessions import SessionTable
from daemons.clock import Clock
from daemons.policy import admit as slo_admit, slo
from daemons.proxy.cluster.known import KnownInstances
from daemons.proxy.cluster.stream import Overloaded
from daemons.proxy.cluster.telemetry import AUTO_BATCHES, AUTO_KV_CACHES
from daemons.proxy.cluster.view import DispatchView

log = logging.getLogger("llumnix.proxy")


class Placing:
    """The requests admitted here and not yet placed: request id -> (prompt tokens, max_tokens, until when it
    counts). Written by admission (admitted: it counts at once, before its dispatch, or the next request's
    admission would not see it), dispatch (waiting for an instance; placed: ``discard``) and the fair gate (waiting
    for a turn); read by admission. An admission's entry that no dispatch discards (the request failed before it:
    a bad body, a full choice of ``n``) stops counting after ``ADMITTED_TTL_S``."""

    ADMITTED_TTL_S = 2.0

    def __init__(self, now: Callable[[], float] | None = None):
        self.now = now or (lambda: 0.0)
        self._reqs: dict[str, tuple[int, int, float]] = {}

    def add(self, request_id: str, prompt_tokens: int, max_tokens: int = 0, ttl_s: float = 0.0) -> None:
        """``ttl_s``: it stops counting that long from now unless added again (0: until discarded)."""
        self._reqs[request_id] = (prompt_tokens, max_tokens, self.now() + ttl_s if ttl_s > 0 else math.inf)

    def discard(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)

    def _live(self) -> dict[str, tuple[int, int, float]]:
        now = self.now()
        if any(until <= now for _, _, until in self._reqs.values()):
            self._reqs = {rid: v for rid, v in self._reqs.items() if v[2] > now}
        return self._reqs

    def __len__(self) -> int:
        return len(self._live())

    def tokens(self) -> int:
        return sum(v[0] for v in self._live().values())

    def max_tokens(self) -> int:
        """The most tokens they may generate, all together (0 where one did not say)."""
        return sum(v[1] for v in self._live().values())


class Admission:
    """Reads the instances' heartbeats (known.py), our own dispatches they do not show yet (view.py) and the
    requests placing here. Receives those, the clock, the [admission] settings and ``under_share`` (whether
    a key holds less than its share of the fair queue: daemons/proxy/cluster/fairgate.py)."""

    def __init__(self, adm, clock: Clock, known: KnownInstances, view: DispatchView, placing: Placing,
                 under_share: Callable[[str], bool], slo_cfg=None, classes: slo.Classes | None = None,
                 sessions: SessionTable | None = None, match_tiers: Callable | None = None):
        """``sessions`` and ``match_tiers`` (prefix.Follower.match_tiers): where a session's last prompt is cached
        (None: sessions are not looked up)."""
        self.adm = adm
        self.clock = clock
        self.known = known
        self.view = view
        self.placing = placing
        self.under_share = under_share
        self.targets = (classes or slo.Classes(slo_cfg)).targets if slo_cfg is not None else {}
        self.shares = {slo.NORMAL: slo_cfg.normal_share} if slo_cfg is not None else {}
        self.admit_at = slo_cfg.admit_at if slo_cfg is not None else 1.0
        self.by_slo = any(t.ttft_s > 0 for t in self.targets.values())  # a TTFT target turns admission by SLO on
        self.sessions = sessions
        self.match_tiers = match_tiers

    def cached(self, session: str, prompt_tokens: int) -> dict[str, int]:
        """Per instance, the prompt tokens of a turn of ``session`` it holds cached (engine or host tier): the blocks
        of the session's last prompt it still holds, which lead its next one ({}: none, or no session)."""
        if not session or self.sessions is None or self.match_tiers is None:
            return {}
        keys = self.sessions.keys(session)
        if not keys:
            return {}
        out = {}
        for iid, (_, both) in self.match_tiers(keys).items():
            beat = self.known.beats.get(iid)
            block = beat.load.block_size if beat is not None and beat.load is not None else 16
            if both:
                out[iid] = min(both * block, prompt_tokens)
        return out

    def admit(self, r: slo.RequestSlo, tenant: str = "", prompt_tokens: int = 0, max_tokens: int = 0,
              proxies: int = 1, request_id: str = "", session: str = "") -> slo_admit.Verdict | None:
        """Raise Overloaded if the request (``r``: its SLO class and targets, slo.Classes.of) is refused. With an SLO:
        by its TTFT target (``prompt_tokens``: its prompt, an estimate before tokenizing; ``max_tokens``: the most it
        may generate, 0: not said), and the verdict (with the best predicted TTFT) is returned; otherwise by the
        queue bounds (``admit_by_queue``). ``proxies``: how many proxies admit into the same instances (each
        counts the others' admissions not yet in the instances' reports as many as its own). ``request_id``: an
        admitted request counts as placing here at once, until its dispatch (``Placing``). ``session``: the session
        it names, whose cached part of the prompt is not work (``cached``)."""
        if not self.by_slo:
            self.admit_by_queue(r.high, tenant)
            return None
        cached = self.cached(session, prompt_tokens)
        work = prompt_tokens - max(cached.values(), default=0)  # where it would go: where most of it is cached
        targets = {**self.targets, r.cls: r.own}  # its own: its class's, or its key's where tighter
        states = self.states(proxies)
        if not states:
            return None  # nothing to predict from: placement waits for an instance, or says none is alive
        verdict = slo_admit.admit(states, prompt_tokens, r.cls, targets, self.shares, self.admit_at, max_tokens, cached)
        if not verdict.admitted:
            cls = "high-priority" if r.high else "normal-priority"
            if verdict.reason == "higher_class":
                message = ("the cluster is overloaded: a high-priority request would be refused now (no instance is "
                           "predicted to meet its targets), and normal ones hold their share (slo.normal_share) or more")
            elif verdict.reason == "unknown":
                message = ("the cluster is starting: no instance that takes requests has a step-time model yet (each "
                           "has run fewer than its first steps) and each has work already, so none can be promised "
                           "this request's TTFT target; requests are taken one per idle instance until then")
            elif verdict.reason == "tpot":
                tpot_ms = r.own.tpot_s * 1000
                message = (f"the cluster is overloaded: every instance predicted to give this {cls} request its first "
                           f"token in time would run past its time-per-output-token target with it ({tpot_ms:g} ms; "
                           f"[slo] tpot_ms, admit_at)")
            else:
                target_ms = r.own.ttft_s * 1000
                message = (f"the cluster is overloaded: no instance is predicted to give this {cls} request its first "
                           f"token within {self.admit_at:g} of its target ({target_ms:g} ms; [slo] ttft_ms, "
                           f"admit_at); the best predicted is {_ms(verdict.ttft_s)}")
            raise Overloaded(message, verdict.reason, verdict.retry_after_s)
        if request_id:
            self.placing.add(request_id, work, max_tokens, Placing.ADMITTED_TTL_S)
        return verdict

    def states(self, proxies: int = 1) -> list[policy.InstanceState]:
        """The instances that take requests, as the SLO's predictions see them: their heartbeats' load, our own
        dispatches they do not show yet (``proxies`` > 1: times as many, for the other proxies' that we cannot
        see), and the requests placing here spread over them."""
        now = self.clock.monotonic()
        serving = list(self.known.serving())
        if not serving:
            return []
        n, k = len(serving), max(proxies, 1)
        waiting_here = math.ceil(len(self.placing) / n)
        tokens_here = self.placing.tokens() / n
        out = []
        for iid, beat in serving:
            load = beat.load
            pending_requests, pending_blocks = self.view.pending(iid, now)
            blocks_here = policy.blocks_for(int(tokens_here), load.block_size)
            state = policy.state_of(iid, load, pending_requests=pending_requests * k + waiting_here,
                                    pending_blocks=pending_blocks * k + blocks_here,
                                    pending_final_blocks=self.view.pending_final(iid, now) * k,
                                    pending_cached_tokens=self.view.pending_cached(iid, now) * k)
            if waiting_here and load.outlook is not None:  # those placing here, at their expected final lengths
                each = slo.final_blocks(state, int(tokens_here / waiting_here),
                                        self.placing.max_tokens() // max(len(self.placing), 1))
                state = replace(state, pending_final_blocks=state.pending_final_blocks + each * waiting_here)
            out.append(state)
        return out

    def admit_by_queue(self, high: bool, tenant: str = "") -> None:
        """Raise Overloaded if the work that would wait in the cluster is past [admission]'s bounds for
        ``priority``. Requests that would wait: those waiting to start on the instances that take requests
        (their heartbeats), our own dispatches they do not show yet, the requests waiting here for an
        instance and this one, less the free batch slots; prompt tokens likewise, less the free KV. High
        priority's bounds are admission.high_priority_factor times larger. A key (``tenant``) that holds less
        than its share of the fair queue is let in past the bounds (daemons/proxy/cluster/fairgate.py)."""
        adm = self.adm
        serving = requests = tokens = free_slots = free_tokens = room = capacity = kv = 0
        for _, beat in self.known.serving():
            load = beat.load
            serving += 1
            requests += load.waiting
            tokens += load.waiting_tokens
            free_slots += max(load.batch_size - load.running, 0)
            free_tokens += max(load.blocks_total - load.blocks_used, 0) * load.block_size
            kv += load.blocks_total * load.block_size
            room += AUTO_BATCHES * load.batch_size if adm.max_queued_requests < 0 else adm.max_queued_requests
            capacity += (AUTO_KV_CACHES * load.blocks_total * load.block_size if adm.max_queued_tokens < 0
                         else adm.max_queued_tokens)
        if not serving:
            return  # nothing to measure against: placement waits for an instance, or says none is alive
        now = self.clock.monotonic()
        for iid in self.view.pending_ids():
            beat = self.known.beats.get(iid)
            block = beat.load.block_size if beat is not None and beat.load is not None else 16
            pending_requests, pending_blocks = self.view.pending(iid, now)
            requests += pending_requests
            tokens += max(pending_blocks * block - self.view.pending_cached(iid, now), 0)
        requests += len(self.placing) + 1  # with this one
        tokens += self.placing.tokens()
        factor = adm.high_priority_factor if high else 1.0
        for_high = " for high priority" if high else ""
        if high and factor > 1:  # room for high priority even where normal may not wait at all
            room, capacity = max(room * factor, room + serving), max(capacity * factor, capacity + kv)
        if (requests - free_slots > room or tokens - free_tokens > capacity) and self.under_share(tenant):
            return
        if requests - free_slots > room:
            raise Overloaded(f"the cluster is overloaded: {requests - free_slots} requests would wait on its {serving} "
                             f"instance(s) (admission.max_queued_requests: {room} in all{for_high})", "queued_requests")
        if tokens - free_tokens > capacity:
            raise Overloaded(f"the cluster is overloaded: {tokens - free_tokens} prompt tokens would wait on its "
                             f"{serving} instance(s) (admission.max_queued_tokens: {capacity} in all{for_high})",
                             "queued_tokens")


def _ms(seconds: float) -> str:
    return "unbounded (nothing has finished there yet)" if seconds >= slo.UNKNOWN_WAIT_S else f"{seconds * 1000:.0f} ms"
