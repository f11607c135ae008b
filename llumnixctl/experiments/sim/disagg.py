"""Prefill/decode disaggregation in the simulator (llumnixctl/experiments/sim/simulate.py), on the daemons' own
policy code (daemons/policy/disagg.py):

- roles: each simulated instance has one (``mixed``, ``prefill``, ``decode``), carried in its load reports (the
  sim engine's ``role``), so the manager's and the proxy's states see it;
- dispatch: while any instance has a role, ``disagg.decide`` picks the pool a new request prefills in (from the
  same states the dispatcher reads: ``policy.pool_for``, the first half of every dispatcher's ``policy.place``),
  and the dispatch policy picks within it (the other instances excluded);
  the decisions are counted by kind;
- handover: a request that gets its first token on a prefill instance is handed over, as the manager orders it
  (``HandoverReady`` to the manager, ``MigrateStart`` back: two message latencies), to the decode instance
  ``disagg.handover_destination`` chooses now, by the instances' own migrators (sim/migrate.py): its KV copy
  lasts its bytes at ``--kv-gbps``; the destination continues decoding without prefill. With no destination
  with room it keeps decoding where it is, and is moved later (reason ``role``), as are the decodes left on an
  instance that became a prefill instance; balance pairing leaves prefill instances out;
- adaptive roles (``disagg.adaptive``): ``disagg.adapt`` looks at the manager's states every second and its
  changes are applied at once (the instance reports its new role).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Mapping, Protocol

from daemons import wire
from daemons.policy import disagg, slo
from daemons.policy.dispatch import Ask, pool_for, rules_of
from daemons.policy.disagg import AdaptMemory
from llumnixctl.experiments.sim.result import stats_of

if TYPE_CHECKING:
    from llumnixctl.experiments.sim.parts import SimulatedInstance, SimulatedRequest

ADAPT_EVERY_S = 1.0  # how often the adaptive rule looks (the manager's loop: every heartbeat)


def parse_roles(spec: str, instances: int) -> list[str]:
    """``--roles``: "P:D" (P prefill instances, then D decode ones; P + D = instances) or a comma-separated list
    of one role per instance ("prefill,decode,..."; m, p, d abbreviate). ValueError with what is wrong."""
    spec = spec.strip()
    if ":" in spec:
        try:
            p, d = (int(x) for x in spec.split(":"))
        except ValueError:
            raise ValueError(f"--roles {spec!r}: P:D takes two counts (e.g. 2:6)") from None
        if p < 0 or d < 0 or p + d != instances:
            raise ValueError(f"--roles {spec!r}: P + D must be the number of instances ({instances})")
        return ["prefill"] * p + ["decode"] * d
    short = {"m": "mixed", "p": "prefill", "d": "decode"}
    roles = [short.get(r.strip(), r.strip()) for r in spec.split(",")]
    bad = [r for r in roles if r not in disagg.ROLES]
    if bad:
        raise ValueError(f"--roles: unknown role {bad[0]!r} (mixed, prefill, decode)")
    if len(roles) != instances:
        raise ValueError(f"--roles: {len(roles)} roles for {instances} instances")
    return roles


class Site(Protocol):
    now: float
    requests: Mapping
    instances: Mapping

    def at(self, t: float, fn: Callable, *args) -> None: ...

    def observe(self, fn: Callable) -> None: ...

    def count_orders(self, src: str, dst: str, n: int) -> None: ...

    def woken(self, inst: SimulatedInstance) -> None: ...


class SimRoles:
    """Owns the instances' roles as set, the adaptive rule's memory and the figures: ``decisions`` (by kind),
    handovers (outcomes, and the time from the first token to the commit on the decode instance), role changes.
    Receives the settings, the initial roles (None: all mixed), the network's message latency, the manager
    (its states and its orders' ledger), the migrations (sim/migrate.py ``SimMigrations.move``) and the
    simulation (``Site``)."""

    def __init__(self, cfg, roles: list[str] | None, message_s: float, site: Site) -> None:
        self.cfg, self.initial, self.message_s, self.site = cfg, list(roles or []), message_s, site
        self.classes = slo.Classes(cfg.slo)
        self.tpot_of = {k: t.tpot_s for k, t in self.classes.targets.items()}
        self.rules = rules_of(cfg)
        self.adaptive = cfg.disagg.adaptive
        self.adapt_rules = disagg.adapt_rules_of(cfg.disagg, cfg.slo)
        self.memory = AdaptMemory()
        self.decisions: Counter = Counter()
        self.handovers: Counter = Counter()
        self.handover_s: list[float] = []
        self.changes: list[dict] = []
        self.moving: dict[str, str] = {}  # request id -> "handover" | "role" (a move of ours in flight)
        self.incoming: dict[str, tuple[str, int]] = {}  # request id -> (destination, blocks) of those moves
        self.mgr = self.migrations = None  # (set by start)

    @property
    def on(self) -> bool:
        return any(r != "mixed" for r in self.initial) or any(
            i.engine.role != "mixed" for i in self.site.instances.values())

    def start(self, mgr, migrations, going: Callable[[], bool]) -> None:
        """The manager and migrations are there: the sweeps and the adaptive rule start (while ``going()``)."""
        self.mgr, self.migrations, self.going = mgr, migrations, going
        self.site.observe(lambda kind, _, d: kind == "migration" and self.migrated(d["request"], d["reason"],
                                                                                d["outcome"]))
        if self.on:
            self.site.at(self.site.now + self.cfg.scheduling.migration_interval_s, self._sweep)
        if self.adaptive and self.adapt_rules.on:
            self.site.at(self.site.now + ADAPT_EVERY_S, self._adapt)

    def assign(self, inst: SimulatedInstance) -> None:
        """A new instance's role: the one given for its index; an instance added later (auto-scaling) gets
        the short role (``disagg.short_role``) while roles are in use."""
        index = len(self.site.instances)
        if index < len(self.initial):
            role = self.initial[index]
        elif self.on and self.mgr is not None:
            role = disagg.short_role(self.mgr.states(self.site.now), self.adapt_rules)
        else:
            role = "mixed"
        inst.engine.role = role

    # ------------------------------------------------------------------ dispatch

    def exclude(self, dispatcher, prompt_tokens: int, priority: int, exclude: tuple) -> tuple:
        """Where a new request may go: ``exclude`` plus, while roles are in use, the instances outside the pool
        ``disagg.decide`` picks (counted by decision) from the states the dispatcher (the proxy's view or the
        manager: its ``states``) reads."""
        if not self.on:
            return exclude
        states = dispatcher.states(self.site.now)
        if not disagg.active(states):
            return exclude
        d = pool_for([s for s in states if s.instance_id not in exclude],
                     Ask(prompt_tokens, priority, self.classes.of(priority)), self.rules)
        if d is None:
            return exclude
        self.decisions[d.decision] += 1
        if not d.pool:
            return exclude
        pool = {s.instance_id for s in d.pool}
        return tuple(exclude) + tuple(s.instance_id for s in states if s.instance_id not in pool)

    def allows(self, src: str, dst: str) -> bool:
        """Balance pairing may move requests from ``src`` to ``dst``: prefill instances are left out of it (their
        decodes leave by handover, and by the role sweep)."""
        return not any(i is not None and i.engine.role == "prefill"
                       for i in (self.site.instances.get(src), self.site.instances.get(dst)))

    # ------------------------------------------------------------------ handover

    def first_token(self, inst: SimulatedInstance, req: SimulatedRequest) -> None:
        """``req`` got its first token on ``inst``: a prefill instance hands it over (unless it has finished)."""
        if inst.engine.role == "prefill" and not req.finish and req.trace.output_tokens > 1:
            self.handover(inst, req.rid, "handover")

    def handover(self, src: SimulatedInstance, rid: str, reason: str) -> bool:
        """Order ``rid`` off ``src`` to the decode instance chosen now; False: none can take it (it stays)."""
        if rid in self.moving:
            return False
        req = self.site.requests[rid]
        prio = 1 if req.trace.priority == "high" else 0
        tokens = req.trace.prompt_tokens + req.tokens
        blocks = disagg.handover_blocks(tokens, src.engine.block_size)
        dst = disagg.handover_destination(self._with_incoming(self.mgr.states(self.site.now)), src.iid, tokens, blocks,
                                          self.tpot_of.get(prio, 0.0), self.cfg.scheduling.high_priority_headroom,
                                          prio)
        if dst is None or dst not in self.site.instances:
            if reason == "handover":  # (the sweep's retries are not counted)
                self.handovers["handover/no_destination"] += 1
            return False
        self.moving[rid] = reason
        self.incoming[rid] = (dst, blocks)
        self.site.count_orders(src.iid, dst, 1)
        # HandoverReady reaches the manager, its MigrateStart the source: two messages.
        self.site.at(self.site.now + 2 * self.message_s, self._order, src, self.site.instances[dst], rid, reason)
        return True

    def _with_incoming(self, states: list) -> list:
        """The states with the handovers in flight to each instance counted as dispatches not yet reported
        (pending blocks and requests): without them every handover of a burst goes to the same freest instance,
        whose reservations then queue behind each other and find no room."""
        per: dict[str, list[int]] = {}
        for dst, blocks in self.incoming.values():
            c = per.setdefault(dst, [0, 0])
            c[0], c[1] = c[0] + blocks, c[1] + 1
        if not per:
            return states
        return [replace(s, pending_blocks=s.pending_blocks + per[s.instance_id][0],
                        pending_requests=s.pending_requests + per[s.instance_id][1]) if s.instance_id in per else s
                for s in states]

    def _order(self, src: SimulatedInstance, dst: SimulatedInstance, rid: str, reason: str) -> None:
        self.migrations.move(src, dst, rid, reason)

    def migrated(self, request: str, reason: str, outcome: str) -> None:
        """A migration ended (the "migration" observers' event): ours are counted, a handover timed."""
        if self.moving.get(request) != reason:
            return
        del self.moving[request]
        self.incoming.pop(request, None)
        self.handovers[f"{reason}/{outcome}"] += 1
        req = self.site.requests[request]
        if outcome == "committed" and reason == "handover" and req.first >= 0:
            self.handover_s.append(self.site.now - req.first)

    def _sweep(self) -> None:
        """Every migration interval: the decodes on prefill instances move to decode instances (reason "role":
        those whose handover found no room, and those left on an instance that became a prefill instance)."""
        for inst in list(self.site.instances.values()):
            if inst.engine.role != "prefill" or inst.gone is not None:
                continue
            busy = inst.table.migrating()
            for row in inst.engine.requests():
                req = self.site.requests.get(row.request_id)  # (a token out of its step, not only computed)
                if row.state == "running" and req is not None and disagg.misplaced("prefill", req.tokens) and \
                        row.request_id not in busy and row.request_id in inst.table:
                    self.handover(inst, row.request_id, "role")
        if self.going():
            self.site.at(self.site.now + self.cfg.scheduling.migration_interval_s, self._sweep)

    # ------------------------------------------------------------------ adaptive roles

    def _adapt(self) -> None:
        now = self.site.now
        change, self.memory = disagg.adapt(self.mgr.states(now), self.adapt_rules, self.memory, now)
        if change is not None and change.instance_id in self.site.instances:
            inst = self.site.instances[change.instance_id]
            self.changes.append({"t": round(now, 3), "instance": change.instance_id, "from": inst.engine.role,
                                 "to": change.role, "reason": change.reason})
            inst.engine.role = change.role
            inst.standing.set_role(wire.SetRole(change.role, "adaptive"))  # the reports' role (the daemons' owner)
            inst.reporter.refresh()
            self.site.woken(inst)
        if self.going():
            self.site.at(now + ADAPT_EVERY_S, self._adapt)

    # ------------------------------------------------------------------ figures

    def figures(self) -> dict:
        if not self.on and not self.decisions:
            return {}
        final = Counter(i.engine.role for i in self.site.instances.values() if i.gone is None)
        out = {
            "roles": Counter(self.initial) if self.initial else {}, "roles_at_end": dict(final),
            "adaptive": self.adaptive and self.adapt_rules.on, "decisions": dict(sorted(self.decisions.items())),
            "handovers": dict(sorted(self.handovers.items())),
            "handovers_committed": self.handovers["handover/committed"],
            "role_changes": len(self.changes), "changes": self.changes,
        }
        out["roles"] = dict(out["roles"])
        st = stats_of("handover", self.handover_s)
        out["handover_ms"] = {k.split("_")[0]: round(v, 2) for k, v in st.items()} if self.handover_s else None
        return out
