"""The step loop: the engine steps on its own thread; calls that must run between two steps (migration,
listings, the inbox) wait for a boundary; each step's tokens go out and its load is noted."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import msgspec

from daemons import wire
from daemons.engine.base import EngineError
from daemons.instance.telemetry import LISTING_WINDOW_S, LONG_STEP_S, MOVED_LATELY_S, M_QUERY, M_STEP, ROWS_EVERY_S
from daemons.kvtransfer import TransferError

log = logging.getLogger("llumnix.instance")


class StepLoopMixin:
    """Of the Instance: owns the engine thread and the boundary mailbox."""

    def boundary(self, fn: Callable) -> asyncio.Future:
        """Run ``fn()`` at a step boundary (no engine step in flight); the future gets its result. With no
        step in flight that is now: waiting for the loop to wake would only add latency (migration
        downtime, for one)."""
        fut = asyncio.get_running_loop().create_future()
        if self.stepping:
            self.boundary_calls.append((fn, fut))
        else:
            self._run_boundary_call(fn, fut)
        self.wake.set()  # refreshes the load report, and steps what the call may have started
        return fut

    @staticmethod
    def _run_boundary_call(fn: Callable, fut: asyncio.Future) -> None:
        """Run now, whatever the timing: every outcome, an unexpected exception included, goes to the caller
        through the future, never into the step loop."""
        if fut.done():
            return
        try:
            fut.set_result(fn())
        except (EngineError, KeyError, ValueError, TransferError) as exc:
            fut.set_exception(exc)
        except Exception as exc:  # a bug in the call: its caller reports it; the step loop goes on
            log.exception("a call between engine steps failed")
            fut.set_exception(exc)

    def at_boundary(self) -> None:
        """Between steps: take in requests and aborts, run migration calls, answer queries, refresh the load."""
        self.apply_inbox()
        while self.boundary_calls:
            calls, self.boundary_calls = self.boundary_calls, []
            for fn, fut in calls:
                self._run_boundary_call(fn, fut)
        self.rows = None
        if self.list_queries or self.clock.monotonic() < self.rows_until:
            self.rows, self.rows_at = self.engine.requests(), self.clock.monotonic()
        if self.list_queries:
            for qid, arrived in self.list_queries:
                self.answer_listing(qid, arrived, self.rows)
            self.list_queries.clear()
        self.proxies.flush()
        self.collect_cache()
        self.last_load = self.current_load()
        self.load_changed.set()

    def on_list_requests(self, qid: int) -> None:
        """A request listing: during steps, answered now from the rows of the last step or boundary when they
        are kept and nothing waits for the boundary (the step in flight may be long; nothing but steps has
        touched the engine since), else at the next boundary: a request, an abort (a fenced copy, say) or an
        engine call (a migration's commit) that waits for it must be in the answer, as it would be there."""
        now = self.clock.monotonic()
        self.rows_until = now + LISTING_WINDOW_S
        if (self.stepping and self.rows is not None and not self.list_queries and not self.inbox
                and not self.boundary_calls):
            self.answer_listing(qid, now, self.rows)
        else:
            self.list_queries.append((qid, now))
            self.wake.set()

    def answer_listing(self, qid: int, arrived: float, rows: list[wire.RequestLoad]) -> None:
        migrating = self.requests.migrating()
        if migrating:  # pre-copy too, not only the suspended last stage
            rows = [msgspec.structs.replace(r, state="migrating") if r.request_id in migrating else r for r in rows]
        self._tell_manager(wire.RequestList(qid, self.instance_id, rows, self.requests.moved_lately(MOVED_LATELY_S)))
        M_QUERY.observe(self.clock.monotonic() - arrived)
        log.debug("listing %d: %d rows (%s), %d requests held", qid, len(rows),
                  "during a step" if self.stepping else "at the boundary", len(self.requests))

    def current_load(self, load: wire.InstanceLoad | None = None) -> wire.InstanceLoad:
        """The engine's load (``load``: as the engine thread just read it) with the llumlet's own state."""
        load = self.engine.load() if load is None else load
        m = self.migrator
        if m is not None and (m.busy or m.committed or m.aborted):
            load = msgspec.structs.replace(load, migrating_out=len(m.outgoing), migrating_in=len(m.incoming),
                                           migrations_committed=m.committed, migrations_aborted=m.aborted)
        if self.watchdog.stalled:
            load = msgspec.structs.replace(load, stalled=True)
        cache = getattr(self.engine, "cache", None)
        if cache is not None and cache.query_tokens:
            load = msgspec.structs.replace(load, prefix_query_tokens=cache.query_tokens, prefix_hit_tokens=cache.hit_tokens)
        return load

    def _hangs(self) -> bool:
        """(Fault injection) Whether the next step, from the ``hang_step_after``-th on, never ends."""
        hang_at = self.faults.get("hang_step_after")
        if hang_at and self.steps + 1 >= hang_at:
            log.warning("fault injection: this engine step never ends")
            return True
        return False

    def _step(self):
        if self._hangs():  # (on the engine thread: the thread never comes back)
            while True:
                time.sleep(3600)
        self.steps += 1
        busy_at = self.faults.get("busy_step_after")
        if busy_at and self.steps == busy_at:
            # As a CPU prefill that holds the interpreter: on the sim (steps on the event loop) nothing of the
            # llumlet runs meanwhile; only ZeroMQ's I/O thread does.
            log.warning("fault injection: this step keeps the interpreter busy for %gs", self.faults.get("busy_step_s"))
            end = time.monotonic() + self.faults.get("busy_step_s")
            while time.monotonic() < end:
                pass
        return self.engine.step()

    async def step_loop(self) -> None:
        while True:
            self.at_boundary()
            if not self.engine.has_work():
                self.wake.clear()
                await self.wake.wait()
                continue
            if self.executor is not None and not self.ic.min_step_s:
                await self.run_steps()
            else:
                await self.step_once()

    async def run_steps(self) -> None:
        """Steps on the engine thread, back to back until the boundary has work (or there is none left):
        its outputs reach the sockets from the event loop while the next step runs, instead of the engine
        waiting a loop round trip, the emit and a boundary after every step."""
        loop = asyncio.get_running_loop()
        self.stepping = True  # engine calls from coroutines wait for the boundary meanwhile
        try:
            await loop.run_in_executor(self.executor, self._steps, loop)
        except asyncio.CancelledError:
            self.halt_steps = True  # (stepping stays set: the thread may still be in its step)
            raise
        self.stepping = False
        if self.emit_failure is not None:
            raise self.emit_failure

    def _boundary_wanted(self) -> bool:
        """(Engine thread) Whether the step loop must take the boundary before another step: requests,
        aborts, engine calls or queries wait, or the loop is stopping. Reads only: the loop owns these."""
        return bool(self.inbox or self.boundary_calls or self.list_queries or self.halt_steps
                    or self.emit_failure is not None)

    def _steps(self, loop: asyncio.AbstractEventLoop) -> None:
        """(Engine thread) Step until the boundary is wanted. Each step's outputs and the load after it go to
        the loop in step order (call_soon_threadsafe is FIFO, and the loop's wake-up for this call's end
        comes after them): the boundary sees every output of the steps before it emitted."""
        watchdog = self.watchdog
        clock = time.perf_counter
        while True:
            start = clock()
            watchdog.step_started = watchdog.now()
            result = self._step()
            watchdog.step_started = 0.0
            step_s = clock() - start
            now = self.clock.monotonic()
            rows = (self.engine.requests() if (step_s >= LONG_STEP_S or now < self.rows_until)
                    and now - self.rows_at >= ROWS_EVERY_S else None)
            loop.call_soon_threadsafe(self._stepped, result.outputs, start, step_s, self.engine.load(), rows)
            if self._boundary_wanted() or not self.engine.has_work():
                return

    def _stepped(self, outputs: list[wire.TokenOut], start: float, step_s: float, load: wire.InstanceLoad,
                 rows: list[wire.RequestLoad] | None = None) -> None:
        """(Event loop) One step of ``run_steps`` ended: its tokens go out, its load (and the request rows, when
        kept) are current. Rows a few steps old stay good until the boundary: only steps have run since."""
        if rows is not None and self.stepping:
            self.rows, self.rows_at = rows, self.clock.monotonic()
        if self.halt_steps or self.emit_failure is not None:
            return
        try:
            self.emit(outputs)
            self.phases.outputs(outputs, start, step_s)
            self.proxies.flush()
            self.last_load = self.current_load(load)
        except Exception as exc:  # a loop callback's exception would only be logged: the step loop raises it
            self.emit_failure = exc
            return
        self.load_changed.set()
        M_STEP.observe(step_s)
        if self.migrator is not None:
            self.migrator.stepped(step_s)  # paces a migration's pre-copy (daemons/pacing.py)

    async def step_once(self) -> None:
        """One step, then the boundary: the sim (its steps take model time on the loop's clock) and
        ``instance.min_step_s`` (every step padded to it). Timed on the instance's clock (the monotonic clock;
        the virtual loop's in tests/support), on which the model time is waited for."""
        loop_time = self.clock.monotonic
        watchdog = self.watchdog
        start = loop_time()
        watchdog.step_started = watchdog.now()
        if self.executor is not None:
            self.stepping = True  # engine calls from coroutines wait for the boundary meanwhile
            result = await asyncio.get_running_loop().run_in_executor(self.executor, self._step)
            self.stepping = False  # (left set if cancelled: the thread may still be stepping)
        else:
            if self._hangs():  # on the loop, as an engine thread's would: the step never ends, the loop goes on
                await asyncio.get_running_loop().create_future()
            result = self._step()
        watchdog.step_started = 0.0
        if self.executor is None and result.model_time_s > 0:
            # A modelled step (the sim) computed its tokens at once; they exist when its model time is up.
            ahead = result.model_time_s - (loop_time() - start)
            if ahead > 0:
                self.stepping = True  # the step is not over: engine calls wait for its boundary
                await asyncio.sleep(ahead)
                self.stepping = False
        self.emit(result.outputs)
        self.phases.outputs(result.outputs, start, max(result.model_time_s, loop_time() - start))
        remaining = max(result.model_time_s, self.ic.min_step_s) - (loop_time() - start)
        # Always yield once per step so sockets are served even when steps take no model time.
        await asyncio.sleep(remaining if remaining > 0 else 0)
        M_STEP.observe(loop_time() - start)
        if self.migrator is not None:
            self.migrator.stepped(loop_time() - start)  # paces a migration's pre-copy (daemons/pacing.py)
