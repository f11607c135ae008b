"""The simulator's proxy with ``proxy.dispatch = local`` (the default; llumnixctl/experiments/sim/simulate.py): it
chooses each new request's instance itself, with the proxy's own ``DispatchView`` (daemons/proxy/cluster/view.py:
the cluster's dispatch policy over the instances' streamed loads and its own dispatches they do not show
yet), and tells the manager afterwards. Its inputs come as a proxy's do: the manager's snapshots (asked for
every ``proxy.snapshot_interval_s``, answered a round trip later) and the instances' heartbeats (with each
load report, a report lag later). Before its first snapshot, or when its view has no instance for a request,
it asks the manager, as the proxy does.

What it knows of the instances is the proxy's own ``KnownInstances`` (daemons/proxy/cluster/known.py): which take
requests, with which load, judged as the proxy judges them (with no connections to watch, by silence).

With an SLO ([slo] TTFT targets) it admits each new request as the proxy does, with the proxy's own
``Admission`` (daemons/proxy/cluster/admission.py: ``daemons.policy.admit.admit`` over the heartbeats' loads plus our
dispatches they do not show yet), whatever proxy.dispatch is; and at each request's first dispatch it takes the
proxy's prediction of its TTFT and TPOT there (``DispatchView.predict``), for the prediction error.

Not modelled: the proxy's own prefix index (``llumnix-cache`` asks the manager for every request here),
several proxies, connections (simulated instances do not fail).
"""

from __future__ import annotations

import math
from typing import Callable

from daemons import policy, wire
from daemons.clock import Clock
from daemons.config import Config
from daemons.policy import admit as slo_admit, slo
from daemons.proxy.cluster.admission import Admission, Placing
from daemons.proxy.cluster.known import KnownInstances
from daemons.proxy.cluster.stream import Overloaded
from daemons.proxy.cluster.view import DispatchView


class SimProxy:
    """Owns its view of the cluster: what it knows of the instances (the proxy's ``KnownInstances``), the
    dispatch view and the admission (the proxy's own; nothing waits to be placed here)."""

    def __init__(self, cfg: Config, clock: Clock) -> None:
        self.clock = clock
        self.headroom = cfg.scheduling.high_priority_headroom
        self.interval_s = cfg.proxy.snapshot_interval_s
        self.local = cfg.proxy.dispatch == "local"  # it chooses instances itself (else the manager does)
        self.view = DispatchView(cfg.manager.pending_dispatch_ttl_s, policy.rules_of(cfg), clock.monotonic)  # as the proxy's
        self.classes = slo.Classes(cfg.slo)  # each request's SLO class and targets, where it comes in
        self.known = KnownInstances(clock, cfg.proxy.instance_timeout_s, self.interval_s, lambda address: "unknown")
        self.known.dispatch_policy = cfg.manager.dispatch_policy
        self.placing = Placing(clock.monotonic)  # admitted, not yet dispatched
        self.admission = Admission(cfg.admission, clock, self.known, self.view, self.placing, lambda tenant: False,
                                   cfg.slo, self.classes)
        self.turn = 0

    def start(self, snapshot: Callable[[], wire.Snapshot], rtt_s: float, at: Callable, going: Callable[[], bool]) -> None:
        """Ask for a ``snapshot()`` every proxy.snapshot_interval_s (``at(t, fn, *args)`` schedules) while
        ``going()``; each answer comes ``rtt_s`` later."""

        def poll() -> None:
            now = self.clock.monotonic()
            at(now + rtt_s, self.on_snapshot, snapshot())
            if going():
                at(now + self.interval_s, poll)

        at(self.clock.monotonic(), poll)

    def ready(self) -> bool:
        """It chooses instances itself (proxy.dispatch = local), has a snapshot, and its policy is one it applies
        itself."""
        return (self.local and bool(self.known.snapshot)
                and not policy.DISPATCH.get(self.known.dispatch_policy).cache_affinity)

    @property
    def by_slo(self) -> bool:
        """Admission by SLO is on (a TTFT target)."""
        return self.admission.by_slo

    def admit(self, priority: int, prompt_tokens: int, max_tokens: int = 0, request_id: str = "") -> slo_admit.Verdict | None:
        """The proxy's admission of a new request (by SLO): its verdict, refused or not (None: nothing to
        predict from yet, admitted)."""
        try:
            return self.admission.admit(self.classes.of(priority), "", prompt_tokens, max_tokens, 1, request_id)
        except Overloaded as exc:
            return slo_admit.Verdict(False, math.inf, exc.retry_after_s, exc.reason)

    # ------------------------------------------------------------------ inputs

    def on_snapshot(self, snap: wire.Snapshot) -> None:
        self.known.took_snapshot(snap)
        self.view.invalidate()

    def on_heartbeat(self, beat: wire.Heartbeat) -> None:
        self.view.heard(beat, self.known.heard_beat(beat))

    # ------------------------------------------------------------------ the dispatch

    def choose(self, priority: int, exclude: tuple = (), prompt_tokens: int = 0, adapter: str = "") -> str | None:
        """The instance for a new request (None: the view has none; ask the manager): the proxy's own
        ``DispatchView.choose`` (``policy.place`` over its view)."""
        self.turn += 1
        ask = policy.Ask(prompt_tokens, priority, self.classes.of(priority), adapter=adapter)
        return self.view.choose(self.known.alive, self.known.dispatch_policy, ask, self.turn, self.known.tie_start(),
                                exclude)

    def states(self, now: float) -> list:
        """The instances it would dispatch among, as its dispatch view sees them at ``now``."""
        return [self.view.state_of(v, v.load, now) for v in self.known.alive()]

    def predict(self, instance_id: str, tokens: int, priority: int, max_tokens: int = 0) -> tuple[float, float] | None:
        """(TTFT, TPOT) the proxy predicts for a request placed on ``instance_id`` now (None: no model yet)."""
        beat = self.known.beats.get(instance_id)
        if beat is None or beat.load is None or beat.load.latency is None:
            return None
        return self.view.predict(instance_id, beat.load, tokens, self.classes.of(priority).high, max_tokens)

    def sent(self, instance_id: str, tokens: int, max_tokens: int = 0, request_id: str = "") -> None:
        """A request of ``tokens`` (that may generate ``max_tokens``) went to ``instance_id``: its load until a
        heartbeat shows it (and no longer as admitted here, not placed)."""
        self.placing.discard(request_id)
        beat = self.known.beats.get(instance_id)
        self.view.sent_to(instance_id, beat.load if beat is not None else None, tokens, max_tokens)

