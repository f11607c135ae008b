"""The injected clock (daemons/clock.py): the virtual-time loop runs its timers in time order and only moves
when nothing is ready; a ``LoopClock`` reads it; a manager given one reads its time (the simulator's use and
the harness's: no module global patched)."""

from __future__ import annotations

import asyncio

import pytest

from daemons.clock import Clock, Deadlock, LoopClock, VirtualTimeLoop, run_virtual
from daemons.config import load_config
from daemons.manager import Manager


def test_virtual_time_runs_timers_in_order_and_moves_only_to_them():
    seen = []

    async def main(loop):
        clock = LoopClock(loop)
        loop.call_at(2.0, lambda: seen.append(("b", clock.monotonic())))
        loop.call_at(1.0, lambda: clock.call_later(0.5, lambda: seen.append(("a2", clock.monotonic()))))
        assert clock.monotonic() == 0.0
        await clock.sleep(3.0)
        return clock.monotonic()

    end = run_virtual(main)
    assert [k for k, _ in seen] == ["a2", "b"]
    assert seen[0][1] == pytest.approx(1.5) and seen[1][1] == pytest.approx(2.0)
    assert seen[0][1] >= 1.5 and seen[1][1] >= 2.0  # a timer never runs before its time
    assert end == pytest.approx(3.0)


def test_a_deadline_re_armed_for_the_time_left_does_not_spin():
    async def main(loop):
        deadline = loop.time() + 1.0
        rounds = 0
        while loop.time() < deadline:
            rounds += 1
            try:
                await asyncio.wait_for(loop.create_future(), deadline - loop.time())
            except asyncio.TimeoutError:
                pass
        return rounds

    assert run_virtual(main) <= 2


def test_nothing_to_wait_for_is_a_deadlock():
    async def main(loop):
        await loop.create_future()

    with pytest.raises(Deadlock):
        run_virtual(main)


def test_a_stall_makes_timers_late():
    async def main(loop):
        fired = []
        loop.call_later(1.0, lambda: fired.append(loop.time()))
        loop.stall(5.0)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return fired

    assert run_virtual(main) == [5.0]


def test_the_real_clock_is_the_loops():
    async def main():
        clock = Clock()
        return abs(clock.monotonic() - asyncio.get_running_loop().time())

    assert asyncio.run(main()) < 0.1


def test_a_manager_reads_the_clock_it_is_given():
    loop = VirtualTimeLoop(start=100.0)
    m = Manager(load_config(None, []), clock=LoopClock(loop))
    try:
        assert m.started == 100.0
        loop.stall(60.0)
        assert m.snapshot(1).uptime_s == 60.0  # the manager's status reads virtual time
    finally:
        m.sec.close()
        m.ctx.destroy(linger=0)
        loop.close()
