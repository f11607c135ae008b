"""A proxy's own dispatch view (proxy.dispatch = local): which instances take requests and how free each is.

Inputs: the manager's snapshots (membership, flags, a new instance's credit, ordered migrations), the
instances' heartbeats (load, health, whether they take requests; each one sent on every load change), and
the proxy's own dispatches that an instance's heartbeat does not show yet. A dispatch scores instances with
the cluster's policy (daemons/policy: ``scorer`` and ``pick``, the code the manager runs); a proxy in front of
hundreds of instances keeps every instance's state and scores and recomputes only those whose inputs
changed, so a dispatch costs a max over a list, not a rebuild of the cluster's states.

Liveness here is the proxy's own (``KnownInstances`` in daemons/proxy/cluster/known.py owns ``heard`` and ``beats``); membership is rebuilt
on every snapshot and at least every ``REFRESH_S`` (an instance that fell silent, dispatches that expired).
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from daemons import policy, wire
from daemons.policy import slo

REFRESH_S = 0.5


class _Entry:
    __slots__ = ("view", "load", "state", "scores")

    def __init__(self, view: wire.InstanceView):
        self.view = view  # from the snapshot: address, credit, ordered migrations
        self.load = view.load  # the newest: a heartbeat's when there is one
        self.state: policy.InstanceState | None = None  # built when first scored
        self.scores: dict[tuple, float] = {}  # by (policy, priority class)


class DispatchView:
    def __init__(self, ttl_s: float, rules: policy.Rules, now: Callable[[], float]):
        """``rules``: what dispatch reads of the settings (policy.rules_of)."""
        self.now = now  # its client's clock
        self.ttl_s = ttl_s
        self.rules = rules
        # Our own dispatches per instance not yet in its heartbeats' load: (our Submit number to it, blocks, time,
        # blocks at its expected final length, prompt tokens it holds cached: no work to wait for).
        self.mine: dict[str, deque] = {}
        self.sent: dict[str, int] = {}  # instance id -> Submits we sent it (its heartbeats' ``taken`` counts them)
        self.taken: dict[str, int] = {}  # instance id -> ``taken`` of its last heartbeat
        self.entries: dict[str, _Entry] = {}  # the instances that take requests, by id
        self.ids: list[str] = []  # their ids, in order
        self.at: dict[str, int] = {}  # id -> its index in ``ids``
        self.scores: dict[tuple, list[float]] = {}  # by (policy, SLO class), aligned with ``ids``
        self.scorers: dict[tuple, tuple] = {}  # by the same key: (the scorer, whether the policy pools the fits)
        self.reference = None  # the fit the pooling policies complete the instances' by (slo.pool_reference)
        self.dirty: set[str] = set()  # entries to score again
        self.stale = True  # membership to build again
        self.built_at = 0.0
        self.by_cache = False  # the last choice was the cache's, another than llumnix would pick
        self.decision = ""  # the last choice's disaggregation decision ("": no roles)
        self.placement = policy.Placement(None)  # the last choice whole: its prefix pull, how a session's turn went
        self.roles: dict[str, str] = {}  # instance id -> its role, for those not mixed (dispatch then disaggregates)

    # ------------------------------------------------------------------ inputs

    def invalidate(self) -> None:
        """Membership or flags may have changed (a snapshot, an instance failed a stream)."""
        self.stale = True

    def heard(self, beat: wire.Heartbeat, before: wire.Heartbeat | None) -> None:
        """A heartbeat: its load counts our Submits up to ``taken``, which stop counting as ours."""
        iid = beat.instance_id
        if beat.taken < self.taken.get(iid, 0):  # it restarted, and its count with it
            self.sent[iid] = beat.taken
            self.mine.pop(iid, None)
        self.taken[iid] = beat.taken
        mine = self.mine.get(iid)
        while mine and mine[0][0] <= beat.taken:
            mine.popleft()
        ok = beat.healthy and beat.accepting and beat.load is not None
        if beat.load is not None:
            self._role(iid, beat.load.role)
        entry = self.entries.get(iid)
        if entry is not None and ok:
            entry.load = beat.load
            self.dirty.add(iid)
        elif entry is not None or (ok and not (before is not None and before.healthy and before.accepting)):
            self.stale = True  # it stopped taking requests, or started again

    def _role(self, iid: str, role: str) -> None:
        if role and role != "mixed":
            self.roles[iid] = role
        else:
            self.roles.pop(iid, None)

    def sent_to(self, instance_id: str, load: wire.InstanceLoad | None, tokens: int, max_tokens: int = 0,
                cached_tokens: int = 0) -> None:
        """A Submit of ``tokens`` (that may generate ``max_tokens`` more; ``cached_tokens`` of them cached there, in
        the engine or its host tier, or pulled) went to ``instance_id``: its load until a heartbeat shows it."""
        n = self.sent[instance_id] = self.sent.get(instance_id, 0) + 1
        block_size = load.block_size if load is not None else 16
        final = (slo.final_blocks(policy.state_of(instance_id, load), tokens, max_tokens)
                 if load is not None and load.outlook is not None else policy.blocks_for(tokens + 1, block_size))
        self.mine.setdefault(instance_id, deque()).append((n, policy.blocks_for(tokens + 1, block_size), self.now(),
                                                           final, cached_tokens))
        self.dirty.add(instance_id)

    def lost(self, instance_id: str, n: int) -> None:
        """``n`` of our Submits to ``instance_id`` never reached it: never to be counted by its heartbeats."""
        self.sent[instance_id] = self.sent.get(instance_id, 0) - n

    def resent(self, instance_id: str) -> None:
        """A Submit sent again (same epoch): the instance counts it too, taken in or not."""
        self.sent[instance_id] = self.sent.get(instance_id, 0) + 1

    def pending(self, instance_id: str, now: float) -> tuple[int, int]:
        """Our dispatches to ``instance_id`` its heartbeats do not show yet and not older than ``ttl_s``:
        (requests, KV blocks)."""
        fresh = now - self.ttl_s
        requests = blocks = 0
        for _, b, at, _, _ in self.mine.get(instance_id, ()):
            if at > fresh:
                requests += 1
                blocks += b
        return requests, blocks

    def pending_final(self, instance_id: str, now: float) -> int:
        """The KV blocks our pending dispatches to ``instance_id`` (``pending``) will hold at their expected final
        lengths."""
        fresh = now - self.ttl_s
        return sum(f for _, _, at, f, _ in self.mine.get(instance_id, ()) if at > fresh)

    def pending_cached(self, instance_id: str, now: float) -> int:
        """The prompt tokens of our pending dispatches to ``instance_id`` (``pending``) that it holds cached: KV they
        will use, but no prefill queued there."""
        fresh = now - self.ttl_s
        return sum(c for _, _, at, _, c in self.mine.get(instance_id, ()) if at > fresh)

    def pending_ids(self) -> list[str]:
        """The instances that may have dispatches of ours pending (see ``pending``)."""
        return list(self.mine)

    def predict(self, instance_id: str, load: wire.InstanceLoad, tokens: int, high: bool,
                max_tokens: int = 0) -> tuple[float, float]:
        """(TTFT, TPOT) predicted for a request of ``tokens`` (``high``: of the high SLO class) placed on
        ``instance_id`` now: its load plus our own dispatches it does not show yet (daemons/policy/slo.py). The
        proxy's (dispatch.py) and the simulator's."""
        now = self.now()
        pending_requests, pending_blocks = self.pending(instance_id, now)
        s = policy.state_of(instance_id, load, pending_requests=pending_requests, pending_blocks=pending_blocks,
                            pending_final_blocks=self.pending_final(instance_id, now),
                            pending_cached_tokens=self.pending_cached(instance_id, now))
        return slo.predict_ttft(s, tokens, high, max_tokens), slo.predict_tpot(s, tokens)

    # ------------------------------------------------------------------ the dispatch

    def choose(self, alive, dispatch_policy: str | policy.DispatchPolicy, ask: policy.Ask, turn: int,
               start: float | None, exclude: tuple | list = ()) -> str | None:
        """The instance for a new request: ``policy.place`` over our view (the pool, then the instance by the
        policy), and ``decision`` its disaggregation decision. ``alive`` gives the client's merged view of the
        instances that take requests. Without roles and exclusions (the usual case) the same choice from the
        scores kept between dispatches, recomputed only for the instances whose inputs changed."""
        p = dispatch_policy if isinstance(dispatch_policy, policy.DispatchPolicy) else policy.DISPATCH.get(dispatch_policy)
        now = self.now()
        self.by_cache, self.decision = False, ""
        self.refresh(alive)
        # (Rarer: a cluster with roles, a LoRA request, a session's turn: built afresh.)
        if self.roles or exclude or ask.adapter or (ask.session and p.follows_sessions):
            states = [self.state_of(v, v.load, now) for v in alive() if v.instance_id not in exclude]
            self.placement = placed = policy.place(p, states, ask, turn, self.rules, start)
            self.decision = placed.decision
            return placed.instance_id
        chosen = self._choose_kept(p, ask, turn, start, now)
        pull = ("", 0)
        if chosen is not None and ask.tiers:
            pull = policy.sessions.pull_for(self._scored_state(self.entries[chosen], True, now), self.ids, ask.tiers,
                                            ask.prompt_tokens, self.rules.sessions)
        self.placement = policy.Placement(chosen, "", *pull)
        return chosen

    def _choose_kept(self, p: policy.DispatchPolicy, ask: policy.Ask, turn: int, start: float | None,
                     now: float) -> str | None:
        """``choose`` from the scores kept between dispatches."""
        key = (p.score_key, ask.slo.cls)
        if key not in self.scorers:
            self.scorers[key] = (p.scorer(self.rules.headroom, ask.slo.high, ask.slo.targets.tpot_s), p.predicts)
        scores = self.scores.get(key)
        if scores is None:
            scores = self.scores[key] = [self._score(self.entries[i], key, now) for i in self.ids]
        plain = p.pick(self.ids, scores, turn, start)
        if ask.hits and p.prefix_aware:
            states = {iid: self._scored_state(self.entries[iid], p.predicts, now) for iid in ask.hits
                      if iid in self.entries}
            j = p.cache_pick(self.at, states, scores, ask.hits, self.rules.cache_band, self.rules.cache_floor,
                             ask.tiers, self.rules.sessions)
            if j is not None:
                self.by_cache = self.ids[j] != plain
                return self.ids[j]
        return plain

    def refresh(self, alive) -> None:
        """Membership (and the instances' roles) built again when stale, else the instances whose inputs changed
        scored again."""
        now = self.now()
        if self.stale or now - self.built_at > REFRESH_S:
            self._build(alive(), now)
        elif self.dirty:
            self._pool()
            for iid in self.dirty:
                if iid in self.entries:
                    self._rescore(iid, now)
            self.dirty.clear()

    def _pool(self) -> None:
        """The pooling policies' reference fit (slo.pool_reference, over the instances' fits): when it changes, the
        scores by those policies are all stale."""
        reference = slo.pool_reference(e.load.latency for e in self.entries.values())
        if reference != self.reference:
            self.reference = reference
            for key in [k for k, (_, pooling) in self.scorers.items() if pooling]:
                self.scores.pop(key, None)
                for e in self.entries.values():
                    e.scores.pop(key, None)

    def state_of(self, view: wire.InstanceView, load: wire.InstanceLoad, now: float) -> policy.InstanceState:
        mine = self.mine.get(view.instance_id)
        while mine and now - mine[0][2] > self.ttl_s:
            mine.popleft()
        return policy.state_of(view.instance_id, load, pending_blocks=sum(m[1] for m in mine) if mine else 0,
                               pending_requests=len(mine) if mine else 0, credit=view.credit,
                               pending_final_blocks=sum(m[3] for m in mine) if mine else 0,
                               pending_cached_tokens=sum(m[4] for m in mine) if mine else 0,
                               migrations=view.migrations_ordered)

    def _build(self, views: list[wire.InstanceView], now: float) -> None:
        views = sorted(views, key=lambda v: v.instance_id)
        self.entries = {v.instance_id: _Entry(v) for v in views}
        for v in views:
            self._role(v.instance_id, self.entries[v.instance_id].load.role)
        self.ids = [v.instance_id for v in views]
        self.at = {iid: j for j, iid in enumerate(self.ids)}
        self.scores.clear()
        self.dirty.clear()
        self.reference = slo.pool_reference(e.load.latency for e in self.entries.values())
        self.stale, self.built_at = False, now

    def _rescore(self, iid: str, now: float) -> None:
        """One instance's inputs changed: its state, and its place in every kept score list."""
        entry = self.entries[iid]
        entry.state = None
        entry.scores.clear()
        for key, scores in self.scores.items():
            if scores:
                scores[self.at[iid]] = self._score(entry, key, now)

    def _scored_state(self, entry: _Entry, pooling: bool, now: float) -> policy.InstanceState:
        """The state a policy scores: completed by the cluster's fits for a pooling one (slo.pooled)."""
        if entry.state is None:
            entry.state = self.state_of(entry.view, entry.load, now)
        return slo.pooled_state(entry.state, self.reference) if pooling else entry.state

    def _score(self, entry: _Entry, key: tuple, now: float) -> float:
        score, pooling = self.scorers[key]
        if score is None:  # (a policy that does not look at load)
            return 0.0
        if key not in entry.scores:
            entry.scores[key] = score(self._scored_state(entry, pooling, now))
        return entry.scores[key]

    def describe(self, instance_id: str) -> str:
        """What the last dispatch saw of ``instance_id`` (debug logs)."""
        entry = self.entries.get(instance_id)
        if entry is None or entry.state is None:
            return "not scored"
        st = entry.state
        return (f"{st.blocks_used} blocks used, {st.running} running, {st.waiting} waiting, {st.pending_requests} "
                f"of ours pending, scores {entry.scores}; {len(self.ids)} candidates")
