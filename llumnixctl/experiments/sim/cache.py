"""Of ``llumnixctl simulate``: prefix caching (``sim.prefix_caching``), sessions and the cache oracle.

- Prompts are token ids (llumnixctl/experiments/traces/cache.py: a trace's shared segments are the same ids
  wherever they appear); without caching every prompt is zeros, which costs nothing to make.
- Each instance publishes its cache's changes as the daemon does (``daemons.prefix.Publisher``: a batch
  before each load report, the batch number on the report); the manager keeps its index with its own
  ``Follower``, and a whole cache it asks for (``CacheSync``) comes back one report lag later.
- A dispatch with ``llumnix-cache`` carries the prompt's block keys, as a proxy's does.
- ``oracle-cache`` (simulation only): each request goes to the instance whose cache really holds most of
  its leading blocks (the engines' own caches, no index, no lag), the freest of those on a tie; no hit
  anywhere: llumnix. The hit rate nothing that places by cache can beat by much.
- The turns of a session are a closed loop: a turn is sent its ``think_s`` after the one before it ended.
- With session keys (``sessions``: the ``sessions`` system of sim/sessions.py) each turn names its session, as a
  client's ``prompt_cache_key`` does: on its Submit, and on its Dispatch to the manager where this build's
  ``wire.Dispatch`` declares a session (the manager's session dispatch, daemons/policy/); a prefix pull the
  manager's reply orders goes on the Submit likewise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping, Protocol

from daemons import policy, prefix, wire
from llumnixctl.experiments.traces import cache as tracecache
from llumnixctl.experiments.traces.sessions import session_key

if TYPE_CHECKING:
    from daemons.manager import Manager

VOCAB = 32000  # prompt ids are drawn below this (the sim engine takes any ids)
# What this build's wire declares of sessions (a build before session dispatch has neither): read from the
# structs' declarations, as the bench reads the config's (bench/sessions.py ``declared``).
DISPATCH_SESSION = "session" in wire.Dispatch.__struct_fields__
REPLY_PULL = "pull_from" in wire.DispatchReply.__struct_fields__


class Site(Protocol):
    """What the cache's parts need of the simulation."""

    instances: Mapping  # instance id -> SimulatedInstance
    requests: Mapping  # request id -> SimulatedRequest
    now: float

    def at(self, t: float, fn: Callable, *args) -> None: ...

    def arrive(self, request_id: str) -> None: ...  # a request is sent to the proxy


