"""Whether an instance is there: its connection watched (daemons/links.py), its reports timed. Slow is not
dead: a late instance whose connection is up stays in dispatch; one whose connection went down (its process
is gone, or its host unreachable) is marked dead, and the migrations from it fail."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Callable

import zmq
import zmq.asyncio

from daemons import runtime, security, wire
from daemons.clock import Clock
from daemons.config import ManagerConfig, SchedulingConfig
from daemons.links import DOWN, UP, LinkWatch
from daemons.manager.records import M_DEATHS, M_LATE, M_LINKS_HEALED, InstanceRecord, dead_after
from daemons.manager.view import ClusterView

log = logging.getLogger("llumnix.manager")


class Liveness:
    """Owns ``links`` (the connection watch) and each record's ``probe``, ``late`` and its state dead."""

    def __init__(self, cluster: ClusterView, clock: Clock, mc: ManagerConfig, sc: SchedulingConfig,
                 ctx: zmq.asyncio.Context, sec: security.Security, on_dead: Callable[[str], None],
                 send: Callable[[InstanceRecord, wire.Message], None] | None = None):
        """``ctx``, ``sec``: where the probe sockets are made, and their keys. ``on_dead(instance_id)``: an
        instance was marked dead (the migrations it was ordered fail at once). ``send``: a message to an
        instance (the others hear of a death by it: wire.PeerDead)."""
        self.cluster = cluster
        self.clock = clock
        self.mc = mc
        self.sc = sc
        self.ctx = ctx
        self.sec = sec
        self.on_dead = on_dead
        self.send = send
        self.links = LinkWatch(mc.link_timeout_s, self.link_changed, lambda _: M_LINKS_HEALED.inc(), clock)
        cluster.on_forget(self.unwatch)
        cluster.on_forget(self.forgotten)

    def dead_after(self) -> float:
        return dead_after(self.mc)

    def watch(self, rec: InstanceRecord, old: InstanceRecord | None) -> None:
        """Watch the connection to ``rec``'s request socket (daemons/links.py): kept from ``old`` when the
        address is the same, else made anew. An address we cannot connect to is left unwatched (UNKNOWN)."""
        address = rec.info.request_address
        if old is not None and old.probe is not None:
            if old.info.request_address == address and not old.probe.closed:
                rec.probe = old.probe
                return
            self.unwatch(old)
        if not address.startswith(("tcp://", "ipc://")):  # the simulator's instances have no socket
            return
        sock = self.links.prepare(runtime.tune(self.ctx.socket(zmq.DEALER)))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        try:
            self.sec.client(sock, "instance")
            self.links.watch(rec.instance_id, sock)  # before the connect: its handshake must not go unseen
            sock.connect(address)
        except (zmq.ZMQError, runtime.StartupError, RuntimeError) as exc:  # RuntimeError: no event loop
            log.warning("cannot watch the connection to instance %s at %r (%s): it is marked dead after "
                        "manager.dead_after_missed missed heartbeats", rec.instance_id, address, exc)
            self.links.forget(rec.instance_id)
            sock.close(0)
            return
        rec.probe = sock

    def unwatch(self, rec: InstanceRecord) -> None:
        if rec.probe is not None:
            self.links.forget(rec.instance_id)
            rec.probe.close(0)
            rec.probe = None

    def link_changed(self, instance_id: str, state: str) -> None:
        rec = self.cluster.get(instance_id)
        if rec is None or state != DOWN:
            return
        if rec.state == "alive":
            self.mark_dead(rec, "its connection went down (process gone or host unreachable)")
        elif rec.state == "stopping":
            self.cluster.forget(rec, "it stopped (connection closed)")

    def mark_dead(self, rec: InstanceRecord, why: str) -> None:
        rec.state = "dead"
        rec.pending.clear()
        self.on_dead(rec.instance_id)
        M_DEATHS.inc()
        log.warning("instance %s marked dead: %s", rec.instance_id, why)
        self.cluster.update_gauges(rec)
        self.tell_dead(rec)

    def forgotten(self, rec: InstanceRecord) -> None:
        """An instance that stopped (or was removed) is gone too: what the others keep for it (a socket, KV pairs
        made ahead of handovers) goes. One marked dead was told then."""
        if rec.state != "dead":
            self.tell_dead(rec)

    def tell_dead(self, rec: InstanceRecord) -> None:
        """Every other instance hears of it at once (wire.PeerDead): a reservation for a move from it, a request
        suspended for a move to it, its sockets and KV pairs are let go now, not after their timeouts."""
        if self.send is None:
            return
        msg = wire.PeerDead(rec.instance_id, rec.info.request_address)
        for r in self.cluster.records():
            if r is not rec and r.state != "dead":
                self.send(r, msg)

    async def watch_heartbeats(self, stop: asyncio.Event) -> None:
        period = self.mc.heartbeat_interval_s / 2
        while not stop.is_set():
            before = self.clock.monotonic()
            await self.clock.sleep(period)
            now = self.clock.monotonic()
            if now - before > 2 * period:
                # We were stalled (no CPU, swapped out): reports may be waiting unread in the socket. Judge
                # nobody on a stale view; read them first.
                log.warning("manager stalled for %.2fs; re-checking heartbeats after reading reports", now - before)
                continue
            self.check_heartbeats(now)

    def check_heartbeats(self, now: float) -> None:
        """Judge each instance by the time since its last report (and its connection): late, dead, forgotten."""
        for r in list(self.cluster.records()):
            silent = now - r.last_seen
            if r.state == "stopping" and silent > self.dead_after() and self.links.state(r.instance_id) != UP:
                self.cluster.forget(r, "it stopped")
            elif r.state == "dead" and silent > self.mc.dead_instance_ttl_s:
                self.cluster.forget(r, f"dead for over {self.mc.dead_instance_ttl_s:g}s")
            elif r.state == "alive" and silent > self.dead_after():
                self._silent(r, silent)
            elif r.late and silent <= self.dead_after():
                r.late = False
                log.info("instance %s reports again (it was late)", r.instance_id)
            if r.state == "alive" and r.credit0 and not math.isclose(r.credit(now, self.sc.new_instance_credit_s), 0.0):
                self.cluster.update_gauges(r, now)  # the credit fades between reports too

    def _silent(self, r: InstanceRecord, silent: float) -> None:
        """No report for over dead_after_missed heartbeats. Slow is not dead: with its connection up (its
        process is there; a busy host delays reports, not keepalives) it is only late, and stays in dispatch
        until manager.silent_dead_s; with a connection we cannot watch, silence is all we have."""
        link = self.links.state(r.instance_id)
        if link == UP and silent <= self.mc.silent_dead_s:
            if not r.late:
                r.late = True
                M_LATE.inc()
                log.info("instance %s has not reported for %.2fs, but its connection is up: late, not dead",
                         r.instance_id, silent)
            return
        why = (f"connection up, but no report for {silent:.1f}s (manager.silent_dead_s)" if link == UP else
               f"no report for {silent:.2f}s ({self.mc.dead_after_missed} heartbeats) and its connection is "
               f"{'down' if link == DOWN else 'not watched'}")
        self.mark_dead(r, why)
