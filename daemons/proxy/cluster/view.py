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
    def __init__(self, ttl_s: float, headroom: float, now: Callable[[], float],
                 tpot_targets: dict[int, float] | None = None):
        self.now = now  # its client's clock
        self.ttl_s = ttl_s
        self.headroom = headroom
        self.tpot_targets = tpot_targets or {}  # per priority class (the slo policy)
        # Our own dispatches per instance not yet in its heartbeats' load: (our Submit number to it, blocks, time).
        self.mine: dict[str, deque] = {}
        self.sent: dict[str, int] = {}  # instance id -> Submits we sent it (its heartbeats' ``taken`` counts them)
        self.taken: dict[str, int] = {}  # instance id -> ``taken`` of its last heartbeat
        self.entries: dict[str, _Entry] = {}  # the instances that take requests, by id
        self.ids: list[str] = []  # their ids, in order
        self.at: dict[str, int] = {}  # id -> its index in ``ids``
        self.scores: dict[tuple, list[float]] = {}  # by (policy, priority class), aligned with ``ids``
        self.dirty: set[str] = set()  # entries to score again
        self.stale = True  # membership to build again
        self.built_at = 0.0
        self.by_cache = False  # the last choice was the cache's, another than llumnix would pick
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

    def sent_to(self, instance_id: str, load: wire.InstanceLoad | None, tokens: int) -> None:
        """A Submit of ``tokens`` went to ``instance_id``: its load until a heartbeat shows it."""
        n = self.sent[instance_id] = self.sent.get(instance_id, 0) + 1
        block_size = load.block_size if load is not None else 16
        self.mine.setdefault(instance_id, deque()).append((n, policy.blocks_for(tokens + 1, block_size), self.now()))
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
        for _, b, at in self.mine.get(instance_id, ()):
            if at > fresh:
                requests += 1
                blocks += b
        return requests, blocks

    def pending_ids(self) -> list[str]:
        """The instances that may have dispatches of ours pending (see ``pending``)."""
        return list(self.mine)

    def predict(self, instance_id: str, load: wire.InstanceLoad, tokens: int, priority: int) -> tuple[float, float]:
        """(TTFT, TPOT) predicted for a request of ``tokens`` placed on ``instance_id`` now: its load plus our own
        dispatches it does not show yet (daemons/policy/slo.py). The proxy's (dispatch.py) and the simulator's."""
        pending_requests, pending_blocks = self.pending(instance_id, self.now())
        s = policy.state_of(instance_id, load, pending_requests=pending_requests, pending_blocks=pending_blocks)
        return slo.predict_ttft(s, tokens, priority > 0), slo.predict_tpot(s, tokens)

    # ------------------------------------------------------------------ the dispatch

    def choose(self, alive, dispatch_policy: str, priority: int, turn: int, start: float | None,
               hits: dict[str, int] | None = None, cache_band: float = 0.25, cache_floor: float = 0.0) -> str | None:
        """The instance for a new request. ``alive`` gives the client's merged view of the instances that
        take requests (called only when membership must be built again). llumnix-cache: ``hits`` are the
        request's cached leading blocks per instance (policy.cache_choice over llumnix's kept scores)."""
        now = self.now()
        if self.stale or now - self.built_at > REFRESH_S:
            self._build(alive(), now)
        elif self.dirty:
            for iid in self.dirty:
                if iid in self.entries:
                    self._rescore(iid, now)
            self.dirty.clear()
        base = "llumnix" if dispatch_policy == "llumnix-cache" else dispatch_policy
        key = (base, 1 if priority > 0 else 0)
        scores = self.scores.get(key)
        if scores is None:
            score = self._scorer(key)
            scores = self.scores[key] = [self._score(self.entries[i], key, score, now) for i in self.ids] if score else []
        self.by_cache = False
        plain = policy.pick(dispatch_policy, self.ids, scores, turn, start)
        if hits and dispatch_policy == "slo":
            states = {iid: self.entries[iid].state for iid in hits if iid in self.entries}
            j = policy.slo_cache_choice(self.at, self.ids, {i: st for i, st in states.items() if st is not None},
                                        scores, hits)
            if j is not None:
                self.by_cache = self.ids[j] != plain
                return self.ids[j]
        if hits and dispatch_policy == "llumnix-cache":
            j = policy.cache_choice(self.at, scores, hits, cache_band, cache_floor)
            if j is not None:
                self.by_cache = self.ids[j] != plain
                return self.ids[j]
        return plain

    def state_of(self, view: wire.InstanceView, load: wire.InstanceLoad, now: float) -> policy.InstanceState:
        mine = self.mine.get(view.instance_id)
        while mine and now - mine[0][2] > self.ttl_s:
            mine.popleft()
        return policy.state_of(view.instance_id, load, pending_blocks=sum(b for _, b, _ in mine) if mine else 0,
                               pending_requests=len(mine) if mine else 0, credit=view.credit,
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
        self.stale, self.built_at = False, now

    def _rescore(self, iid: str, now: float) -> None:
        """One instance's inputs changed: its state, and its place in every kept score list."""
        entry = self.entries[iid]
        entry.state = None
        entry.scores.clear()
        for key, scores in self.scores.items():
            if scores:
                scores[self.at[iid]] = self._score(entry, key, self._scorer(key), now)

    def _scorer(self, key: tuple):
        base, cls = key
        return policy.scorer(base, self.headroom, cls, self.tpot_targets.get(cls, 0.0))

    def _score(self, entry: _Entry, key: tuple, score, now: float) -> float:
        if key not in entry.scores:
            if entry.state is None:
                entry.state = self.state_of(entry.view, entry.load, now)
            entry.scores[key] = score(entry.state)
        return entry.scores[key]

    def describe(self, instance_id: str) -> str:
        """What the last dispatch saw of ``instance_id`` (debug logs)."""
        entry = self.entries.get(instance_id)
        if entry is None or entry.state is None:
            return "not scored"
        st = entry.state
        return (f"{st.blocks_used} blocks used, {st.running} running, {st.waiting} waiting, {st.pending_requests} "
                f"of ours pending, scores {entry.scores}; {len(self.ids)} candidates")
