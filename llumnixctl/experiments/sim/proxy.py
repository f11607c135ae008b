"""The simulator's proxy with ``proxy.dispatch = local`` (the default; llumnixctl/experiments/sim/simulate.py): it
chooses each new request's instance itself, with the proxy's own ``DispatchView`` (daemons/proxy/view.py:
the cluster's dispatch policy over the instances' streamed loads and its own dispatches they do not show
yet), and tells the manager afterwards. Its inputs come as a proxy's do: the manager's snapshots (asked for
every ``proxy.snapshot_interval_s``, answered a round trip later) and the instances' heartbeats (with each
load report, a report lag later). Before its first snapshot, or when its view has no instance for a request,
it asks the manager, as the proxy does.

Not modelled: the proxy's own prefix index (``llumnix-cache`` asks the manager for every request here),
several proxies, the liveness of connections (simulated instances do not fail).
"""

from __future__ import annotations

from typing import Callable

import msgspec

from daemons import policy, wire
from daemons.clock import Clock
from daemons.config import Config
from daemons.proxy.telemetry import TIE_TURN_S
from daemons.proxy.view import DispatchView


class SimProxy:
    """Owns its view of the cluster: the last snapshot, the instances' last heartbeats, the dispatch view."""

    def __init__(self, cfg: Config, clock: Clock) -> None:
        self.clock = clock
        self.headroom = cfg.scheduling.high_priority_headroom
        self.interval_s = cfg.proxy.snapshot_interval_s
        self.view = DispatchView(cfg.manager.pending_dispatch_ttl_s, self.headroom, clock.monotonic)
        self.snapshot: list[wire.InstanceView] = []
        self.policy = cfg.manager.dispatch_policy
        self.rank, self.proxies = 0, 1
        self.beats: dict[str, wire.Heartbeat] = {}
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
        """It has a snapshot, and its policy is one it applies itself."""
        return bool(self.snapshot) and self.policy != "llumnix-cache"

    # ------------------------------------------------------------------ inputs

    def on_snapshot(self, snap: wire.Snapshot) -> None:
        self.snapshot = list(snap.instances)
        self.policy = snap.dispatch_policy
        self.rank, self.proxies = snap.proxy_rank, snap.proxies
        self.view.invalidate()

    def on_heartbeat(self, beat: wire.Heartbeat) -> None:
        self.view.heard(beat, self.beats.get(beat.instance_id))
        self.beats[beat.instance_id] = beat

    def alive(self) -> list[wire.InstanceView]:
        """The instances that take requests: the snapshot's, with the load of their latest heartbeat."""
        out = []
        for v in self.snapshot:
            beat = self.beats.get(v.instance_id)
            if v.state != "alive" or v.draining or v.cordoned:
                continue
            if beat is not None and beat.load is not None:
                if not beat.healthy or not beat.accepting:
                    continue
                v = msgspec.structs.replace(v, load=beat.load)
            out.append(v)
        return out

    # ------------------------------------------------------------------ the dispatch

    def choose(self, priority: int, exclude: tuple = ()) -> str | None:
        """The instance for a new request (None: the view has none; ask the manager)."""
        self.turn += 1
        start = (self.clock.time() // TIE_TURN_S * 0.618034 + self.rank / max(self.proxies, 1)) % 1.0
        if not exclude:
            return self.view.choose(self.alive, self.policy, priority, self.turn, start)
        now = self.clock.monotonic()
        states = [self.view.state_of(v, v.load, now) for v in self.alive() if v.instance_id not in exclude]
        return policy.dispatch(self.policy, states, self.turn, self.headroom, priority, start=start)

    def sent(self, instance_id: str, tokens: int) -> None:
        """A request of ``tokens`` went to ``instance_id``: its load until a heartbeat shows it."""
        beat = self.beats.get(instance_id)
        self.view.sent_to(instance_id, beat.load if beat is not None else None, tokens)

