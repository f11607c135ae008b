"""Liveness by progress, and the faults tests inject.

``Watchdog`` runs on a thread of its own, so it keeps judging while an engine step or the event loop is
stuck. The instance is *stalled* while a step has run longer than ``instance.step_timeout_s`` or its event
loop has not ticked for that long. While it is not stalled the watchdog sends systemd ``WATCHDOG=1`` (the
units set ``WatchdogSec``); once stalled it stops, the instance reports itself unhealthy (proxies fail its
streams over, the manager dispatches nothing to it), and if it is still stalled ``instance.hung_exit_s``
later the process exits non-zero so that ``Restart=on-failure`` brings it back: a wedged GPU does not
recover by waiting.

On a clock that is not real (a virtual-time loop in tests/support) time moves only while the loop has
nothing to do, so a thread would judge nothing: the watchdog judges from a task on that loop instead, and
what a hung instance does (``on_hung``, exiting by default) can be replaced there.

``Faults`` reads ``$LLUMNIX_FAULTS``, which only tests set: ``name=value`` pairs separated by ``;``, each
optionally scoped to one instance as ``ID:name=value`` (for example ``i1:slow_commit_s=3;i0:hang_step_after=40``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Callable

from daemons import runtime
from daemons.clock import Clock

log = logging.getLogger("llumnix.instance")

EXIT_HUNG = 3  # the exit status of an instance whose engine stopped making progress


def exit_hung() -> None:
    """What a hung instance does: exit with EXIT_HUNG at once (the engine thread may never return)."""
    logging.shutdown()
    os._exit(EXIT_HUNG)


class Watchdog:
    def __init__(self, step_timeout_s: float, hung_exit_s: float, clock: Clock | None = None,
                 on_hung: Callable[[], None] = exit_hung):
        self.step_timeout_s = step_timeout_s
        self.hung_exit_s = hung_exit_s
        self.clock = clock or Clock()
        self.on_hung = on_hung
        self.step_started = 0.0  # start of the step in flight on ``clock`` (0: none): ``step_began``
        self.loop_beat = self.clock.monotonic()  # the event loop's last tick: ``loop_ticked``
        self.stalled = ""  # why, while stalled
        self._stalled_since = 0.0
        self._stop = threading.Event()
        usec = os.environ.get("WATCHDOG_USEC", "")
        self._notify_every = int(usec) / 2e6 if usec.isdigit() and int(usec) > 0 else 0.0
        self.tick_s = min(1.0, self.step_timeout_s / 4, *([self._notify_every] if self._notify_every else []))
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._task: asyncio.Task | None = None

    def now(self) -> float:
        return self.clock.monotonic()

    def step_began(self, at: float) -> None:
        """(The step loop, on any thread) An engine step started at ``at`` (on ``clock``)."""
        self.step_started = at

    def step_ended(self) -> None:
        self.step_started = 0.0

    def loop_ticked(self, at: float) -> None:
        """(The event loop) It ran at ``at``."""
        self.loop_beat = at

    def start(self) -> None:
        """Judge every ``tick_s``: on a thread of its own (a real clock), or from a task on the running loop."""
        if self.clock.real:
            self._thread.start()
        else:
            self._task = asyncio.get_running_loop().create_task(self._judge_on_loop())

    def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()

    async def _judge_on_loop(self) -> None:
        while not self._stop.is_set():
            await self.clock.sleep(self.tick_s)
            self.judge()

    def check(self, now: float) -> str:
        started = self.step_started
        if started and now - started > self.step_timeout_s:
            return f"an engine step has run for {now - started:.1f}s (instance.step_timeout_s = {self.step_timeout_s:g})"
        if now - self.loop_beat > self.step_timeout_s:
            return f"the event loop has not run for {now - self.loop_beat:.1f}s (instance.step_timeout_s = {self.step_timeout_s:g})"
        return ""

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            self.judge()

    def judge(self) -> None:
        """One look: healthy (feed systemd's watchdog), stalled (say why), or hung for ``hung_exit_s`` (``on_hung``)."""
        now = self.now()
        reason = self.check(now)
        if not reason:
            if self.stalled:
                log.warning("making progress again")
            self.stalled, self._stalled_since = "", 0.0
            runtime.sd_notify("WATCHDOG=1")
            return
        if not self.stalled:
            self._stalled_since = now
            log.error("unhealthy: %s; its streams fail over, no new requests come", reason)
        self.stalled = reason
        if now - self._stalled_since >= self.hung_exit_s:
            log.critical("still no progress %.1fs later (instance.hung_exit_s): exiting with status %d so that "
                         "the service manager restarts the instance", now - self._stalled_since, EXIT_HUNG)
            self._stop.set()
            self.on_hung()


class Faults:
    """Faults injected by tests (never set in production)."""

    def __init__(self, instance_id: str, spec: str | None = None):
        self.values: dict[str, float] = {}
        spec = os.environ.get("LLUMNIX_FAULTS", "") if spec is None else spec
        for item in filter(None, (x.strip() for x in spec.split(";"))):
            scope, _, pair = item.rpartition(":")
            if scope and scope != instance_id:
                continue
            name, _, value = pair.partition("=")
            self.values[name.strip()] = float(value or 1)
        if self.values:
            log.warning("fault injection on: %s", self.values)

    def get(self, name: str) -> float:
        return self.values.get(name, 0.0)
