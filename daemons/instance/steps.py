"""The step loop: schedule (at a step boundary, what waits goes in), run (engine steps), postprocess (each
step's tokens go out, its load is noted).

There is one step path. ``run_steps`` is what the engine thread runs (vLLM: steps block, back to back until
the boundary has work) and what the event loop runs for the sim and ``instance.min_step_s`` (one step at a
time, its model time or the padding waited out on the clock); each step is ``step`` and each step's
outputs go through ``postprocess``, the same code either way. The in-process harness (tests/support/) runs
the sim's way on virtual time; tests/unit/test_step_path.py runs the engine thread's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from daemons import wire
from daemons.config import InstanceConfig
from daemons.instance.cache import CacheReports
from daemons.instance.handover import Handovers
from daemons.instance.intake import Intake
from daemons.instance.listings import Listings
from daemons.instance.predictor import StepFit
from daemons.instance.reports import Reporter
from daemons.instance.shared import Shared
from daemons.instance.telemetry import M_STEP
from daemons.instance.tokens import TokenPath
from daemons.watchdog import Faults, Watchdog

log = logging.getLogger("llumnix.instance")


@dataclass(slots=True)
class Step:
    """One engine step as ``StepLoop.step`` ran it (on the engine thread or the loop)."""

    outputs: list[wire.TokenOut]
    start: float  # on the instance's clock
    took_s: float  # on that clock, faults included
    model_time_s: float  # (the sim) the time it stands for: its tokens exist once it is up
    load: wire.InstanceLoad | None  # the engine's, right after it (a step at a time: None, its boundary reads it)
    rows: list[wire.RequestLoad] | None  # the engine's request rows right after it, when listings keep them
    work: tuple[int, int, int] = (0, 0, 0)  # what it did: prefill tokens, decodes, their context tokens


@dataclass(frozen=True)
class Stepped:
    """The parts the step loop drives between steps, each through its verbs."""

    intake: Intake  # requests in
    listings: Listings  # the request rows they keep
    tokens: TokenPath  # tokens out
    reporter: Reporter  # the load
    cache: CacheReports  # prefix-cache changes
    handovers: Handovers | None = None  # requests offered for a handover (role prefill; None: never)


class StepLoop:
    """Owns the engine thread (``executor``, None when steps do not block: the sim), the step count and the
    faults that act on steps. Between steps it drives the other parts through their verbs: ``intake``
    (requests in), ``mailbox`` (engine calls), ``listings``, ``tokens`` (tokens out), ``reporter`` (the load),
    ``cache`` (prefix-cache changes), ``phases`` (metrics), the migrator's pacing (``migrator()``) and the step-time
    model (``fit``)."""

    def __init__(self, shared: Shared, ic: InstanceConfig, parts: Stepped, watchdog: Watchdog, faults: Faults,
                 fit: StepFit):
        self.engine, self.mailbox, self.phases, self.migrator, self.clock = (
            shared.engine, shared.mailbox, shared.phases, shared.migrator, shared.clock)
        self.intake, self.listings, self.tokens = parts.intake, parts.listings, parts.tokens
        self.reporter, self.cache = parts.reporter, parts.cache
        self.handovers = parts.handovers  # offers requests to hand over (role prefill; None: never)
        self.fit = fit  # the step-time model: each step's work and time go to it
        self.watchdog = watchdog
        self.faults = faults
        self.engine_nice = ic.engine_nice
        self.min_step_s = ic.min_step_s
        self.steps = 0
        self._halt = False  # the loop was cancelled: the engine thread stops after its step
        self._failure: BaseException | None = None  # raised by the loop, as if postprocess had raised there
        # A real engine's step takes milliseconds of compute: run it on a worker thread so sockets stay
        # served. The engine is only ever touched between steps, from the event loop thread.
        self.executor = (ThreadPoolExecutor(1, thread_name_prefix="engine", initializer=self._init_engine_thread)
                         if self.engine.blocking_step else None)
        if self.executor is not None:
            # The step thread runs Python between its kernels and holds the GIL meanwhile; by default a
            # waiting thread gets it after up to 5 ms. The event loop serves sockets (tokens, migration
            # handshakes, whose latency is downtime): let it in sooner.
            sys.setswitchinterval(0.0005)

    def _init_engine_thread(self) -> None:
        """(Engine thread, first) Lower this thread's priority by ``instance.engine_nice`` (Linux: niceness is
        per thread, and threads it starts inherit it), then the engine's own set-up."""
        if self.engine_nice:
            tid = threading.get_native_id()
            try:
                os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + self.engine_nice)
            except OSError as exc:
                log.warning("instance.engine_nice=%d not applied: %s", self.engine_nice, exc)
        self.engine.init_thread()

    async def run(self) -> None:
        while True:
            self.schedule()
            if not self.engine.has_work():
                self.mailbox.wake.clear()
                await self.mailbox.wake.wait()
                continue
            if self.executor is not None and not self.min_step_s:
                await self.run_back_to_back()
            else:
                await self.run_paced()

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True)  # a step in flight finishes before anyone touches the engine

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> None:
        """At the boundary: take in requests and aborts, run engine calls, read the rows listings keep, refresh
        the load."""
        self.intake.apply()
        self.mailbox.run()
        self.listings.at_boundary()
        self.tokens.flush()
        self.cache.collect()
        self.reporter.refresh()

    def boundary_wanted(self) -> bool:
        """(Engine thread) Whether the loop must take the boundary before another step: requests, aborts or
        engine calls wait, or the loop is stopping (listings never wait: they are answered during steps).
        Reads only: the loop owns these."""
        return self.intake.waiting() or self.mailbox.waiting() or self._halt or self._failure is not None

    # ------------------------------------------------------------------ run

    def run_steps(self, deliver: Callable[[Step], None], once: bool) -> None:
        """(Engine thread, or the loop for a step at a time) Step, handing each step to ``deliver``, until the
        boundary is wanted or no work is left (``once``: one step)."""
        while True:
            deliver(self.step(with_load=not once))
            if once or self.boundary_wanted() or not self.engine.has_work():
                return

    def step(self, with_load: bool = True) -> Step:
        """One engine step, timed (the watchdog sees it run), with the faults that act on steps; the engine's
        load after it when ``with_load`` (steps back to back: their boundary may be many steps away)."""
        start = self.clock.monotonic()
        self.watchdog.step_began(start)
        if self._hangs():  # (on the engine thread: the thread never comes back)
            threading.Event().wait()
        self.steps += 1
        busy_at = self.faults.get("busy_step_after")
        if busy_at and self.steps == busy_at:
            # As a CPU prefill that holds the interpreter: on the sim (steps on the event loop) nothing of the
            # llumlet runs meanwhile; only ZeroMQ's I/O thread does. (A real clock: a virtual one stands still.)
            log.warning("fault injection: this step keeps the interpreter busy for %gs", self.faults.get("busy_step_s"))
            end = self.clock.monotonic() + self.faults.get("busy_step_s")
            while self.clock.monotonic() < end:
                pass
        result = self.engine.step()
        self.watchdog.step_ended()
        now = self.clock.monotonic()
        took = now - start
        rows = self.engine.requests() if self.listings.rows_due(took, now) else None
        load = self.reporter.with_outlook(self.engine.load(), rows) if with_load else None
        return Step(result.outputs, start, took, result.model_time_s, load, rows,
                    (result.prefill_tokens, result.decodes, result.context_tokens))

    def _hangs(self) -> bool:
        """(Fault injection) Whether the next step, from the ``hang_step_after``-th on, never ends."""
        hang_at = self.faults.get("hang_step_after")
        if hang_at and self.steps + 1 >= hang_at:
            log.warning("fault injection: this engine step never ends")
            return True
        return False

    async def run_back_to_back(self) -> None:
        """Steps on the engine thread, back to back until the boundary has work (or there is none left): each
        step's outputs reach the sockets from the event loop while the next step runs, instead of the engine
        waiting a loop round trip, the emit and a boundary after every step. Each step's postprocess goes to
        the loop in step order (call_soon_threadsafe is FIFO, and the loop's wake-up for this call's end
        comes after them): the boundary sees every output of the steps before it emitted."""
        loop = asyncio.get_running_loop()
        self.mailbox.begin_step(on_thread=True)  # engine calls from coroutines wait for the boundary meanwhile
        try:
            await loop.run_in_executor(self.executor, self.run_steps,
                                       lambda step: loop.call_soon_threadsafe(self._stepped, step), False)
        except asyncio.CancelledError:
            self._halt = True  # (the mailbox stays stepping: the thread may still be in its step)
            raise
        self.mailbox.end_step()
        if self._failure is not None:
            raise self._failure

    def _stepped(self, step: Step) -> None:
        """(Event loop) One step of ``run_back_to_back`` ended."""
        if self._halt or self._failure is not None:
            return
        try:
            self.postprocess(step, step.took_s)
            # The boundary may be many steps away: the load this step left is current now. (A paced step's
            # boundary comes next, and refreshes it there.)
            self.reporter.refresh(step.load)
        except Exception as exc:  # a loop callback's exception would only be logged: the step loop raises it
            self._failure = exc
            return
        self.timed(step, step.took_s)

    async def run_paced(self) -> None:
        """One step, then the boundary: the sim (its steps take model time on the clock) and
        ``instance.min_step_s`` (every step padded to it), timed on the instance's clock (the monotonic
        clock; the virtual loop's in tests/support), on which the model time is waited for."""
        taken: list[Step] = []
        self.mailbox.begin_step(on_thread=self.executor is not None)
        if self.executor is not None:
            await asyncio.get_running_loop().run_in_executor(self.executor, self.run_steps, taken.append, True)
        else:
            if self._hangs():  # on the loop, as an engine thread's would: the step never ends, the loop goes on
                self.watchdog.step_began(self.clock.monotonic())
                await asyncio.get_running_loop().create_future()
            self.run_steps(taken.append, True)
        step = taken[0]
        if self.executor is None and step.model_time_s > 0:
            # A modelled step (the sim) computed its tokens at once; they exist when its model time is up.
            ahead = step.model_time_s - (self.clock.monotonic() - step.start)
            if ahead > 0:
                await self.clock.sleep(ahead)  # the step is not over: engine calls wait for its boundary
        self.postprocess(step, max(step.model_time_s, self.clock.monotonic() - step.start))
        self.mailbox.end_step()
        remaining = max(step.model_time_s, self.min_step_s) - (self.clock.monotonic() - step.start)
        # Always yield once per step so sockets are served even when steps take no model time.
        await self.clock.sleep(remaining if remaining > 0 else 0)
        self.timed(step, self.clock.monotonic() - step.start)

    # ------------------------------------------------------------------ postprocess

    def postprocess(self, step: Step, step_s: float) -> None:
        """(Event loop) A step ended (``step_s``: as long as it counts): its tokens go out, and the request
        rows it read (when listings keep them) are current."""
        self.listings.stepped(step.rows)
        self.tokens.emit(step.outputs)
        self.phases.outputs(step.outputs, step.start, step_s)
        self.tokens.flush()
        if self.handovers is not None and step.outputs:
            self.handovers.outputs(step.outputs)

    def timed(self, step: Step, step_s: float) -> None:
        """A step ended, ``step_s`` after it began (paced steps: padding included, as the clients see it)."""
        M_STEP.observe(step_s)
        self.fit.stepped(*step.work, step_s)
        self.fit.outputs(step.outputs, self.clock.monotonic())
        migrator = self.migrator()
        if migrator is not None:
            migrator.stepped(step_s)  # paces a migration's pre-copy (daemons/pacing.py)
