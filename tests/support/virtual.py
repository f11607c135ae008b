"""Virtual time for in-process tests: the daemons' own (daemons/clock.py), under the names the tests use.

``run(main)`` runs the coroutine ``main(loop)`` on a ``VirtualTimeLoop``: ``asyncio.sleep``, ``wait_for``
timeouts and ``call_later`` all run on virtual seconds, so a scenario that spans minutes of protocol time
(missed heartbeats, an order that times out, a drain that polls) runs in milliseconds, and the same way every
time. ``LoopClock(loop)`` is the ``Clock`` a core is given there; ``Deadlock``: nothing is ready and no timer
is set. ``llumnixctl simulate`` runs on the same virtual time.
"""

from daemons.clock import Deadlock, LoopClock, VirtualTimeLoop, run_virtual as run

__all__ = ["Deadlock", "LoopClock", "VirtualTimeLoop", "run"]
