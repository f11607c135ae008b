"""Virtual time for in-process tests: an asyncio event loop whose clock only moves when nothing is ready to run.

``run(main)`` runs the coroutine ``main()`` on a ``VirtualTimeLoop``: ``asyncio.sleep``, ``wait_for`` timeouts
and ``call_later`` all run on virtual seconds, so a scenario that spans minutes of protocol time (missed
heartbeats, an order that times out, a drain that polls) runs in milliseconds, and the same way every time:
there is one thread and no real I/O, so the order of events is the order of the code and the timers.

``LoopClock`` is a ``daemons.clock.Clock`` that reads the loop's time: give it to a core (the manager takes a
clock) and its ``monotonic()`` agrees with the loop's timers.

A loop with nothing ready and nothing scheduled would wait forever: it raises ``Deadlock`` instead (the
scenario awaits something that nobody will do).
"""

from __future__ import annotations

import asyncio
import math
import selectors
from typing import Awaitable, Callable, TypeVar

from daemons.clock import Clock

T = TypeVar("T")


class Deadlock(RuntimeError):
    pass


class _Selector(selectors.DefaultSelector):
    """Polls the loop's own wake-up pipe without waiting, and moves the virtual time to the next timer."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout: float | None = None):
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise Deadlock("nothing is ready to run and no timer is set: the scenario waits on something "
                           "that nothing will do")
        self.loop.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """Virtual seconds from ``start``; ``stall(s)`` moves them on as a blocked thread would (timers then run late)."""

    def __init__(self, start: float = 0.0) -> None:
        selector = _Selector()
        super().__init__(selector)
        selector.loop = self
        self.now = start
        self._clock_resolution = 0.0

    def time(self) -> float:
        return self.now

    def _run_once(self) -> None:
        # With nothing ready to run, time moves to the earliest timer (just past it: a timer runs once its
        # time is strictly past, the clock resolution being 0). asyncio would run a timer due within its
        # clock resolution at once; on a real clock time passes meanwhile, here it would not, and code that
        # re-arms a timeout for the little time left (deadline - now) would spin at one instant.
        if not self._ready and self._scheduled:
            self.now = max(self.now, math.nextafter(self._scheduled[0]._when, math.inf))
        super()._run_once()

    def stall(self, seconds: float) -> None:
        """As if the running callback held the thread for ``seconds``."""
        self.now += seconds


class LoopClock(Clock):
    """A daemon core's clock that reads the event loop's (virtual) time."""

    real = False

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def monotonic(self) -> float:
        return self.loop.time()

    def time(self) -> float:
        return self.loop.time()

    def call_later(self, delay_s: float, fn: Callable, *args) -> asyncio.TimerHandle:
        return self.loop.call_later(delay_s, fn, *args)


def run(main: Callable[[VirtualTimeLoop], Awaitable[T]], start: float = 0.0) -> T:
    """Run ``main(loop)`` to the end on a fresh virtual-time loop; tasks left running are cancelled."""
    loop = VirtualTimeLoop(start)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main(loop))
    finally:
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        asyncio.set_event_loop(None)
        loop.close()
