"""The source's side of a move, as a state machine with named states:

    reserve ─▶ pre-copy k ─▶ last ─▶ committed
       │           │           ├───▶ uncertain      (the last stage went out and no answer came)
       └───────────┴───────────┴───▶ aborted-src    (the request finished, was preempted, ... here)
                                     aborted-dst    (the destination refused, died or did not answer)

``reserve`` is stage 0: it tells the destination the request and sends the blocks written so far. Each
``pre-copy`` stage sends the full blocks written since, while the request keeps decoding. ``last`` suspends
the request at a step boundary and sends the rest: that stage is the request's downtime. Which stage is the
last and what each one sends is daemons/stages.py's plan, which the simulator follows too."""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import uuid

import msgspec

from daemons import runtime, stages, wire
from daemons.kvtransfer import TransferError
from daemons.migration.records import Aborted, DestinationFailed, Outgoing, Refused
from daemons.migration.telemetry import M_BYTES, M_DOWNTIME, M_DURATION, M_IN_FLIGHT, M_MIGRATIONS
from daemons.pacing import MIN_DUTY, DutyPacer

log = logging.getLogger("llumnix.migration")


class Phase(enum.Enum):
    RESERVE = "reserve"
    PRECOPY = "pre-copy"
    LAST = "last"
    COMMITTED = "committed"
    ABORTED_SRC = "aborted-src"
    ABORTED_DST = "aborted-dst"
    UNCERTAIN = "uncertain"


class SourceMixin:
    """Of the Migrator: owns ``outgoing``."""

    async def migrate_out(self, request_id: str, dst: str, dst_address: str, blocking: bool = False) -> wire.MigrationOutcome:
        """Move one request to ``dst``; never raises: the outcome says what happened. ``blocking`` skips
        pre-copy (suspend, then copy everything): the stop-and-copy baseline that benchmarks compare with."""
        return await Move(self, request_id, dst, dst_address, blocking).run()

    async def _sent(self, sending: asyncio.Future, dst: str, nbytes: int, paced: bool = False) -> int:
        rate = 1e8 * (MIN_DUTY if paced else 1.0)  # at least 100 MB/s, or that at the lowest duty where paced
        try:
            sent = await asyncio.wait_for(sending, self.cfg.timeout_s + nbytes / rate)
        except (TransferError, asyncio.TimeoutError) as exc:
            raise DestinationFailed(f"KV transfer failed: {str(exc) or 'timed out'}") from None
        M_BYTES.labels("out").inc(sent)
        return sent

    def _resume(self, request_id: str, uncertain: wire.RequestState | None = None) -> None:
        """Undo the suspend. ``uncertain``: the last stage went out and no answer came, so the destination
        may have committed: claim the next epoch here as well and let the proxy keep one of the two."""
        try:
            self.engine.resume(request_id)
        except KeyError:  # aborted by its client while suspended: nothing to resume
            return
        finally:
            self.inst.wake.set()
        if uncertain is not None:
            entry = self.requests.reclaim(request_id)
            if entry is not None:
                log.warning("migration of %s: no answer to its last stage; resuming it here as epoch %d (the "
                            "proxy keeps one copy if the destination committed too)", request_id, entry.epoch)
                self.inst.announce_move(request_id, entry.reply_to, self.inst.instance_id, self.inst.request_address,
                                        entry.epoch, uncertain.emitted)

    def _hand_over(self, request_id: str, dst: str, dst_address: str, state: wire.RequestState) -> None:
        """After the commit: the request lives on the destination; forget it here (late aborts follow it),
        and tell the proxy as well, in case the destination's own word was lost with it."""
        self.engine.drop_migrated(request_id)
        entry = self.requests.hand_over(request_id, dst_address)
        if entry is not None:
            self.inst.announce_move(request_id, entry.reply_to, dst, dst_address, state.epoch + 1, state.emitted)

    def forward_abort(self, request_id: str, epoch: int = 0) -> bool:
        """An abort for a request that moved away goes after it. False if it never moved from here."""
        address = self.requests.moved_to(request_id)
        if address is None:
            return False
        runtime.send_now(self._peer(address), wire.encode(wire.Abort(request_id, epoch)))
        return True


