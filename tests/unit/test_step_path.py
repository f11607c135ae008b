"""The instance's step path with an engine whose steps block (as vLLM's do): steps run back to back on the
engine thread, their tokens go out in order from the event loop, and everything that must happen between
steps (requests, engine calls, cancellation) still does. In process, on the sim engine, in well under a
second."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time

import pytest

from daemons import wire
from daemons.config import Config
from daemons.engine.sim import SimEngine
from daemons.instance import Instance

REPLY_TO = "tcp://127.0.0.1:9"  # never dialled: the tests catch what the instance sends


class BlockingSim(SimEngine):
    """The sim, stepped off the event loop like vLLM; records each step's batch and thread."""

    blocking_step = True

    def __init__(self, cfg: Config, step_s: float = 0.0):
        super().__init__(cfg.sim, cfg.model)
        self.step_s = step_s
        self.batches: list[int] = []
        self.threads: set[str] = set()
        self.in_step = False
        self.watchdog = None  # the instance's: each step checks that the watchdog times it
        self.timed: list[bool] = []
        self.nice: set[int] = set()  # the step thread's niceness
        self.gate = threading.Event()  # a step waits here while it is clear (a long step, as long as a test wants)
        self.gate.set()
        self.held = threading.Event()  # a step is waiting at the gate

    def step(self):
        self.in_step = True
        if not self.gate.is_set():
            self.held.set()
            self.gate.wait(30)
            self.held.clear()
        self.nice.add(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        self.timed.append(self.watchdog.step_started > 0)
        self.threads.add(threading.current_thread().name)
        if self.step_s:
            time.sleep(self.step_s)  # a step's compute, on the engine thread
        self.batches.append(self.load().running + self.load().waiting)
        result = super().step()
        self.in_step = False
        return result


class Harness:
    """An Instance that sends into a list. ``wait_tokens(n)`` waits until n tokens went out."""

    def __init__(self, step_s: float = 0.0, engine_nice: int = 0):
        cfg = Config()
        cfg.instance.engine_nice = engine_nice
        cfg.sim.time_scale = 0.0
        cfg.sim.eos_rate = 0.0
        self.switch = sys.getswitchinterval()
        self.engine = BlockingSim(cfg, step_s)
        self.inst = Instance(cfg, self.engine)
        self.engine.watchdog = self.inst.watchdog
        self.sent: list[wire.Message] = []
        self.grew = asyncio.Event()
        self.inst.tokens.send = self._catch
        self.hand_offs = 0
        run_steps = self.inst.stepper.run_steps

        def counted(deliver, once):
            self.hand_offs += 1
            return run_steps(deliver, once)

        self.inst.stepper.run_steps = counted

    def _catch(self, address: str, msg: wire.Message) -> None:
        self.sent.append(msg)
        self.grew.set()

    def tokens(self) -> list[wire.TokenOut]:
        return [t for m in self.sent if isinstance(m, wire.TokenBatch) for t in m.outputs]

    async def wait_tokens(self, n: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.tokens()) < n:
            self.grew.clear()
            await asyncio.wait_for(self.grew.wait(), deadline - time.monotonic())

    def submit(self, rid: str, max_tokens: int) -> None:
        self.inst.intake.post(wire.Submit(rid, [1, 2, 3], wire.SamplingParams(max_tokens=max_tokens), REPLY_TO))

    def close(self) -> None:
        self.inst.stepper.close()
        self.inst.ctx.destroy(linger=0)
        sys.setswitchinterval(self.switch)


@pytest.fixture
def harness():
    made: list[Harness] = []

    def make(step_s: float = 0.0, engine_nice: int = 0) -> Harness:
        made.append(Harness(step_s, engine_nice))
        return made[-1]

    yield make
    for h in made:
        h.close()


def by_request(tokens: list[wire.TokenOut]) -> dict[str, list[wire.TokenOut]]:
    out: dict[str, list[wire.TokenOut]] = {}
    for t in tokens:
        out.setdefault(t.request_id, []).append(t)
    return out


def test_a_burst_steps_back_to_back_in_one_hand_off(harness):
    h = harness()

    async def go():
        for i in range(4):  # a burst that landed while the engine was idle
            h.submit(f"r{i}", 20)
        loop = asyncio.create_task(h.inst.stepper.run())
        await h.wait_tokens(80)
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)

    asyncio.run(go())
    assert h.engine.batches == [4] * 20  # the first step has all four; no partial steps
    assert h.hand_offs == 1  # the engine thread ran every step without waiting for the loop
    assert h.engine.threads == {"engine_0"}
    for rid, outs in by_request(h.tokens()).items():
        assert [t.index for t in outs] == list(range(20)), rid
        assert [t.finish_reason for t in outs] == [None] * 19 + ["length"]
    assert len(h.inst.requests) == 0


