"""The injected clock (daemons/clock.py): the virtual one runs callbacks in time order and only moves when it
runs one; a manager given it reads its time (the simulator's use: no module global patched)."""

from __future__ import annotations

import asyncio

import pytest

from daemons.clock import VirtualClock
from daemons.config import load_config
from daemons.manager import Manager


def test_virtual_time_runs_callbacks_in_order_and_ties_in_the_order_scheduled():
    clock, seen = VirtualClock(), []
    clock.call_at(2.0, lambda: seen.append(("b", clock.now)))
    clock.call_at(1.0, lambda: clock.call_later(0.5, lambda: seen.append(("a2", clock.now))))
    clock.call_at(2.0, lambda: seen.append(("c", clock.now)))
    assert clock.now == 0.0 and clock.pending() == 3
    while clock.pending():
        clock.run_next()
    assert seen == [("a2", 1.5), ("b", 2.0), ("c", 2.0)]
    assert clock.monotonic() == 2.0


def test_a_virtual_clock_does_not_sleep():
    with pytest.raises(RuntimeError, match="does not sleep"):
        asyncio.run(VirtualClock().sleep(1))


def test_a_manager_reads_the_clock_it_is_given():
    clock = VirtualClock(start=100.0)
    m = Manager(load_config(None, []), clock=clock)
    try:
        assert m.started == 100.0
        clock.now = 160.0
        assert m.snapshot(1).uptime_s == 60.0  # the manager's status reads virtual time
    finally:
        m.sec.close()
        m.ctx.destroy(linger=0)
