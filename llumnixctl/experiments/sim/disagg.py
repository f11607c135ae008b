"""Prefill/decode disaggregation in the simulator (llumnixctl/experiments/sim/simulate.py), on the daemons' own
policy code (daemons/policy/disagg.py):

- roles: each simulated instance has one (``mixed``, ``prefill``, ``decode``), held by its ``Standing`` as the
  daemon's, so its load reports carry it and the manager's and the proxy's states see it;
- dispatch: the manager's dispatcher decides with roles itself (``disagg.decide``, its reply says which way,
  counted here); the proxy's own dispatch (proxy.dispatch = local) takes the pool ``policy.pool_for`` picks (the
  first half of every dispatcher's ``policy.place``) and the dispatch policy picks within it; the decisions are
  counted by kind;
- handover: everything is the daemons'. A prefill instance's ``Handovers`` (daemons/instance/handover.py, after
  each step of its ``StepLoop``) offers a request with a token here to the manager (``HandoverReady``: one
  report lag), whose ``Roles.on_handover`` (daemons/manager/roles.py) chooses the decode instance (caps on
  sources per destination, handovers in flight counted, ``disagg.handover_precopy``) and orders the move
  (``MigrateStart``: one message late) to the instance's own ``Orders``, whose migrator moves it
  (sim/llumlet.py, sim/migrate.py): its KV copy lasts its bytes at ``--kv-gbps``. With no destination it keeps
  decoding where it is and is offered again after ``disagg.handover_lease_s``; requests decoding on an
  instance that became a prefill instance are offered (reason ``role``); balance pairing leaves prefill
  instances out (the manager's plan);
- adaptive roles (``disagg.adaptive``): the manager's ``Roles.loop`` (``adapt_once``) changes roles, told to the
  instances by ``SetRole`` as the daemon does.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Mapping, Protocol

from daemons import wire
from daemons.policy import disagg, slo
from daemons.policy.dispatch import Ask, pool_for, rules_of
from llumnixctl.experiments.sim.result import stats_of


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

    def observe(self, fn: Callable) -> None: ...


class SimRoles:
    """Owns the instances' initial roles and the figures: ``decisions`` (by kind), handovers (outcomes, offers the
    manager found no destination for, and the time from the first token to the commit on the decode instance),
    role changes. Every decision is the daemons': the instances' ``Handovers`` offer, the manager's ``Roles``
    chooses the destination (``on_handover``), changes roles (``adapt_once``, in its own ``loop``) and gives a
    launched instance the short role (``launched``); the proxy's pool is ``disagg.decide``'s, the manager's
    dispatcher decides its own. Receives the settings, the initial roles (None: all mixed) and the simulation
    (``Site``)."""

    def __init__(self, cfg, roles: list[str] | None, site: Site) -> None:
        self.cfg, self.initial, self.site = cfg, list(roles or []), site
        self.classes = slo.Classes(cfg.slo)
        self.rules = rules_of(cfg)
        self.adaptive = cfg.disagg.adaptive
        self.adapt_rules = disagg.adapt_rules_of(cfg.disagg, cfg.slo)
        self.decisions: Counter = Counter()
        self.handovers: Counter = Counter()
        self.handover_s: list[float] = []
        self.changes: list[dict] = []
        self.roles = None  # the manager's Roles (set by start)

    @property
    def on(self) -> bool:
        return any(r != "mixed" for r in self.initial) or any(
            i.standing.role != "mixed" for i in self.site.instances.values())

    def start(self, mgr) -> list:
        """The manager is there: its ``Roles`` is watched for the figures; the coroutines to run (its adaptive
        rule's loop, with ``disagg.adaptive``)."""
        self.roles = roles = mgr.resched.roles
        self.site.observe(lambda kind, _, d: kind == "migration" and self.migrated(d["request"], d["reason"],
                                                                                d["outcome"]))
        on_handover, adapt_once = roles.on_handover, roles.adapt_once

        def offered(msg: wire.HandoverReady) -> None:
            before = msg.request_id in roles.handing
            on_handover(msg)
            if not before and msg.request_id not in roles.handing:
                self.handovers[f"{msg.reason}/no_destination"] += 1

        def adapted():
            now = self.site.now
            change = adapt_once()
            inst = self.site.instances.get(change.instance_id) if change is not None else None
            if inst is not None:
                self.changes.append({"t": round(now, 3), "instance": change.instance_id, "from": inst.standing.role,
                                     "to": change.role, "reason": change.reason})
            return change

        roles.on_handover, roles.adapt_once = offered, adapted  # (the manager's own loop and handlers call them)
        return [roles.loop()] if self.adaptive and self.adapt_rules.on else []

    def role_of(self, index: int) -> str:
        """The role instance number ``index`` starts in: the one given for it, else mixed (an instance added later,
        by auto-scaling, is given the short role by the manager when it registers: ``launched``)."""
        return self.initial[index] if index < len(self.initial) else "mixed"

    def launched(self, rec) -> None:
        """An instance auto-scaling added registered: while roles are in use, the manager gives it one."""
        if self.on:
            self.roles.launched(rec)

    # ------------------------------------------------------------------ dispatch

    def exclude(self, dispatcher, prompt_tokens: int, priority: int, exclude: tuple) -> tuple:
        """(The proxy's own dispatch) Where a new request may go: ``exclude`` plus, while roles are in use, the
        instances outside the pool ``disagg.decide`` picks (counted by decision) from the states the proxy's
        view reads."""
        if not self.on:
            return exclude
        states = dispatcher.states(self.site.now)
        if not disagg.active(states):
            return exclude
        d = pool_for([s for s in states if s.instance_id not in exclude],
                     Ask(prompt_tokens, priority, self.classes.of(priority)), self.rules)
        if d is None:
            return exclude
        self.decided(d.decision)
        if not d.pool:
            return exclude
        pool = {s.instance_id for s in d.pool}
        return tuple(exclude) + tuple(s.instance_id for s in states if s.instance_id not in pool)

    def decided(self, decision: str) -> None:
        """A dispatch's disaggregation decision (the proxy's, or the manager's in its reply)."""
        if decision:
            self.decisions[decision] += 1

    # ------------------------------------------------------------------ handovers

    def migrated(self, request: str, reason: str, outcome: str) -> None:
        """A migration ended (the "migration" observers' event): handovers are counted, and timed."""
        if reason not in ("handover", "role"):
            return
        self.handovers[f"{reason}/{outcome}"] += 1
        req = self.site.requests[request]
        if outcome == "committed" and reason == "handover" and req.first >= 0:
            self.handover_s.append(self.site.now - req.first)

    # ------------------------------------------------------------------ figures

    def figures(self) -> dict:
        if not self.on and not self.decisions:
            return {}
        final = Counter(i.standing.role for i in self.site.instances.values() if i.gone is None)
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
