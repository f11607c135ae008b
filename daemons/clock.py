"""Time for the daemons' cores, injected: the real monotonic clock, or a virtual one that a simulation (or a
test) advances event by event.

A core reads ``clock.monotonic()`` where it would read ``time.monotonic()``; the daemons pass ``Clock()``,
the simulator (llumnixctl/experiments/simulate.py) a ``VirtualClock``, which is also its event queue: ``call_at`` and
``call_later`` schedule a callback at a virtual time, ``run_next`` advances the time to the earliest one and
runs it. No module global is patched.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Callable


def loop_time() -> float:
    """The running event loop's clock, for code on the loop whose deadlines pair with the loop's own timeouts
    (``asyncio.wait_for``, ``sleep``): the monotonic clock in the daemons, virtual time where a test runs them
    on a virtual-time loop (tests/support/virtual.py)."""
    return asyncio.get_running_loop().time()


class Clock:
    """The real clock (monotonic seconds; sleeping and timers on the running asyncio loop)."""

    real = True  # time moves by itself (False: only as a simulation or a virtual-time loop moves it)

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        """Wall-clock seconds: what daemons on different hosts agree on (the proxies' tie turns)."""
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def call_later(self, delay_s: float, fn: Callable, *args) -> asyncio.TimerHandle:
        return asyncio.get_running_loop().call_later(delay_s, fn, *args)


class VirtualClock(Clock):
    """Virtual seconds from 0 and the callbacks due at them, run in time order (ties: in the order they were
    scheduled). ``now`` only moves when ``run_next`` runs the next callback."""

    real = False

    def __init__(self, start: float = 0.0):
        self.now = start
        self._events: list[tuple[float, int, Callable, tuple]] = []
        self._seq = itertools.count()

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        raise RuntimeError("a virtual clock does not sleep: schedule the rest with call_later")

    def call_at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def call_later(self, delay_s: float, fn: Callable, *args) -> None:
        self.call_at(self.now + delay_s, fn, *args)

    def pending(self) -> int:
        return len(self._events)

    def run_next(self) -> None:
        """Advance to the earliest callback and run it."""
        t, _, fn, args = heapq.heappop(self._events)
        self.now = max(self.now, t)
        fn(*args)
