"""llumnix-instance: one engine plus its llumlet.

The llumlet owns the step loop: between steps it applies the requests and aborts that proxies sent, after
each step it pushes every token straight to the proxy that owns the request, and it reports load to the
manager on change (coalesced to a bounded rate) and at least once per heartbeat interval. It runs live
migrations in and out (daemons/migration.py); their engine calls wait for a step boundary (``boundary``).
When the manager orders migrations out, the llumlet picks which requests go (policy.select_migrants).
While draining (told by the manager, or after SIGTERM) it gives queued requests that produced nothing back
to their proxies for re-dispatch, and its running requests migrate out as the manager orders.

Every request's owner, placement epoch and progress live in one table (daemons/requests.py); the links to
proxies (token path, backlog, proxy liveness) in daemons/proxylinks.py; liveness by progress in
daemons/watchdog.py. Each heartbeat the instance tells every proxy it serves that it is alive and healthy,
and aborts the requests of proxies that are gone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Callable, Optional

import msgspec
import typer
import zmq
import zmq.asyncio

from daemons import metrics, policy, runtime, security, wire
from daemons.cli import load_or_exit
from daemons.config import Config
from daemons.engine import make_engine
from daemons.engine.base import Engine, EngineError, EngineRequest
from daemons.kvtransfer import TransferError
from daemons.migration import Migrator
from daemons.proxylinks import ProxyLinks
from daemons.requests import AbortAction, RequestTable
from daemons.watchdog import Faults, Watchdog

log = logging.getLogger("llumnix.instance")

MOVED_LATELY_S = 30.0  # a request listing names the requests that migrated out this recently
# After a request listing, the engine's request rows are kept current (after every step and boundary) for this
# long, so that the next listings are answered at once instead of after the step in progress; a step this
# long keeps them too (the rows cost well under 1% of it).
LISTING_WINDOW_S = 30.0
LONG_STEP_S = 0.1
ROWS_EVERY_S = 0.2  # during a run of steps the rows are refreshed at most this often
PREFIX_QUERY_TOKENS = 1 << 16  # at most this many prompt tokens go in one prefix query to a destination
M_REQUESTS = metrics.counter("instance", "llumnix_instance_requests_total", "Requests received from proxies")
M_FINISHED = metrics.counter("instance", "llumnix_instance_requests_finished_total",
                             "Requests finished here, by finished_reason (stop, length, abort)", ["finished_reason"],
                             preset=[("stop",), ("length",), ("abort",)])
M_REJECTED = metrics.counter("instance", "llumnix_instance_requests_rejected_total", "Requests refused as invalid")
M_TOKENS = metrics.counter("instance", "llumnix_instance_generation_tokens_total", "Output tokens generated")
M_STEP = metrics.histogram("instance", "llumnix_instance_step_seconds",
                           "Wall time of one engine step, model time included",
                           buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0))
M_BLOCKS_USED = metrics.gauge("instance", "llumnix_instance_kv_blocks_used", "KV blocks in use")
M_BLOCKS_TOTAL = metrics.gauge("instance", "llumnix_instance_kv_blocks_total", "KV blocks in all")
M_KV_USAGE = metrics.gauge("instance", "llumnix_instance_kv_cache_usage_perc",
                           "KV cache usage, blocks used / blocks in all: 1 means full (as vllm:kv_cache_usage_perc)")
M_RUNNING = metrics.gauge("instance", "llumnix_instance_running_requests", "Requests running")
M_WAITING = metrics.gauge("instance", "llumnix_instance_waiting_requests", "Requests waiting")
M_PREEMPTIONS = metrics.counter("instance", "llumnix_instance_preemptions_total",
                                "Preemptions (recompute) by the engine (as vllm:num_preemptions)")
M_BAD_FRAMES = metrics.counter("instance", "llumnix_instance_malformed_frames_total",
                               "Frames dropped because they did not decode")
M_REDISPATCHED = metrics.counter("instance", "llumnix_instance_requests_redispatched_total",
                                 "Queued requests given back to their proxy for re-dispatch (draining)")
M_ORPHANED = metrics.counter("instance", "llumnix_instance_requests_orphaned_total",
                             "Requests aborted because their proxy was gone")
M_FAILOVERS_IN = metrics.counter("instance", "llumnix_instance_failovers_in_total",
                                 "Requests taken over from another instance by re-prefill")
M_BEAT_LATE = metrics.histogram("instance", "llumnix_instance_heartbeat_lateness_seconds",
                                "How late each heartbeat tick of the llumlet ran (0: on time): what a busy engine or "
                                "host costs the liveness and load signals",
                                buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0))
M_QUERY = metrics.histogram("instance", "llumnix_instance_query_seconds",
                            "From a request-list query's arrival to its answer (answered at a step boundary)",
                            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0))
M_HEALTHY = metrics.gauge("instance", "llumnix_instance_healthy",
                          "1 while engine steps make progress, 0 while stalled (instance.step_timeout_s)")


def migrants_for(msg: wire.MigrateStart, requests: list[wire.RequestLoad], keep: set[str], load: wire.InstanceLoad,
                 block_size: int, cached: dict[str, int] | None = None) -> list[policy.Choice]:
    """What a source sends for an order: the order's selection policy over the engine's requests (an
    operator's ``--from --count``: lower priority, then fewer blocks to move, with no balance check).
    ``cached``: the leading blocks of each request that the destination holds already. Also run by the
    virtual-time simulator (llumnixctl/simulate.py)."""
    operator = not msg.reason
    return policy.select_migrants(
        msg.selection or "llumnix", requests, msg.count, src_usage=policy.INF if operator else msg.src_usage,
        src_blocks=load.blocks_total, dst_usage=msg.dst_usage, dst_blocks=msg.dst_blocks or load.blocks_total,
        headroom=msg.headroom, block_size=block_size, drain=msg.drain or operator, exclude=keep,
        dst_free=policy.INF if msg.dst_free_blocks < 0 else msg.dst_free_blocks, cached=cached)


def keep_for(msg: wire.MigrateStart, migrating: set[str], arrivals: dict[str, float], now: float) -> set[str]:
    """Requests that stay for this order: those migrating already and, for a balancing order, those that
    arrived by migration within its cooldown (``arrivals``: request id -> when). Also run by the simulator."""
    keep = set(migrating)
    if msg.reason and not msg.drain:
        keep |= {rid for rid, at in arrivals.items() if now - at < msg.cooldown_s}
    return keep


class Instance:
    def __init__(self, cfg: Config, engine: Engine):
        self.cfg = cfg
        self.ic = cfg.instance
        self.engine = engine
        self.ctx = zmq.asyncio.Context()
        self.sec = security.Security(cfg.security, "instance", self.ctx)
        self.router = self.sec.server(runtime.tune(self.ctx.socket(zmq.ROUTER)), "instance")
        self.manager = self.sec.client(runtime.tune(self.ctx.socket(zmq.DEALER)), "manager")
        # While the manager is away, reports are dropped rather than queued: a restarted manager must not get
        # a flood of stale ones (it asks us to register, and the next report is current).
        self.manager.setsockopt(zmq.IMMEDIATE, 1)
        self.manager.setsockopt(zmq.SNDHWM, 64)
        self.proxies = ProxyLinks(self.ctx, self.ic.orphan_timeout_s, secure=lambda sock: self.sec.client(sock, "proxy"))
        self.requests = RequestTable()
        self.watchdog = Watchdog(self.ic.step_timeout_s, self.ic.hung_exit_s)
        self.faults = Faults(self.ic.id)
        self.inbox: list[wire.Submit | wire.Abort] = []
        self.taken: dict[str, int] = {}  # by proxy token address: its Submits taken in at step boundaries
        self.list_queries: list[tuple[int, float]] = []  # ListRequests (id, arrival) answered at the next boundary
        # The engine's request rows as of the end of the last step or boundary (None: not kept, or stale), and
        # until when they are kept (see LISTING_WINDOW_S).
        self.rows: list[wire.RequestLoad] | None = None
        self.rows_until = 0.0
        self.rows_at = 0.0  # when they were read
        self.boundary_calls: list[tuple[Callable, asyncio.Future]] = []
        self.stepping = False  # engine steps run on the executor thread right now
        self.halt_steps = False  # the step loop was cancelled: the engine thread stops after its step
        self.emit_failure: BaseException | None = None  # raised by the step loop, as if it had emitted itself
        self.steps = 0
        self.migrator: Migrator | None = None
        # A real engine's step takes milliseconds of compute: run it on a worker thread so sockets stay
        # served. The engine is only ever touched between steps, from the event loop thread.
        self.executor = (ThreadPoolExecutor(1, thread_name_prefix="engine", initializer=self._init_engine_thread)
                         if getattr(engine, "blocking_step", False) else None)
        if self.executor is not None:
            # The step thread runs Python between its kernels and holds the GIL meanwhile; by default a
            # waiting thread gets it after up to 5 ms. The event loop serves sockets (tokens, migration
            # handshakes, whose latency is downtime): let it in sooner.
            sys.setswitchinterval(0.0005)
        self.last_load = engine.load()
        self.phases = metrics.RequestPhases()  # queue, prefill and decode times of the requests held here
        self.preemptions = metrics.PreemptionCounter(M_PREEMPTIONS, self.last_load.preemptions)
        self.wake = asyncio.Event()
        self.load_changed = asyncio.Event()
        self.accepting = True
        self.draining = ""  # the reason while the manager has us draining
        self.elsewhere = True  # (while draining) another instance takes requests
        self.cordoned = False
        self.stop_reason = "SIGTERM"
        self.started = time.monotonic()
        self.stop = asyncio.Event()
        self.instance_id = self.ic.id
        self.request_address = ""
        self.metrics_address = ""
        self.report_seq = 0

    def _init_engine_thread(self) -> None:
        """(Engine thread, first) Lower this thread's priority by ``instance.engine_nice`` (Linux: niceness is
        per thread, and threads it starts inherit it), then the engine's own set-up."""
        if self.ic.engine_nice:
            tid = threading.get_native_id()
            try:
                os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + self.ic.engine_nice)
            except OSError as exc:
                log.warning("instance.engine_nice=%d not applied: %s", self.ic.engine_nice, exc)
        init = getattr(self.engine, "init_thread", None)
        if init is not None:
            init()

    # ------------------------------------------------------------------ token path

    def _send(self, address: str, msg: wire.Message) -> None:
        self.proxies.send(address, msg)

    def _tell_manager(self, msg: wire.Message) -> None:
        # Never wait on the manager: while it is away, reports are dropped, and it will ask us to register.
        if not runtime.send_now(self.manager, wire.encode(msg)):
            log.debug("manager unreachable or its queue full; dropped a %s", type(msg).__name__)

    def emit(self, outputs: list[wire.TokenOut]) -> None:
        by_proxy: dict[str, list[wire.TokenOut]] = {}
        advance = self.requests.advance
        for out in outputs:
            entry = advance(out.request_id, out.index, out.finish_reason is not None)
            if entry is None:
                continue
            out.epoch = entry.epoch
            by_proxy.setdefault(entry.reply_to, []).append(out)
            if out.finish_reason is not None:
                M_FINISHED.labels(out.finish_reason).inc()
        for address, batch in by_proxy.items():
            self._send(address, wire.TokenBatch(self.instance_id, batch))
        M_TOKENS.inc(len(outputs))

    def fail(self, request_id: str, address: str, message: str, retryable: bool, status: int = 503) -> None:
        self._send(address, wire.RequestFailed(request_id, self.instance_id, message, retryable, status))

    def announce_move(self, request_id: str, address: str, instance_id: str, request_address: str, epoch: int,
                      from_index: int) -> None:
        """Tell the owning proxy that a request's tokens (from ``from_index``, of ``epoch``) and its aborts now
        go through ``instance_id``: sent by a migration's destination at its commit and by the source once
        it knows, so that the proxy learns it even if one of the two dies."""
        self._send(address, wire.Moved(request_id, instance_id, request_address, epoch, from_index))

    def reply_peer(self, identity: bytes, msg: wire.Message) -> None:
        if not runtime.send_now(self.router, [identity, wire.encode(msg)]):
            log.warning("a migration peer's queue is full; dropped a %s", type(msg).__name__)

    # ------------------------------------------------------------------ requests

    def apply_inbox(self) -> None:
        inbox, self.inbox = self.inbox, []
        for msg in inbox:
            if isinstance(msg, wire.Abort):
                self.on_abort(msg)
                continue
            if self.migrator is not None and self.migrator.receiving(msg.request_id):
                # A failover of a request we were receiving by migration (its source died): the proxy's new
                # placement wins; drop the reservation first, then take the request (counted then).
                self.migrator.spawn(self._after_reservation(msg))
                continue
            # The proxy counts this dispatch as ours until a heartbeat's load shows it (wire.Heartbeat.taken).
            self.taken[msg.reply_to] = self.taken.get(msg.reply_to, 0) + 1
            if not self.accepting or (self.draining and self.elsewhere):
                M_REDISPATCHED.inc()
                self._send(msg.reply_to, wire.Redispatch(msg.request_id, self.instance_id,
                                                         "shutting down" if not self.accepting else "draining"))
                continue
            held = self.requests.get(msg.request_id)
            if held is not None and held.epoch < msg.epoch and not held.migrating:
                self.abort_local(msg.request_id)  # an older copy the proxy gave up on: the new placement wins
            try:
                self.engine.add_request(EngineRequest(msg.request_id, msg.prompt_token_ids, msg.sampling,
                                                      msg.arrival_time or time.time(), msg.priority,
                                                      list(msg.output_token_ids)))
            except EngineError as exc:
                M_REJECTED.inc()
                self.fail(msg.request_id, msg.reply_to, str(exc), False, status=400)
                continue
            M_REQUESTS.inc()
            if msg.output_token_ids:
                M_FAILOVERS_IN.inc()
                log.info("request %s failed over to us: continues at token %d (epoch %d)", msg.request_id,
                         len(msg.output_token_ids), msg.epoch)
            self.requests.admit(msg.request_id, msg.reply_to, msg.epoch, len(msg.output_token_ids))
            self.phases.admitted(msg.request_id)

    async def _after_reservation(self, msg: wire.Submit) -> None:
        await self.migrator.cancel_incoming(msg.request_id)
        self.inbox.append(msg)
        self.wake.set()

    def on_abort(self, msg: wire.Abort) -> None:
        action = self.requests.abort(msg.request_id, msg.epoch)
        if action is AbortAction.HERE:
            self.abort_local(msg.request_id)
        elif action is AbortAction.FOLLOW and self.migrator is not None:
            self.migrator.forward_abort(msg.request_id, msg.epoch)

    def abort_local(self, request_id: str) -> bool:
        self.requests.forget(request_id)
        self.phases.drop(request_id)
        if not self.engine.abort_request(request_id):
            return False
        M_FINISHED.labels("abort").inc()
        log.debug("request %s aborted", request_id)
        return True

    async def serve_requests(self) -> None:
        async for batch in runtime.receive(self.router, multipart=True):
            for frames in batch:
                msg = wire.decode(frames[-1]) if len(frames) == 2 else None
                if isinstance(msg, (wire.MigStage, wire.MigAbort, wire.PrefixQuery)):
                    self.migrator.on_peer_message(frames[0], msg)
                    continue
                if isinstance(msg, wire.ProxyAlive):
                    self.proxies.seen(msg.token_address)
                    continue
                if isinstance(msg, wire.Submit):
                    self.proxies.seen(msg.reply_to)
                elif not isinstance(msg, wire.Abort):
                    M_BAD_FRAMES.inc()
                    if msg is not None or len(frames) != 2:
                        log.warning("dropped an unexpected message on the request socket")
                    continue
                self.inbox.append(msg)
            self.wake.set()

    # ------------------------------------------------------------------ engine loop

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
        if self.list_queries or time.monotonic() < self.rows_until:
            self.rows, self.rows_at = self.engine.requests(), time.monotonic()
        if self.list_queries:
            for qid, arrived in self.list_queries:
                self.answer_listing(qid, arrived, self.rows)
            self.list_queries.clear()
        self.proxies.flush()
        self.last_load = self.current_load()
        self.load_changed.set()

    def on_list_requests(self, qid: int) -> None:
        """A request listing: during steps, answered now from the rows of the last step or boundary when they
        are kept and nothing waits for the boundary (the step in flight may be long; nothing but steps has
        touched the engine since), else at the next boundary: a request, an abort (a fenced copy, say) or an
        engine call (a migration's commit) that waits for it must be in the answer, as it would be there."""
        now = time.monotonic()
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
        M_QUERY.observe(time.monotonic() - arrived)
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
        return load

    def _step(self):
        self.steps += 1
        hang_at = self.faults.get("hang_step_after")
        if hang_at and self.steps >= hang_at:
            log.warning("fault injection: this engine step never ends")
            while True:
                time.sleep(3600)
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
            watchdog.step_started = time.monotonic()
            result = self._step()
            watchdog.step_started = 0.0
            step_s = clock() - start
            now = time.monotonic()
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
            self.rows, self.rows_at = rows, time.monotonic()
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
        ``instance.min_step_s`` (every step padded to it)."""
        loop_time = time.perf_counter
        watchdog = self.watchdog
        start = loop_time()
        watchdog.step_started = time.monotonic()
        if self.executor is not None:
            self.stepping = True  # engine calls from coroutines wait for the boundary meanwhile
            result = await asyncio.get_running_loop().run_in_executor(self.executor, self._step)
            self.stepping = False  # (left set if cancelled: the thread may still be stepping)
        else:
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

    # ------------------------------------------------------------------ manager

    def register_msg(self) -> wire.Register:
        return wire.Register(
            instance_id=self.instance_id, host=self.ic.host or socket.gethostname(), pid=os.getpid(),
            request_address=self.request_address, backend=self.engine.backend, model=self.cfg.model.name,
            load=self.last_load, metrics_address=self.metrics_address, max_model_len=self.engine.max_model_len,
            drain_reason="stopping" if not self.accepting else self.draining, cordoned=self.cordoned,
            uptime_s=round(time.monotonic() - self.started, 3),
        )

    async def serve_manager(self) -> None:
        while True:
            frame = await self.manager.recv()
            msg = wire.decode(frame)
            if isinstance(msg, wire.RegisterAck):
                if not msg.accepted and msg.final:
                    raise runtime.StartupError(f"the manager refused our registration: {msg.reason}")
                if not msg.accepted:
                    log.info("manager asks us to register (%s)", msg.reason)
                    self._tell_manager(self.register_msg())
            elif isinstance(msg, wire.ListRequests):
                self.on_list_requests(msg.query_id)
            elif isinstance(msg, wire.MigrateStart):
                self.migrator.spawn(self.migrate_command(msg))
            elif isinstance(msg, wire.SetDraining):
                self.set_draining(msg)
            elif isinstance(msg, wire.Shutdown):
                log.info("the manager asks us to stop (%s)", msg.reason or "no reason given")
                self.stop_reason = f"stopped by the manager ({msg.reason})" if msg.reason else "stopped by the manager"
                self.stop.set()
            else:
                M_BAD_FRAMES.inc()

    def set_draining(self, msg: wire.SetDraining) -> None:
        was = self.draining
        self.draining = (msg.reason or "operator") if msg.draining else ""
        self.cordoned = msg.cordoned
        self.elsewhere = msg.elsewhere
        self.load_changed.set()  # proxies dispatching from their own views hear of it with the next report
        if self.draining and not was:
            log.info("draining (%s): running requests migrate out; queued ones go back to their proxies%s",
                     self.draining, "" if msg.elsewhere else " once another instance takes requests")
            if msg.elsewhere:  # else the manager's drain orders give them back when there is a destination
                self.boundary(self.redispatch_queued)
        elif was and not self.draining:
            log.info("no longer draining")

    def redispatch_queued(self, only: set[str] | None = None) -> int:
        """Give queued requests that produced nothing back to their proxies, which dispatch them again
        (at a step boundary: the engine is touched). ``only``: just these. Returns how many went."""
        gone = 0
        for r in self.engine.requests():
            rid = r.request_id
            entry = self.requests.get(rid)
            if (r.state != "waiting" or r.output_tokens or entry is None or entry.emitted
                    or (only is not None and rid not in only)):
                continue
            self.requests.forget(rid)
            self.phases.drop(rid)
            self.engine.abort_request(rid)
            self._send(entry.reply_to, wire.Redispatch(rid, self.instance_id, self.draining or "rebalancing"))
            M_REDISPATCHED.inc()
            gone += 1
        if gone:
            log.info("gave %d queued request(s) back for re-dispatch", gone)
        return gone

    async def migrate_command(self, msg: wire.MigrateStart) -> None:
        """The manager's (or an operator's) order: migrate these requests, or ``count`` of our choice."""
        if msg.request_ids:
            rids = list(msg.request_ids)
        else:
            cached = await self.cached_at_destination(msg) if self.engine.prefix_caching else None
            rids = await self.boundary(lambda: self.choose_migrants(msg, cached))
        slots = asyncio.Semaphore(self.cfg.migration.max_in_flight)

        async def one(rid: str) -> wire.MigrationOutcome:
            async with slots:
                return await self.migrator.migrate_out(rid, msg.dst, msg.dst_address, msg.blocking)

        outcomes = await asyncio.gather(*(one(r) for r in rids))
        self._tell_manager(wire.MigrateResult(msg.query_id, self.instance_id, list(outcomes)))

    async def cached_at_destination(self, msg: wire.MigrateStart) -> dict[str, int]:
        """With prefix caching: of the requests that could go, the leading blocks the destination holds
        already (asked of it, wire.PrefixQuery): blocks a move would not send, which selection weighs."""

        def prompts() -> dict[str, list[int]]:
            out: dict[str, list[int]] = {}
            budget = PREFIX_QUERY_TOKENS
            requests = self.engine.requests()
            keep = self._keep(msg, requests)
            bs = self.engine.block_size
            for r in requests:
                if r.state != "running" or r.request_id in keep or r.prompt_tokens <= bs:
                    continue
                whole = r.prompt_tokens // bs * bs
                if whole > budget:
                    continue
                # one token past the whole blocks, as the destination's first hold sees the prompt (a cache
                # hit never covers a prompt's last token)
                out[r.request_id] = list(self.engine.migrating_request(r.request_id).prompt_token_ids[:whole + 1])
                budget -= whole
            return out

        asked = await self.boundary(prompts)
        if not asked:
            return {}
        hits = await self.migrator.prefix_hits(msg.dst_address, list(asked.values()))
        return {rid: n for rid, n in zip(asked, hits) if n}

    def _keep(self, msg: wire.MigrateStart, requests: list[wire.RequestLoad]) -> set[str]:
        """Requests that must stay for this order: already migrating, not ours, or (balancing) just arrived."""
        keep = keep_for(msg, self.requests.migrating(), self.requests.arrivals(), time.monotonic())
        return keep | {r.request_id for r in requests if r.request_id not in self.requests}

    def choose_migrants(self, msg: wire.MigrateStart, cached: dict[str, int] | None = None) -> list[str]:
        """The requests to send, by the order's selection policy (an operator's ``--from --count``: lower
        priority, then fewer blocks to move, with no balance check). Queued ones chosen are re-dispatched
        right here; the running ones are returned for migration."""
        requests = self.engine.requests()
        chosen = migrants_for(msg, requests, self._keep(msg, requests), self.last_load, self.engine.block_size, cached)
        queued = {c.request_id for c in chosen if c.redispatch}
        if queued:
            self.redispatch_queued(queued)
        return [c.request_id for c in chosen if not c.redispatch]

    async def report_loop(self) -> None:
        """Report on change, at most once per min interval, and at least once per heartbeat."""
        heartbeat = self.cfg.manager.heartbeat_interval_s
        while True:
            await runtime.wait_event(self.load_changed, heartbeat)
            self.load_changed.clear()
            load = self.last_load
            self.report_seq += 1
            self._tell_manager(wire.LoadReport(self.instance_id, self.report_seq, load))
            self.beat_proxies(not self.watchdog.stalled)
            M_BLOCKS_USED.set(load.blocks_used)
            M_BLOCKS_TOTAL.set(load.blocks_total)
            M_KV_USAGE.set(load.blocks_used / load.blocks_total if load.blocks_total else 0.0)
            M_RUNNING.set(load.running)
            M_WAITING.set(load.waiting)
            self.preemptions.update(load.preemptions)
            if len(self.phases) > len(self.requests):  # some left by migration or a failure
                self.phases.prune(self.requests)
            await asyncio.sleep(self.ic.load_report_min_interval_s)

    async def proxy_loop(self) -> None:
        """Each heartbeat: tell every proxy we serve that we are alive (and whether healthy); abort the
        requests of proxies that are gone. Also the event loop's tick for the watchdog."""
        period = min(self.cfg.manager.heartbeat_interval_s, self.ic.step_timeout_s / 4)
        due = time.monotonic()
        while True:
            now = time.monotonic()
            M_BEAT_LATE.observe(max(now - due, 0.0))
            due = now + period
            self.watchdog.loop_beat = now
            healthy = not self.watchdog.stalled
            M_HEALTHY.set(1 if healthy else 0)
            if not healthy and not self.last_load.stalled:
                self.last_load = msgspec.structs.replace(self.last_load, stalled=True)
                self.load_changed.set()  # the manager stops dispatching to us now, not at the next step
            self.beat_proxies(healthy)
            for address, why in self.proxies.gone(self.requests.proxies()):
                self.boundary(lambda address=address, why=why: self.abort_orphans(address, why))
            await asyncio.sleep(period)

    def beat_proxies(self, healthy: bool) -> None:
        """Liveness and load to every proxy we serve: each heartbeat, and (from the report loop) on every load
        change, so that proxies dispatch from a current view. ``taken`` and the load are of the same step
        boundary, which lets a proxy retire exactly the dispatches the load already counts."""
        accepting = self.accepting and not self.draining and not self.cordoned
        self.proxies.heartbeat(wire.Heartbeat(self.instance_id, self.request_address, healthy, self.last_load,
                                              accepting), self.taken)

    def abort_orphans(self, address: str, why: str) -> int:
        rids = self.requests.of_proxy(address)
        n = sum(1 for rid in rids if self.requests.abort(rid) is AbortAction.HERE and self.abort_local(rid))
        if rids:
            M_ORPHANED.inc(n)
            log.warning("proxy %s is gone (%s): aborted its %d request(s)", address, why, n)
        self.proxies.drop(address)
        self.taken.pop(address, None)
        return n

    # ------------------------------------------------------------------ life cycle

    async def run(self) -> None:
        self.sec.check_bind("instance.request_address", self.ic.request_address)
        self.sec.check_bind("migration.kv_host", self.cfg.migration.kv_host)
        self.request_address = runtime.bind(self.router, self.ic.request_address)
        if self.ic.advertise_address:
            self.request_address = self.ic.advertise_address
        if not self.instance_id:
            self.instance_id = f"{self.ic.host or socket.gethostname()}-{self.request_address.rsplit(':', 1)[-1]}"
        metrics.bind("instance", self.cfg.model.name, self.instance_id)
        try:
            self.migrator = Migrator(self, self.cfg.migration, self.engine, self.requests, self.boundary, self.faults)
        except (RuntimeError, ValueError, OSError) as exc:  # the KV store's port is taken, or the host does not resolve
            raise runtime.StartupError(f"cannot listen for KV transfer on {self.cfg.migration.kv_host}:"
                                       f"{self.cfg.migration.kv_port}: {exc}") from None
        self.metrics_address = runtime.start_metrics_server(self.ic.metrics_port, self.ic.metrics_host,
                                                            security.metrics_token(self.cfg))
        runtime.connect(self.manager, self.cfg.manager.address)
        self._tell_manager(self.register_msg())
        load = self.engine.load()
        log.info("instance %s serving on %s (backend %s, %d blocks of %d tokens, manager %s, KV transfer %s, "
                 "metrics %s)", self.instance_id, self.request_address, self.engine.backend, load.blocks_total,
                 load.block_size, self.cfg.manager.address, self.migrator.kv.address, self.metrics_address or "off")
        runtime.install_stop_signals(asyncio.get_running_loop(), self.stop)
        runtime.sd_notify("READY=1")
        self.watchdog.start()
        tasks = [asyncio.create_task(c) for c in
                 (self.serve_requests(), self.step_loop(), self.serve_manager(), self.report_loop(), self.proxy_loop())]
        stopped = asyncio.create_task(self.stop.wait())
        done, _ = await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
        failure = next((t.exception() for t in done if t is not stopped and t.exception() is not None), None)
        if failure is not None:
            log.error("instance loop failed: %r", failure)
        await self.shutdown(tasks, self.stop_reason if failure is None else f"failed: {failure!r}",
                            grace=self.ic.shutdown_grace_s if failure is None else 0.0)
        if failure is not None:
            raise SystemExit(1)  # let systemd's Restart=on-failure see it

    async def shutdown(self, tasks: list[asyncio.Task], reason: str, grace: float) -> None:
        """Drain, then stop: leave the dispatch set and, for a grace period, let the manager migrate running
        requests out and give queued ones back for re-dispatch (its drain orders do both, once another
        instance can take them), or let them finish; then fail what is left."""
        runtime.sd_notify("STOPPING=1")
        self.accepting = False
        self._tell_manager(wire.Goodbye(self.instance_id, reason))
        log.info("stopping: %d requests in flight, draining for up to %.1fs", len(self.requests), grace)
        deadline = time.monotonic() + grace
        while (len(self.requests) or (self.migrator is not None and self.migrator.busy)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.watchdog.stop()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.migrator is not None:
            await self.migrator.close()
        if self.executor is not None:
            self.executor.shutdown(wait=True)  # a step in flight finishes before we touch the engine
        for rid, entry in list(self.requests.items()):
            self.engine.abort_request(rid)
            # Retryable: the proxy continues the request elsewhere from the tokens it already has.
            self.fail(rid, entry.reply_to, f"instance {self.instance_id} stopped", retryable=True)
        self.engine.shutdown()
        self.proxies.close()  # with its linger: the failures above still go out
        self.sec.close()
        self.ctx.destroy(linger=0)  # closes what is left; term() would wait on any socket still open
        log.info("stopped")


app = typer.Typer(add_completion=False, help="llumnix-instance: one model instance (engine + llumlet).")


@app.command()
def main(
    config: Annotated[Optional[str], typer.Option("--config", "-c", help="llumnix.toml (default: $LLUMNIX_CONFIG)")] = None,
    id: Annotated[Optional[str], typer.Option("--id", help="instance id (instance.id)")] = None,
    backend: Annotated[Optional[str], typer.Option(help="engine backend (instance.backend)")] = None,
    manager: Annotated[Optional[str], typer.Option(help="manager address (manager.address)")] = None,
    request_address: Annotated[Optional[str], typer.Option(help="address to bind for requests (instance.request_address)")] = None,
    metrics_port: Annotated[Optional[int], typer.Option(help="Prometheus port; 0 any, -1 off (instance.metrics_port)")] = None,
    log_level: Annotated[Optional[str], typer.Option(help="debug, info, warning, error (instance.log_level)")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override any setting: section.key=value")] = None,
) -> None:
    """Run one model instance until SIGTERM."""
    cfg = load_or_exit("llumnix-instance", config, set_, {
        "instance.id": id, "instance.backend": backend, "manager.address": manager,
        "instance.request_address": request_address, "instance.metrics_port": metrics_port,
        "instance.log_level": log_level,
    })
    runtime.setup_logging(cfg.instance.log_level, "llumnix-instance")
    try:  # before loading a model for minutes: are the keys and addresses acceptable?
        pre = security.Security(cfg.security, "instance")
        pre.check_bind("instance.request_address", cfg.instance.request_address)
        pre.check_bind("migration.kv_host", cfg.migration.kv_host)
    except runtime.StartupError as exc:
        log.error("cannot start: %s", exc)
        raise typer.Exit(1) from None
    try:
        engine = make_engine(cfg)
    except EngineError as exc:
        log.error("cannot start the %s engine: %s", cfg.instance.backend, exc)
        raise typer.Exit(1) from None
    runtime.exit_on_startup_error("llumnix-instance", lambda: Instance(cfg, engine).run())


def entry() -> None:
    app()


if __name__ == "__main__":
    entry()
