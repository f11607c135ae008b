"""The step-boundary mailbox: calls that must run while no engine step is in flight (migration verbs,
listings, drain give-backs), whether a step is in flight, and the event that wakes the step loop."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from daemons.engine.base import EngineError
from daemons.kv.transfer import TransferError

log = logging.getLogger("llumnix.instance")


class Mailbox:
    """Owned by the step loop's side (it opens and closes steps: ``begin_step``, ``end_step``, and runs
    what waits, ``run``); every other part posts with ``call`` and wakes the loop with ``wake``."""

    def __init__(self) -> None:
        self.wake = asyncio.Event()  # set: the step loop looks again (work came, the load changed)
        self._calls: list[tuple[Callable, asyncio.Future]] = []
        self._stepping = False  # an engine step is in flight (on the engine thread, or waiting out model time)
        self._on_thread = False  # ... and it runs on the engine thread: the engine may not be read meanwhile

    @property
    def stepping(self) -> bool:
        return self._stepping

    @property
    def engine_busy(self) -> bool:
        """The engine thread is in a step: nothing else may touch the engine now."""
        return self._stepping and self._on_thread

    def begin_step(self, on_thread: bool) -> None:
        self._stepping, self._on_thread = True, on_thread

    def end_step(self) -> None:
        self._stepping = self._on_thread = False

    def waiting(self) -> bool:
        """(Any thread) Calls wait for the boundary. Reads only."""
        return bool(self._calls)

    def call(self, fn: Callable) -> asyncio.Future:
        """Run ``fn()`` at a step boundary (no engine step in flight); the future gets its result. With no
        step in flight that is now: waiting for the loop to wake would only add latency (migration
        downtime, for one)."""
        fut = asyncio.get_running_loop().create_future()
        if self._stepping:
            self._calls.append((fn, fut))
        else:
            run_call(fn, fut)
        self.wake.set()  # refreshes the load report, and steps what the call may have started
        return fut

    def run(self) -> None:
        """(At the boundary) Run every call that waits, and those they post meanwhile."""
        while self._calls:
            calls, self._calls = self._calls, []
            for fn, fut in calls:
                run_call(fn, fut)


def run_call(fn: Callable, fut: asyncio.Future) -> None:
    """Run now, whatever the timing: every outcome, an unexpected exception included, goes to the caller
    through the future, never into the step loop."""
    if fut.done():
        return
    try:
        fut.set_result(fn())
    except (EngineError, KeyError, ValueError, TransferError) as exc:
        fut.set_exception(exc)
    except Exception as exc:  # a bug in the call: its caller reports it; the step loop goes on
        log.exception("a call between engine steps failed")
        fut.set_exception(exc)
