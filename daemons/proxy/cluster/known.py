"""What a proxy knows of the instances, and the one owner of it: the manager's last snapshot (membership,
flags, the dispatch policy, our rank among the proxies) and the instances' own word (heartbeats, the last
time each was heard from, its request address, the CURVE key that may speak for it). Its verbs judge
liveness (``dead``, ``alive``, ``manager_ok``); the other parts of the cluster client read it and never
write it (daemons/proxy/cluster/client.py)."""

from __future__ import annotations

import logging
from typing import Callable

import msgspec

from daemons import policy, wire
from daemons.clock import Clock
from daemons.links import DOWN
from daemons.proxy.cluster.telemetry import M_FORGED, TIE_TURN_S
from daemons.throttle import Throttle

log = logging.getLogger("llumnix.proxy")


class KnownInstances:
    """Receives the clock, the proxy's timeouts and ``link_state`` (an instance's connection by request
    address: daemons/links.py, "up", "down" or "unknown")."""

    def __init__(self, clock: Clock, instance_timeout_s: float, snapshot_interval_s: float,
                 link_state: Callable[[str], str]):
        self.clock = clock
        self.instance_timeout_s = instance_timeout_s
        self.snapshot_interval_s = snapshot_interval_s
        self.link_state = link_state
        self.snapshot: list[wire.InstanceView] = []
        self.snapshot_at = 0.0  # monotonic time of the last snapshot from the manager
        # Our own view of the instances, from their heartbeats: it outlives the manager.
        self.heard: dict[str, float] = {}  # instance id -> monotonic time of its last heartbeat or tokens
        self.beats: dict[str, wire.Heartbeat] = {}  # instance id -> its last heartbeat
        self.beat_at: dict[str, float] = {}  # instance id -> monotonic time of its last heartbeat
        self.addresses: dict[str, str] = {}  # instance id -> request address
        self.owner_keys: dict[str, str] = {}  # instance id -> "role:name" of its CURVE key (from_owner)
        self.dispatch_policy = policy.DISPATCH.default.name  # the manager's, from its snapshots: our fallback dispatches the same way
        self.rank, self.proxies = 0, 1  # our place among the proxies the manager hears from (see tie_start)
        # The LoRA adapters the cluster serves, name -> path: lora.adapters until the manager's snapshots say.
        self.adapters: dict[str, str] = {}
        self._forged_logged = Throttle(60.0)

    # ------------------------------------------------------------------ what we hear

    def took_snapshot(self, msg: wire.Snapshot) -> None:
        self.snapshot, self.snapshot_at = msg.instances, self.clock.monotonic()
        for v in msg.instances:  # the manager pinned each id to the key it registered with
            if v.key and v.state != "dead":
                self.owner_keys[v.instance_id] = v.key
            self.addresses[v.instance_id] = v.request_address
        self.rank, self.proxies = msg.proxy_rank, msg.proxies
        self.adapters = dict(msg.adapters)
        if msg.dispatch_policy in policy.DISPATCH:
            self.dispatch_policy = msg.dispatch_policy

    def heard_beat(self, beat: wire.Heartbeat) -> wire.Heartbeat | None:
        """A heartbeat; returns the one it replaces."""
        iid = beat.instance_id
        self.heard[iid] = self.beat_at[iid] = self.clock.monotonic()
        before = self.beats.get(iid)
        self.beats[iid] = beat
        self.addresses[iid] = beat.request_address
        return before

    def heard_tokens(self, instance_id: str) -> float:
        """Tokens from ``instance_id``: it lives. Returns the time."""
        self.heard[instance_id] = now = self.clock.monotonic()
        return now

    def set_address(self, instance_id: str, address: str) -> None:
        """An instance's request address, as a dispatch reply or an ownership claim gives it."""
        self.addresses[instance_id] = address

    def forget(self, instance_id: str) -> None:
        for table in (self.heard, self.beats, self.beat_at, self.addresses, self.owner_keys):
            table.pop(instance_id, None)

    def from_owner(self, instance_id: str, key: str) -> bool:
        """Whether ``key`` ("role:name" of the sender's CURVE key) may speak for ``instance_id``: the key the
        manager pinned that id to at registration (its snapshots), else the first key heard for it here (an
        instance newer than our snapshot; the next snapshot corrects a wrong first guess)."""
        pinned = self.owner_keys.get(instance_id)
        if pinned is None:
            self.owner_keys[instance_id] = key
            return True
        if pinned == key:
            return True
        M_FORGED.inc()
        if self._forged_logged.due((instance_id, key), self.clock.monotonic()):
            log.warning("dropped messages of instance %s from key %s: it registered with key %s", instance_id,
                        key.split(":", 1)[-1] or "(none)", pinned.split(":", 1)[-1])
        return False

    # ------------------------------------------------------------------ what we conclude

    def manager_ok(self) -> bool:
        return self.clock.monotonic() - self.snapshot_at < max(3 * self.snapshot_interval_s, 1.0)

    def address(self, instance_id: str) -> str:
        return self.addresses.get(instance_id, "")

    def states(self) -> dict[str, str]:
        """Instance id -> its state in the manager's last snapshot."""
        return {v.instance_id: v.state for v in self.snapshot}

    def dead(self, instance_id: str, since: float = 0.0) -> bool:
        """Its connection went down (daemons/links.py). An instance whose connection is up is alive however
        late its heartbeats; one whose connection never came up is judged by silence: not heard from for
        proxy.instance_timeout_s (counting from ``since`` if later: a dispatch)."""
        link = self.link_state(self.addresses.get(instance_id, ""))
        if link != "unknown":
            return link == DOWN
        last = max(self.heard.get(instance_id, 0.0), since)
        return last > 0 and self.clock.monotonic() - last > self.instance_timeout_s

    def serving(self):
        """(instance id, heartbeat) of each instance whose heartbeat says it takes requests and that is not
        dead: what admission and the fair gate measure room on."""
        for iid, beat in self.beats.items():
            if beat.load is None or not beat.accepting or not beat.healthy or self.dead(iid):
                continue
            yield iid, beat

    def alive(self) -> list[wire.InstanceView]:
        """Instances that take requests: the manager's view, less those our own view says are dead or
        unhealthy, with the load of their latest heartbeat when it is newer."""
        out = []
        for v in self.snapshot:
            beat = self.beats.get(v.instance_id)
            # A drain or cordon (or their end) reaches the instance first: its heartbeat, if newer than the
            # snapshot, says whether it takes requests.
            flagged = (v.draining or v.cordoned) and not (beat is not None and self.beat_at.get(v.instance_id, 0.0)
                                                          > self.snapshot_at and beat.accepting)
            if v.state != "alive" or flagged or self.dead(v.instance_id):
                continue
            if beat is not None and beat.load is not None:
                if not beat.healthy or not beat.accepting:
                    continue
                v = msgspec.structs.replace(v, load=beat.load)
            out.append(v)
        # Instances the manager does not show (it restarted and they have not registered again yet) but that
        # we hear from.
        known = {v.instance_id for v in self.snapshot}
        now = self.clock.monotonic()
        for iid, beat in self.beats.items():
            if (iid not in known and beat.load is not None and beat.healthy and beat.accepting
                    and now - self.heard.get(iid, 0.0) < self.instance_timeout_s):
                out.append(wire.InstanceView(iid, "", 0, "alive", beat.request_address, "", "", beat.load, 0.0, 0.0))
        return out

    def heard_within(self, instance_id: str, seconds: float) -> bool:
        return self.clock.monotonic() - self.heard.get(instance_id, 0.0) < seconds

    def departed(self, now: float, after_s: float) -> list[str]:
        """Instances not live in the manager's view and not heard from for ``after_s``."""
        live = {v.instance_id for v in self.snapshot if v.state != "dead"}
        return [i for i, at in self.heard.items() if i not in live and now - at > after_s]

    def live_addresses(self) -> set[str]:
        """The request addresses of the instances live in the snapshot or still heard from."""
        return ({v.request_address for v in self.snapshot if v.state != "dead"}
                | {self.addresses[i] for i in self.heard if i in self.addresses})

    def block_size(self) -> int:
        """The instances' KV block size from the snapshot (0: none known yet)."""
        return next((v.load.block_size for v in self.snapshot if v.load.block_size), 0)

    def tie_start(self) -> float:
        """Where our ties start among the instances: the proxies' starts are evenly spaced by their ranks, and
        all move on together every TIE_TURN_S (wall clock), so that over time no instance is always the first
        tie; seldom enough that a burst almost never straddles a turn (its proxies would start anew)."""
        return (self.clock.time() // TIE_TURN_S * 0.618034 + self.rank / max(self.proxies, 1)) % 1.0
