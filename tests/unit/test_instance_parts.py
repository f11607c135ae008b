"""The instance's parts on their own: the step-boundary mailbox, where the instance stands, the intake, and
the sim's step path (the same ``run_steps`` the engine thread runs, one step at a time on virtual time)."""

from __future__ import annotations

import asyncio

import pytest

from daemons import metrics, wire
from daemons.config import Config
from daemons.engine.base import EngineError
from daemons.engine.sim import SimEngine
from daemons.instance import Instance
from daemons.instance.intake import Intake
from daemons.instance.mailbox import Mailbox
from daemons.instance.shared import Shared
from daemons.instance.standing import Identity, Standing
from daemons.instance.tokens import TokenPath
from daemons.requests import RequestTable
from tests.support import virtual

REPLY_TO = "tcp://127.0.0.1:9"


def test_mailbox_runs_calls_at_once_between_steps_and_at_the_boundary_during_one():
    async def go():
        box = Mailbox()
        assert await box.call(lambda: 1) == 1 and box.wake.is_set()  # no step in flight: now
        box.begin_step(on_thread=True)
        assert box.stepping and box.engine_busy
        fut = box.call(lambda: 2)
        bad = box.call(lambda: (_ for _ in ()).throw(EngineError("no room")))
        broken = box.call(lambda: 1 / 0)
        assert box.waiting() and not fut.done()
        box.end_step()
        box.run()
        assert not box.waiting() and await fut == 2
        with pytest.raises(EngineError):
            await bad
        with pytest.raises(ZeroDivisionError):  # a bug in a call reaches its caller, not the step loop
            await broken
        box.begin_step(on_thread=False)
        assert box.stepping and not box.engine_busy  # a modelled step: the engine itself is idle

    asyncio.run(go())


def test_standing_says_why_a_submit_goes_back():
    s = Standing()
    assert s.open and s.give_back_reason() == "" and s.register_reason() == ""
    assert s.drain(wire.SetDraining(draining=True, reason="", elsewhere=False)) == ""
    assert s.draining == "operator" and not s.open and s.give_back_reason() == ""  # nowhere else: kept
    s.drain(wire.SetDraining(draining=True, reason="scale-in", elsewhere=True))
    assert s.give_back_reason() == "draining"
    s.stop_accepting()
    assert s.give_back_reason() == "shutting down" and s.register_reason() == "stopping"


class Sent:
    """Stands in for the proxy links: what is sent, by address."""

    def __init__(self):
        self.msgs: list[tuple[str, wire.Message]] = []
        self.seen_from: list[str] = []
        self.dropped: list[str] = []

    def send(self, address, msg):
        self.msgs.append((address, msg))

    def seen(self, address):
        self.seen_from.append(address)

    def drop(self, address):
        self.dropped.append(address)


def make_intake(standing: Standing):
    cfg = Config()
    cfg.sim.time_scale = 0.0
    engine = SimEngine(cfg.sim, cfg.model)
    requests = RequestTable()
    links = Sent()
    tokens = TokenPath(links, requests, Identity("i9"))
    shared = Shared(engine, requests, Identity("i9"), standing, Mailbox(), metrics.RequestPhases(), lambda msg: None,
                    lambda: None, virtual.LoopClock(virtual.VirtualTimeLoop()))
    intake = Intake(shared, None, tokens, links, lambda reply_to: None)
    return intake, engine, requests, links


def submit(rid: str, epoch: int = 1) -> wire.Submit:
    return wire.Submit(rid, [1, 2, 3], wire.SamplingParams(max_tokens=5), REPLY_TO, epoch=epoch)


def test_intake_admits_once_counts_what_it_took_and_gives_back_while_draining():
    standing = Standing()
    intake, engine, requests, links = make_intake(standing)
    intake.take([b"proxy", wire.encode(submit("a"))])
    assert intake.waiting() and links.seen_from == [REPLY_TO]
    intake.post(submit("a"))  # sent again by a proxy that took it for lost: same epoch, taken once
    intake.apply()
    assert "a" in requests and engine.load().waiting == 1 and intake.taken == {REPLY_TO: 2}
    standing.drain(wire.SetDraining(draining=True, reason="x", elsewhere=True))
    intake.post(submit("b"))
    intake.apply()
    assert "b" not in requests and links.msgs[-1][1] == wire.Redispatch("b", "i9", "draining")
    intake.post(wire.Abort("a"))
    intake.apply()
    assert "a" not in requests and not engine.has_work()
    standing.drain(wire.SetDraining(draining=False))
    intake.post(submit("c"))
    intake.apply()
    assert intake.abort_orphans(REPLY_TO, "test") == 1  # its proxy is gone: aborted, and the proxy told why
    assert "c" not in requests and not engine.has_work() and intake.taken == {} and links.dropped == [REPLY_TO]
    failed = links.msgs[-1][1]
    assert isinstance(failed, wire.RequestFailed) and failed.request_id == "c" and failed.retryable


def test_the_sim_steps_through_the_engine_threads_step_code_one_step_at_a_time():
    """The harness's instances (the sim, steps on the loop) run ``run_steps``, the function the engine
    thread runs, once per step, and wait out each step's model time on the clock."""
    cfg = Config()
    cfg.sim.eos_rate = 0.0

    async def go(loop):
        inst = Instance(cfg, SimEngine(cfg.sim, cfg.model), clock=virtual.LoopClock(loop))
        sent: list[wire.TokenOut] = []
        inst.tokens.send = lambda address, msg: sent.extend(msg.outputs) if isinstance(msg, wire.TokenBatch) else None
        calls: list[bool] = []
        run_steps = inst.stepper.run_steps

        def counted(deliver, once):
            calls.append(once)
            return run_steps(deliver, once)

        inst.stepper.run_steps = counted
        inst.intake.post(wire.Submit("r", [1, 2, 3], wire.SamplingParams(max_tokens=10), REPLY_TO))
        start = loop.time()
        task = asyncio.create_task(inst.stepper.run())
        while len(sent) < 10:
            await asyncio.sleep(0.001)
        took = loop.time() - start
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        inst.ctx.destroy(linger=0)
        return sent, calls, took, inst.stepper.steps

    sent, calls, took, steps = virtual.run(go)
    assert [t.index for t in sent] == list(range(10)) and sent[-1].finish_reason == "length"
    assert calls == [True] * steps and steps >= 10  # one step per call, every step through run_steps
    assert took > 0  # the steps took model time on the virtual clock