class SimCache:
    """Owns the cache settings in force, the sessions' order of turns (``later_turns``: the turns sent only
    once the one before ended) and the oracle's count; each instance's ``Publisher`` is the instance's."""

    def __init__(self, cfg, mgr: Manager, trace: list, report_lag_s: float, oracle: bool, site: Site,
                 sessions: bool = False, seed: int = 0) -> None:
        self.cfg, self.mgr, self.report_lag_s, self.oracle, self.site = cfg, mgr, report_lag_s, oracle, site
        self.sessions, self.seed = sessions, seed
        self.caching = cfg.sim.prefix_caching
        self.cache_keys = self.caching and policy.DISPATCH.get(cfg.manager.dispatch_policy).cache_affinity
        self.by_cache = 0
        if self.caching:
            mgr.cache_index._ask = self.sync
        prev = tracecache.previous_turns(trace)
        at = {tr.index: k for k, tr in enumerate(trace)}  # a request's id is r<its place in the trace>
        self.next_turn = {f"r{at[p]}": f"r{at[i]}" for i, p in prev.items()}  # turn -> the turn after it
        self.later_turns = {f"r{at[i]}" for i in prev}

    def prompt_of(self, req) -> list[int]:
        if not self.caching:
            return [0] * req.trace.prompt_tokens
        if req.ids is None:
            req.ids = tracecache.prompt_ids(req.trace, VOCAB)
        return req.ids

    def keys_of(self, req) -> list[int]:
        if req.keys is None:
            req.keys = prefix.keys(prefix.block_hashes(self.prompt_of(req), self.cfg.sim.block_size))
        return req.keys

    def session_of(self, req) -> str:
        """The session a request names ("": none, or session keys off)."""
        return session_key(self.seed, req.trace.session) if self.sessions and req.trace.session >= 0 else ""

    def ask(self, req, query_id: int, priority: int, exclude: tuple, adapter: str) -> wire.DispatchReply:
        """Ask the manager where ``req`` goes (its own ``on_dispatch_batch``), as a proxy's Dispatch does: with the
        prompt's block keys (cache-aware dispatch) and its session (where the wire declares it); a prefix pull
        the reply orders is kept for the Submit."""
        session = self.session_of(req)
        fields = {"session": session} if session and DISPATCH_SESSION else {}
        reply = self.mgr.on_dispatch_batch([wire.Dispatch(query_id, req.rid, req.trace.prompt_tokens, priority,
                                                          list(exclude), self.keys_of(req) if self.cache_keys else [],
                                                          adapter, **fields)])[0]
        req.pull = (reply.pull_from, reply.pull_blocks) if REPLY_PULL and reply.pull_from else None
        return reply

    def submit_fields(self, req) -> dict:
        """What the Submit carries of the request's session and of a prefix pull the manager ordered."""
        out = {"session": self.session_of(req)} if self.sessions else {}
        if req.pull is not None:
            out["pull_from"], out["pull_blocks"] = req.pull
        return out

    def turn_ended(self, req) -> None:
        """A request finished or failed: its session's next turn is sent after its think time."""
        nxt = self.next_turn.get(req.rid)
        if nxt is not None:
            site = self.site
            site.at(site.now + site.requests[nxt].trace.think_s, site.arrive, nxt)

    # ------------------------------------------------------------------ publication

    def publisher(self, inst) -> None:
        inst.pub = prefix.Publisher(inst.iid, epoch=int(inst.iid[1:]) + 1) if inst.engine.cache is not None else None

    def reports(self, inst) -> Publication:
        """What the instance's reporter reads of its cache's publication."""
        return Publication(inst, self.publish)

    def publish(self, inst) -> None:
        """Before a load report: the changes since the last one go to the manager (first)."""
        pub = inst.pub
        if pub is None:
            return
        pub.add(inst.engine.cache_events())
        batch = pub.take()
        if batch is not None:
            self.site.at(self.site.now + self.report_lag_s, self.mgr.on_cache_events, inst.ident, batch)

    def sync(self, instance_id: str) -> None:
        """The manager asks an instance for its whole cache: it answers one lag later."""
        site = self.site
        inst = site.instances.get(instance_id)
        if inst is None or inst.pub is None or inst.gone is not None:
            return

        def answer() -> None:
            inst.pub.add(inst.engine.cache_events())
            site.at(site.now + self.report_lag_s, self.mgr.on_cache_events, inst.ident,
                    inst.pub.full(inst.engine.cache_snapshot(), host=inst.engine.tier_snapshot()))

        site.at(site.now + self.report_lag_s, answer)

    # ------------------------------------------------------------------ the oracle

    def oracle_choice(self, req) -> str | None:
        keys = self.keys_of(req)
        truth = {}
        for iid, inst in self.site.instances.items():
            if inst.gone is None and not inst.retiring and inst.engine.cache is not None:
                n = inst.engine.cache.leading(keys)
                if n:
                    truth[iid] = n
        if not truth:
            return None
        states = {s.instance_id: s for s in self.mgr.states(self.site.now) if s.dispatchable}
        score = policy.scorer("llumnix", self.cfg.scheduling.high_priority_headroom)
        ranked = [(n, score(states[iid]), iid) for iid, n in truth.items() if iid in states]
        if not ranked:
            return None
        iid = max(ranked)[2]
        self.by_cache += 1
        tr = req.trace
        self.mgr.on_dispatched(wire.Dispatched(req.rid, iid, tr.prompt_tokens, 1 if tr.priority == "high" else 0))
        return iid

    def figures(self) -> dict:
        q = h = 0
        per = {}
        for iid, inst in self.site.instances.items():
            c = inst.engine.cache
            if c is not None:
                q += c.query_tokens
                h += c.hit_tokens
                per[iid] = round(c.hit_tokens / c.query_tokens, 4) if c.query_tokens else None
        out = {"prefix_caching": self.caching}
        if self.caching:
            out.update(prefix_query_tokens=q, prefix_hit_tokens=h, prefix_hit_rate=h / q if q else 0.0,
                       prefix_hit_rate_by_instance=per, oracle_dispatches=self.by_cache if self.oracle else None)
        return out


class Publication:
    """One instance's prefix-cache publication as its reporter reads it (daemons/instance/reports.py's
    ``ReportedCache``): ``publish`` before each report, the ``position`` (epoch, seq) the report carries."""

    def __init__(self, inst, publish: Callable) -> None:
        self.inst, self._publish = inst, publish

    def publish(self) -> None:
        self._publish(self.inst)

    def position(self) -> tuple:
        pub = self.inst.pub
        return (pub.epoch, pub.seq) if pub is not None else ()

    def count(self) -> None:  # (the simulation's figures count the cache: SimCache.figures)
        pass

    def collect(self) -> None:  # (at a boundary: the changes are read as each report publishes)
        pass