def test_engine_nice_lowers_the_step_thread_alone(harness):
    h = harness(engine_nice=5)
    loop_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    async def go():
        h.submit("a", 5)
        loop = asyncio.create_task(h.inst.stepper.run())
        await h.wait_tokens(5)
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)

    asyncio.run(go())
    assert h.engine.nice == {min(loop_nice + 5, 19)}  # every step ran on the lowered thread
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == loop_nice  # the loop's is untouched


def test_engine_calls_and_new_requests_wait_for_the_boundary(harness):
    h = harness(step_s=0.002)

    async def go():
        h.submit("a", 60)
        loop = asyncio.create_task(h.inst.stepper.run())
        await h.wait_tokens(3)
        seen = await h.inst.mailbox.call(lambda: (h.engine.in_step, len(h.engine.batches)))
        h.submit("b", 5)  # arrives mid-run: taken in at the next boundary
        await h.wait_tokens(65)
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        return seen

    in_step, steps_then = asyncio.run(go())
    assert not in_step and 3 <= steps_then < 60  # between two steps, while the request still ran
    outs = by_request(h.tokens())
    assert [t.index for t in outs["a"]] == list(range(60))
    assert [t.index for t in outs["b"]] == list(range(5))
    assert h.hand_offs >= 2  # the engine thread came back for the call and for "b"
    assert all(h.engine.timed) and h.inst.watchdog.step_started == 0.0  # every step was timed, none is now


def catch_listings(h: Harness) -> list[tuple[wire.RequestList, bool]]:
    """The instance's request listings to the manager, each with whether a step was held at the gate then."""
    listings: list[tuple[wire.RequestList, bool]] = []
    h.inst.listings.tell_manager = lambda msg: listings.append((msg, h.engine.held.is_set())) \
        if isinstance(msg, wire.RequestList) else None
    return listings


async def until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.001)


def test_a_listing_during_a_long_step_is_answered_before_the_step_ends(harness):
    """The first listing in a while waits for the boundary; once listings come, the engine thread keeps its
    request rows current after every step, and a listing during a step (a long CPU prefill, say) is answered
    from them at once, by the event loop, while the step goes on."""
    h = harness()
    listings = catch_listings(h)

    async def go():
        h.submit("r0", 100000)
        loop = asyncio.create_task(h.inst.stepper.run())
        await h.wait_tokens(2)
        h.inst.listings.on_list_requests(1)
        await until(lambda: len(listings) == 1)  # at a boundary
        h.engine.gate.clear()
        await until(h.engine.held.is_set)  # the engine thread is inside a step that does not end
        steps = len(h.engine.batches)
        h.inst.listings.on_list_requests(2)
        answered_in_step = len(listings) == 2 and len(h.engine.batches) == steps
        h.engine.gate.set()
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        return answered_in_step

    assert asyncio.run(go())
    (first, first_held), (second, second_held) = listings
    assert not first_held and second_held  # the second answer went out while the step was held
    for msg, qid in ((first, 1), (second, 2)):
        assert msg.query_id == qid and [(r.request_id, r.state) for r in msg.requests] == [("r0", "running")]
    assert second.requests[0].output_tokens >= first.requests[0].output_tokens >= 2


def test_a_listing_with_an_abort_waiting_is_answered_at_the_boundary(harness):
    """An abort (a copy the proxy fenced, say) waits for the boundary: a listing during the step waits with it,
    so that it never names a request the instance is about to drop."""
    h = harness()
    listings = catch_listings(h)

    async def go():
        h.submit("r0", 100000)
        h.submit("r1", 100000)
        loop = asyncio.create_task(h.inst.stepper.run())
        await h.wait_tokens(4)
        h.inst.listings.on_list_requests(1)
        await until(lambda: len(listings) == 1)
        h.engine.gate.clear()
        await until(h.engine.held.is_set)
        h.inst.intake.post(wire.Abort("r1"))
        h.inst.listings.on_list_requests(2)
        waited = len(listings) == 1
        h.engine.gate.set()
        await until(lambda: len(listings) == 2)
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        return waited

    assert asyncio.run(go())
    (first, _), (second, second_held) = listings
    assert sorted(r.request_id for r in first.requests) == ["r0", "r1"]
    assert not second_held and [r.request_id for r in second.requests] == ["r0"]


def test_cancelling_the_loop_stops_the_engine_thread_after_its_step(harness):
    h = harness(step_s=0.001)

    async def go():
        h.submit("long", 100000)
        loop = asyncio.create_task(h.inst.stepper.run())
        await h.wait_tokens(5)
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)

    asyncio.run(go())
    h.inst.stepper.close()  # what the instance's shutdown does: returns after the step in flight
    assert len(h.engine.batches) < 1000


def test_a_failed_emit_fails_the_step_loop(harness):
    h = harness(step_s=0.002)

    def broken(address, msg):
        raise RuntimeError("token path broke")

    h.inst.tokens.send = broken

    async def go():
        h.submit("a", 50)
        await h.inst.stepper.run()

    with pytest.raises(RuntimeError, match="token path broke"):
        asyncio.run(go())
    assert len(h.engine.batches) < 10  # the engine thread stopped at its next boundary check, not at the end
