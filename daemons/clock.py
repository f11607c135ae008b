"""Time, injected: one ``Clock`` interface, and one virtual time.

A core reads ``clock.monotonic()`` where it would read ``time.monotonic()``, ``clock.time()`` for wall-clock
seconds, waits with ``await clock.sleep(s)`` and sets timers with ``clock.call_later(d, fn, *args)``. No module
global is patched.

- ``Clock()``: the real clock (the daemons). Its monotonic time is the asyncio loop's time too.
- ``VirtualTimeLoop``: an asyncio event loop whose time only moves when nothing is ready to run: then it jumps
  to the next timer. ``asyncio.sleep``, ``wait_for`` timeouts and ``call_later`` all run on virtual seconds,
  so minutes of protocol time run in milliseconds, the same way every time (one thread, the order of events
  is the order of the code and the timers). The in-process harness (tests/support/) runs the real daemons
  on it, and ``llumnixctl simulate`` (llumnixctl/experiments/sim/simulate.py) its cluster.
- ``LoopClock(loop)``: the ``Clock`` that reads a loop's time; given to a core on a virtual-time loop, its
  ``monotonic()`` agrees with the loop's timers.

A request's latencies at the proxy (the TTFT and TPOT that goodput judges against the targets, the latency
histograms, the access log) read the proxy's ``Clock``, as the attainment the instances judge reads theirs. What
does not read a ``Clock``: the instances' step and migration histograms (daemons/metrics.py) time real durations
with ``time.perf_counter``, and the Gloo pairs' threads (daemons/kv/transfer.py) pace real bytes on real time;
neither decides anything the protocol does.

A virtual-time loop with nothing ready and no timer set would wait forever: it raises ``Deadlock`` instead
(the scenario awaits something nothing will do).
"""

from __future__ import annotations

import asyncio
import math
import selectors
import time
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")


class Clock:
    """The real clock (monotonic seconds; sleeping and timers on the running asyncio loop)."""

    real = True  # time moves by itself (False: only as a virtual-time loop moves it)

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        """Wall-clock seconds: what daemons on different hosts agree on (the proxies' tie turns)."""
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def call_later(self, delay_s: float, fn: Callable, *args) -> asyncio.TimerHandle:
        return asyncio.get_running_loop().call_later(delay_s, fn, *args)


class LoopClock(Clock):
    """The clock of one event loop (a ``VirtualTimeLoop``'s virtual seconds): ``monotonic()`` and ``time()``
    read the loop's time; sleeping and timers run on that loop."""

    real = False

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def monotonic(self) -> float:
        return self.loop.time()

    def time(self) -> float:
        return self.loop.time()

    def call_later(self, delay_s: float, fn: Callable, *args) -> asyncio.TimerHandle:
        return self.loop.call_later(delay_s, fn, *args)


class Deadlock(RuntimeError):
    """A virtual-time loop has nothing ready to run and no timer set: it would wait forever."""


class _AdvancingSelector(selectors.DefaultSelector):
    """Polls the loop's file descriptors (its wake-up pipe, ZeroMQ's in-process sockets) without waiting;
    where the loop would wait ``timeout`` seconds for its next timer, moves the virtual time on instead."""

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
        self.loop.advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """Virtual seconds from ``start``. The loop asks its selector to wait for the next timer only when nothing
    is ready to run; the selector moves the time to it (just past it: a timer runs once its time is reached,
    and the rounding of ``when - now`` must not leave the time a hair short of it). ``stall(s)`` moves the
    time on as a blocked thread would (timers then run late)."""

    def __init__(self, start: float = 0.0) -> None:
        selector = _AdvancingSelector()
        super().__init__(selector)
        selector.loop = self
        self.now = start

    def time(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """(Its selector) Nothing is ready and the next timer is ``seconds`` away: go there."""
        self.now = math.nextafter(self.now + seconds, math.inf)

    def stall(self, seconds: float) -> None:
        """As if the running callback held the thread for ``seconds``."""
        self.now += seconds

    def clock(self) -> LoopClock:
        return LoopClock(self)


def run_virtual(main: Callable[[VirtualTimeLoop], Awaitable[T]], start: float = 0.0,
                loop: VirtualTimeLoop | None = None) -> T:
    """Run ``main(loop)`` to the end on a fresh virtual-time loop (or ``loop``, which is closed after);
    tasks left running are cancelled."""
    loop = loop or VirtualTimeLoop(start)
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
