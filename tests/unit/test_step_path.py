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


def test_a_first_listing_during_a_long_step_is_answered_at_once_from_the_request_table(harness):
    """A long step (a CPU prefill, a tensor-parallel step on a contended host) holds no listing: the first in a
    while, with no engine rows kept, is answered at once by the event loop from the llumlet's request table
    (the lookup before ``migrate REQ`` used to wait for the step's end, and missed the request when that came
    after the manager's deadline); the engine thread then keeps rows for the details of the next ones."""
    h = harness()
    listings = catch_listings(h)

    async def go():
        h.submit("r0", 100000)
        loop = asyncio.create_task(h.inst.stepper.run())
        await h.wait_tokens(2)
        h.engine.gate.clear()
        await until(h.engine.held.is_set)  # the engine thread is inside a step that does not end
        steps = len(h.engine.batches)
        assert h.inst.listings.rows is None  # no listing lately: no engine rows kept
        h.inst.listings.on_list_requests(1)
        h.submit("r1", 5)  # placed here during the step: taken in at the boundary, listed as waiting now
        h.inst.listings.on_list_requests(2)
        answered_in_step = len(listings) == 2 and len(h.engine.batches) == steps and h.engine.held.is_set()
        h.engine.gate.set()
        await until(lambda: h.inst.listings.rows is not None)  # kept from now on
        h.inst.listings.on_list_requests(3)
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        return answered_in_step

    assert asyncio.run(go())
    (first, first_held), (second, second_held), (third, _) = listings
    assert first_held and second_held  # both answers went out while the step was held
    assert [(r.request_id, r.state, r.prompt_tokens) for r in first.requests] == [("r0", "running", 3)]
    r0 = first.requests[0]
    assert r0.output_tokens >= 2 and r0.blocks == -(-(3 + r0.output_tokens) // 16)  # the blocks its tokens fill
    assert [(r.request_id, r.state) for r in second.requests] == [("r0", "running"), ("r1", "waiting")]
    assert [r.request_id for r in third.requests][0] == "r0"
    assert third.requests[0].output_tokens >= first.requests[0].output_tokens


def test_a_listing_with_an_abort_waiting_leaves_the_request_out_at_once(harness):
    """An abort (a copy the proxy fenced, say) waits for the boundary; a listing during the step does not: it
    is answered at once as the boundary will leave the table, so it never names a request about to be dropped."""
    h = harness()
    listings = catch_listings(h)

    async def go():
        h.submit("r0", 100000)
        h.submit("r1", 100000)
        loop = asyncio.create_task(h.inst.stepper.run())
        await h.wait_tokens(4)
        h.inst.listings.on_list_requests(1)
        h.engine.gate.clear()
        await until(h.engine.held.is_set)
        h.inst.intake.post(wire.Abort("r1"))
        h.inst.intake.post(wire.Abort("r0", epoch=7))  # another placement's: r0 stays (RequestTable.abort: STALE)
        h.inst.listings.on_list_requests(2)
        h.engine.gate.set()
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)

    asyncio.run(go())
    (first, _), (second, second_held) = listings
    assert sorted(r.request_id for r in first.requests) == ["r0", "r1"]
    assert second_held and [r.request_id for r in second.requests] == ["r0"]


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