class Move:
    """One request on its way out. ``run`` walks the states; each stage is one ``_stage`` call, and every
    way out of the walk ends in ``_abort`` (a named outcome) or the commit, then ``_release``."""

    def __init__(self, m, request_id: str, dst: str, dst_address: str, blocking: bool):
        self.m = m
        self.request_id, self.dst, self.dst_address, self.blocking = request_id, dst, dst_address, blocking
        self.phase = Phase.RESERVE
        self.out = Outgoing(uuid.uuid4().hex[:16], dst_address, dst=dst)
        self.result = wire.MigrationOutcome(request_id=request_id, src=m.inst.instance_id, dst=dst, outcome="aborted")
        self.sent: list[int] = []  # block ids already at the destination, in order
        self.stage = 0
        self.entry = None  # the request table's entry, marked migrating
        self.lock: asyncio.Lock | None = None
        self.sock = None
        self.state: wire.RequestState | None = None  # the request as suspended for the last stage
        self.last_sent = False  # the last stage went out: from then on only the destination's answer tells
        self.suspended_at = 0.0
        self.committed_at = 0.0
        self.tracer = getattr(m.inst, "tracer", None)  # daemons/tracing.py; None: tracing off
        self.traced: list[tuple] = []  # (stage, kind, start ns, end ns, blocks) with tracing on

    async def run(self) -> wire.MigrationOutcome:
        m = self.m
        start = time.perf_counter()
        self.start_ns = time.time_ns()
        m.outgoing[self.out.mig_id] = self.out
        M_IN_FLIGHT.labels("source").inc()
        try:
            view = await self._reserve()
            while self.phase is not Phase.COMMITTED:
                view = await self._stage(view)
            await m.boundary(lambda: m._hand_over(self.request_id, self.dst, self.dst_address, self.state))
            self.result.outcome, self.result.reason = "committed", ""
            m.committed += 1
        except Exception as exc:  # Aborted; anything else is our bug: report it, keep the request running
            await self._abort(exc)
        finally:
            await self._release()
        return self._report(start)

    async def _reserve(self):
        """Checks, the pair and the socket; the first look at the request. Stage 0 itself is the first
        ``_stage`` (it carries the request and reserves room on the destination)."""
        m = self.m
        if self.dst == m.inst.instance_id:
            raise Aborted("source and destination are the same instance")
        self.entry = m.requests.begin_migration(self.request_id)
        if self.entry is None:
            raise Aborted("the request is not here or is already migrating")
        # One migration at a time per destination: both ends of a pair run its transfers in the order they
        # were posted, so two interleaved migrations could pair one's send with the other's receive.
        await m._dst_locks.setdefault(self.dst, asyncio.Lock()).acquire()
        self.lock = m._dst_locks[self.dst]

        def first_look():
            view = m.engine.migration_view(self.request_id)
            return None if view is None else (m.engine.migrating_request(self.request_id), view)

        first = await m.boundary(first_look)
        if first is None or self.request_id not in m.requests:
            raise Aborted("the request is not running here (finished, waiting or unknown)")
        info, view = first
        self.info = msgspec.structs.replace(info, reply_to=self.entry.reply_to, traceparent=self.entry.traceparent)
        self.kb = m.engine.kv_blocks()
        self.chunk_blocks = max(1, m.cfg.chunk_bytes // self.kb.block_nbytes)
        self.pair = m.kv.source_pair(m.inst.instance_id, self.dst, self.dst_address)
        m.pair_used(self.dst)
        self.sock = m._peer(self.dst_address)
        sock = self.sock
        m.relay_rendezvous(self.pair, lambda msg: runtime.send_now(sock, wire.encode(msg)))
        # Pacing and one-message chunks alike for this process's pairs and a tensor-parallel engine's ranks
        # (each rank's pair reads the duty the engine last handed it; both ends have the same TP size).
        self.pacer = DutyPacer(m.cfg.max_decode_slowdown) if m.cfg.max_decode_slowdown > 0 else None
        return view

    async def _stage(self, view):
        """One stage: reserve (stage 0), a pre-copy stage or the last one. Returns the request's next view."""
        m, cfg, bs = self.m, self.m.cfg, self.m.engine.block_size
        stage_ns = time.time_ns() if self.tracer is not None else 0
        if self.stage > 0:
            view = await m.boundary(lambda: m.engine.migration_view(self.request_id))
            if view is None:
                raise Aborted("the request finished or was preempted on the source during pre-copy")
        if view.block_ids[:len(self.sent)] != self.sent:
            raise Aborted("the request was preempted on the source (its blocks changed)")
        last = stages.is_last(view.computed_tokens, len(self.sent), self.stage, bs, cfg.last_stage_max_blocks,
                              cfg.max_stages, self.blocking)
        state = None
        if last:
            view, state = await self._suspend()
        # Pre-copy sends full blocks only and reserves headroom for the last stage; the last stage sends the
        # rest, of its partial block only the written token slots where the KV's bytes say which those are.
        planned = stages.plan(view.computed_tokens, len(self.sent), last, bs, cfg.last_stage_max_blocks,
                              self.info.max_total, getattr(self.kb, "token_slots", False))
        ids = view.block_ids[planned.first_block:planned.upto]
        # The last stage is the request's downtime: one round trip (MigStage, MigDone). The blocks go right
        # behind the message; the destination, which knows the pair and the request by now, grows its
        # reservation first if the request outgrew it (then Gloo waits for its receive).
        await_ready = not (last and self.stage > 0)
        msg = wire.MigStage(mig_id=self.out.mig_id, stage=self.stage, tokens=planned.tokens, first_block=len(self.sent),
                            n_blocks=len(ids), last=last, state=state, chunk_blocks=self.chunk_blocks,
                            await_ready=await_ready, tail_tokens=planned.tail_tokens)
        if self.stage == 0:
            msg = msgspec.structs.replace(msg, request=self.info, kv_spec=self.kb.spec, src=m.inst.instance_id,
                                          kv_address=m.kv.address, pair_key=self.pair.key)
        t_msg = time.perf_counter()
        if not runtime.send_now(self.sock, wire.encode(msg)):
            raise DestinationFailed("the destination's socket is not accepting messages")
        self.last_sent = last
        if await_ready:
            ready = await m._reply(self.out, wire.MigReady, self.stage,
                                   "the reservation" if self.stage == 0 else f"stage {self.stage}")
            if self.stage == 0 and 0 < ready.cached_blocks <= len(ids):
                # The destination's prefix cache holds the request's first blocks: they stay out of the copy.
                self.result.cached_blocks = ready.cached_blocks
                self.sent += ids[:ready.cached_blocks]
                ids = ids[ready.cached_blocks:]
        t_ready = time.perf_counter()
        if last:
            self.result.last_stage_blocks = len(ids)
        nbytes = len(ids) * self.kb.block_nbytes
        # The cap spares the engine during pre-copy; the last stage is downtime: never paced. Its few blocks
        # go as one message per chunk (kvtransfer: fewer Gloo rounds).
        paced = self.pacer if ids and not last else None
        duty = (lambda: paced.duty) if paced else None
        sending = (asyncio.wrap_future(self.pair.send(self.kb, ids, self.chunk_blocks, 0.0 if last else cfg.bandwidth_limit_mbps * 1e6,
                                                      planned.tail_tokens, duty=duty, one_message=last))
                   if ids else None)
        if sending is not None and await_ready:
            if paced:
                m._pacers[self.out.mig_id] = paced
            try:
                self.result.bytes += await m._sent(sending, self.dst, nbytes, paced is not None)
            finally:
                m._pacers.pop(self.out.mig_id, None)
        t_sent = time.perf_counter()
        await m._reply(self.out, wire.MigDone, self.stage, "the commit" if last else f"stage {self.stage}'s copy")
        t_done = time.perf_counter()
        if sending is not None and not await_ready:  # done: the destination got it all
            self.result.bytes += await m._sent(sending, self.dst, nbytes)
        log.debug("migration %s stage %d (%s): %d blocks; ready %.2f ms, copy %.2f ms, done %.2f ms%s",
                  self.out.mig_id, self.stage, self.phase.value, len(ids), (t_ready - t_msg) * 1e3,
                  (t_sent - t_ready) * 1e3, (t_done - t_sent) * 1e3,
                  f"; duty {paced.duty:.2f} ({paced.over}/{paced.steps} steps over)" if paced else "")
        self.sent += ids
        if self.tracer is not None:
            kind = "last" if last else "reserve" if self.stage == 0 else "pre-copy"
            self.traced.append((self.stage, kind, stage_ns, time.time_ns(), len(ids)))
        self.stage += 1
        if last:
            self.committed_at = t_done  # the request runs on the destination
            self.phase = Phase.COMMITTED
        else:
            self.phase = Phase.PRECOPY
        return view

    async def _suspend(self):
        """Enter the last stage: suspend the request at a step boundary, with its state as of then."""
        m = self.m

        def suspend():
            v = m.engine.migration_view(self.request_id)
            return (v, m.engine.suspend(self.request_id)) if v is not None else None

        got = await m.boundary(suspend)
        if got is None:
            raise Aborted("the request finished or was preempted on the source before the last stage")
        self.phase = Phase.LAST
        view, state = got
        self.state = state = msgspec.structs.replace(state, epoch=self.entry.epoch)
        self.suspended_at = time.perf_counter()
        self.result.resumed_at = state.emitted
        if view.block_ids[:len(self.sent)] != self.sent:
            raise Aborted("the request was preempted on the source (its blocks changed)")
        return view, state

    async def _abort(self, exc: Exception) -> None:
        """Name the outcome, tell the destination, and resume the request here if it was suspended."""
        m = self.m
        if not isinstance(exc, Aborted):
            log.exception("migration of %s failed unexpectedly", self.request_id)
        refused = isinstance(exc, Refused)
        uncertain = self.last_sent and self.suspended_at and not refused
        self.phase = (Phase.UNCERTAIN if uncertain else
                      Phase.ABORTED_DST if isinstance(exc, DestinationFailed) else Phase.ABORTED_SRC)
        self.result.reason = str(exc) if isinstance(exc, Aborted) else f"internal error: {exc!r}"
        self.result.resumed_at = -1
        if self.sock is not None:
            runtime.send_now(self.sock, wire.encode(wire.MigAbort(self.out.mig_id, self.result.reason)))
            # The pair may be half-way through a rendezvous or a transfer the peer gave up on: start the next
            # migration to this peer on a fresh pair.
            m.kv.forget(self.dst)
        if self.suspended_at:
            if uncertain:
                self.result.reason += ("; it resumed here, and if the destination committed after all, the proxy "
                                       "keeps one of the two copies")
            await m.boundary(lambda: m._resume(self.request_id, self.state if uncertain else None))
        m.aborted += 1

    async def _release(self) -> None:
        m = self.m
        if self.lock is not None:
            self.lock.release()
        del m.outgoing[self.out.mig_id]
        m.inst.wake.set()  # refresh the load report at the next boundary
        if self.entry is not None and m.requests.end_migration(self.entry):  # its client left meanwhile
            if self.phase is Phase.COMMITTED:
                m.forward_abort(self.request_id)
            else:
                await m.boundary(lambda: m.inst.abort_local(self.request_id))
        M_IN_FLIGHT.labels("source").dec()

    def _trace(self, r: wire.MigrationOutcome) -> None:
        """The migration's span under the request's (its proxy's ``llumnix.request``), one child per stage."""
        tr = self.tracer
        parent = tr.context(self.entry.traceparent)
        if parent is None:
            return
        span = tr.start("llumnix.migration", parent, self.start_ns, {
            "llumnix.request_id": self.request_id, "llumnix.migration.src": r.src, "llumnix.migration.dst": r.dst,
            "llumnix.migration.outcome": r.outcome, "llumnix.migration.stages": r.stages,
            "llumnix.migration.blocks": r.blocks, "llumnix.migration.cached_blocks": r.cached_blocks,
            "llumnix.migration.bytes": r.bytes, "llumnix.migration.downtime_ms": round(r.downtime_ms, 3)})
        inner = tr.child_context(span)
        for stage, kind, t0, t1, blocks in self.traced:
            tr.record(f"llumnix.migration.stage {stage}", inner, t0, t1,
                      {"llumnix.migration.stage": stage, "llumnix.migration.stage_kind": kind,
                       "llumnix.migration.blocks": blocks, "llumnix.migration.downtime": kind == "last"})
        tr.end(span, error="" if r.outcome == "committed" else f"{r.outcome}: {r.reason}"[:200])

    def _report(self, start: float) -> wire.MigrationOutcome:
        r = self.result
        r.stages, r.blocks, r.ended = self.stage, len(self.sent), self.phase.value
        end = time.perf_counter()
        r.total_ms = (end - start) * 1e3
        if self.phase is Phase.COMMITTED and self.suspended_at:
            r.downtime_ms = (self.committed_at - self.suspended_at) * 1e3
            M_DOWNTIME.observe(self.committed_at - self.suspended_at)
        M_DURATION.observe(end - start)
        M_MIGRATIONS.labels(r.outcome).inc()
        if self.tracer is not None and self.entry is not None and self.entry.traceparent:
            self._trace(r)
        log.info("migration of %s to %s %s%s: %d stages, %d blocks, %.1f MB, downtime %.2f ms, total %.1f ms",
                 self.request_id, self.dst, r.ended, f" ({r.reason})" if r.reason else "", r.stages, r.blocks,
                 r.bytes / 1e6, r.downtime_ms, r.total_ms)
        return r
