"""Instances leaving and joining at an operator's word: drain and cordon flags (told again after a restart),
removal (drain, then stop), and adding one through the launcher."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from daemons import wire
from daemons.manager.launcher import Launcher, LaunchError
from daemons.manager.records import InstanceRecord, dead_after
from daemons.manager.shared import Shared

log = logging.getLogger("llumnix.manager")


class Lifecycle:
    """Owns ``retiring`` (the instances being removed or scaled in)."""

    def __init__(self, shared: Shared, launcher: Launcher, new_drain: Callable[[str], None]):
        """``new_drain(instance_id)``: an operator drains it anew (its drain orders start again at once,
        orders.py)."""
        self.cluster, self.clock, self.send = shared.cluster, shared.clock, shared.send
        self.mc, self.scfg = shared.cfg.manager, shared.cfg.scaling
        self.launcher = launcher
        self.new_drain = new_drain
        self.retiring: set[str] = set()

    def tell(self, r: InstanceRecord) -> None:
        """Say its drain and cordon flags to the instance (and whether another instance could take its queue)."""
        now = self.clock.monotonic()
        elsewhere = any(x is not r and self.cluster.state(x, now).dispatchable for x in self.cluster.records())
        self.send(r, wire.SetDraining(bool(r.drain_reason), r.drain_reason, r.cordoned, elsewhere))

    def on_drain(self, msg: wire.DrainQuery) -> wire.Message:
        r = self.cluster.get(msg.instance_id)
        if r is None:
            return wire.ErrorReply(msg.query_id, f"unknown instance {msg.instance_id!r} (see llumnixctl status)")
        if r.state == "dead":
            return wire.ErrorReply(msg.query_id, f"instance {msg.instance_id} is dead (see llumnixctl status)")
        verb = ("cordon" if msg.drain else "uncordon") if msg.cordon_only else ("drain" if msg.drain else "undrain")
        if msg.cordon_only:
            self.cluster.set_flags(r, cordoned=msg.drain)
        elif msg.drain:
            self.cluster.set_flags(r, drain_reason=r.drain_reason or "operator")
            self.new_drain(r.instance_id)  # a new drain tries at once
        else:
            if r.state == "stopping":
                return wire.ErrorReply(msg.query_id, f"instance {msg.instance_id} is stopping; it cannot be undrained")
            self.cluster.set_flags(r, drain_reason="")  # a remove or scale-in waiting on it gives up
        log.info("instance %s: %s (llumnixctl)", r.instance_id, verb)
        self.tell(r)
        now = self.clock.monotonic()
        return wire.DrainReply(msg.query_id, next(v for v in self.cluster.view(now) if v.instance_id == r.instance_id))

    async def on_remove(self, msg: wire.RemoveQuery) -> wire.Message:
        r = self.cluster.get(msg.instance_id)
        if r is None:
            return wire.ErrorReply(msg.query_id, f"unknown instance {msg.instance_id!r} (see llumnixctl status)")
        if r.state == "dead":
            self.cluster.forget(r, "removed by llumnixctl (it was dead)")
            return wire.RemoveReply(msg.query_id, msg.instance_id, 0.0, was_dead=True)
        outcome = await self.retire(msg.instance_id, "remove", msg.timeout_s)
        if isinstance(outcome, str):
            return wire.ErrorReply(msg.query_id, outcome)
        drained_s, migrated = outcome
        return wire.RemoveReply(msg.query_id, msg.instance_id, round(drained_s, 3), migrated)

    async def retire(self, instance_id: str, reason: str, timeout_s: float,
                     undrain_on_timeout: bool = False) -> tuple[float, int] | str:
        """Drain the instance until nothing is left on it, then tell it to stop and wait until it said
        goodbye. Returns (seconds drained, migrations out that committed) or why it did not happen."""
        r = self.cluster.instances[instance_id]
        if instance_id in self.retiring:
            return f"instance {instance_id} is already being removed"
        self.retiring.add(instance_id)
        try:
            start = self.clock.monotonic()
            committed0 = r.load.migrations_committed
            if r.drain_reason in ("", "operator"):
                self.cluster.set_flags(r, drain_reason=reason)
            self.tell(r)
            log.info("instance %s: draining for %s", instance_id, reason)
            poll = min(0.05, self.mc.heartbeat_interval_s / 4)
            while True:
                r = self.cluster.get(instance_id)
                if r is None or r.state == "dead":
                    return f"instance {instance_id} went away while draining"
                if not r.draining:
                    return f"instance {instance_id} was undrained before it was empty; not stopped"
                ld = r.load
                if ld.running == ld.waiting == ld.migrating_out == ld.migrating_in == 0 and not r.pending and not r.orders:
                    break
                if self.clock.monotonic() - start > timeout_s:
                    if undrain_on_timeout:
                        self.cluster.set_flags(r, drain_reason="")
                        self.tell(r)
                    return (f"instance {instance_id} still has {ld.running} running and {ld.waiting} queued requests "
                            f"after {timeout_s:g}s; " + ("it serves again" if undrain_on_timeout else
                                                         f"it stays draining (llumnixctl undrain {instance_id} to cancel)"))
                await self.clock.sleep(poll)
            drained_s = self.clock.monotonic() - start
            migrated = r.load.migrations_committed - committed0
            log.info("instance %s drained in %.2fs (%d migrations out); telling it to stop", instance_id, drained_s, migrated)
            self.send(r, wire.Shutdown(reason))
            deadline = self.clock.monotonic() + max(10.0, 4 * dead_after(self.mc))
            while self.clock.monotonic() < deadline:
                r = self.cluster.get(instance_id)
                if r is None or r.state != "alive":
                    return drained_s, migrated
                await self.clock.sleep(poll)
            return f"instance {instance_id} was drained but did not stop within {deadline - start - drained_s:.0f}s"
        finally:
            self.retiring.discard(instance_id)

    # ------------------------------------------------------------------ adding instances

    async def on_add(self, msg: wire.AddQuery) -> wire.Message:
        if not self.scfg.launcher.strip():
            return wire.ErrorReply(msg.query_id, "no launcher is configured: set scaling.launcher in the manager's "
                                                 "config (e.g. \"systemctl start llumnix-instance@{n}\")")
        count = max(1, msg.count)
        have = sum(r.state != "dead" for r in self.cluster.records()) + len(self.launcher.launches)
        if have + count > self.scfg.max_instances:
            return wire.ErrorReply(msg.query_id, f"adding {count} would make {have + count} instances ({have} running "
                                                 f"or starting); scaling.max_instances is {self.scfg.max_instances}: "
                                                 f"add fewer, or raise it in the manager's config")
        results = await asyncio.gather(*(self.launcher.launch(msg.timeout_s) for _ in range(count)),
                                       return_exceptions=True)
        ids = [x for x in results if isinstance(x, str)]
        errors = [str(x) for x in results if isinstance(x, LaunchError)]
        unexpected = [x for x in results if isinstance(x, BaseException) and not isinstance(x, LaunchError)]
        for exc in unexpected:
            log.error("launch failed unexpectedly: %r", exc)
            errors.append(f"internal error: {exc!r}")
        if errors:
            started = f" (started: {', '.join(ids)})" if ids else ""
            return wire.ErrorReply(msg.query_id, "; ".join(errors) + started)
        return wire.AddReply(msg.query_id, ids)
