"""One request on its way out, as a state machine with named states:

    reserve ─▶ pre-copy k ─▶ last ─▶ committed
       │           │           ├───▶ uncertain      (the last stage went out and no answer came)
       └───────────┴───────────┴───▶ aborted-src    (the request finished, was preempted, ... here)
                                     aborted-dst    (the destination refused, died or did not answer)

``reserve`` is stage 0: it tells the destination the request and sends the blocks written so far. Each
``pre-copy`` stage sends the full blocks written since, while the request keeps decoding. ``last`` suspends
the request at a step boundary and sends the rest: that stage is the request's downtime. Which stage is the
last and what each one sends is daemons/stages.py's plan, which the simulator follows too.

Each stage reads as plan → send → account (``Move._stage``). A Move works through its source role
(daemons/migration/source.py ``Source``) and nothing else of the Migrator.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import uuid
from dataclasses import dataclass, field

import msgspec

from daemons import stages, wire
from daemons.clock import Clock
from daemons.migration.records import Aborted, DestinationFailed, Outgoing, Refused
from daemons.migration.source import Source
from daemons.migration.telemetry import M_DOWNTIME, M_DURATION, M_IN_FLIGHT, M_MIGRATIONS, M_RELEASED
from daemons.pacing import DutyPacer

log = logging.getLogger("llumnix.migration")


def now_ns(clock: Clock) -> int:
    """Wall-clock nanoseconds, as trace spans take them."""
    return int(clock.time() * 1e9)


class Phase(enum.Enum):
    RESERVE = "reserve"
    PRECOPY = "pre-copy"
    LAST = "last"
    COMMITTED = "committed"
    ABORTED_SRC = "aborted-src"
    ABORTED_DST = "aborted-dst"
    UNCERTAIN = "uncertain"


@dataclass
class Stage:
    """One stage: its plan (daemons/stages.py), the blocks it sends and, for the last, the request's state.
    ``ids`` loses the leading blocks the destination's prefix cache holds (stage 0's MigReady)."""

    number: int
    plan: stages.StagePlan
    ids: list[int]
    state: wire.RequestState | None = None
    started_ns: int = 0
    timings: dict[str, float] = field(default_factory=dict)  # when the message, MigReady, copy, MigDone ended

    @property
    def last(self) -> bool:
        return self.plan.last

    @property
    def await_ready(self) -> bool:
        """The last stage is the request's downtime: one round trip (MigStage, MigDone), the blocks right
        behind the message; the destination, which knows the pair and the request by now, grows its
        reservation first if the request outgrew it (then Gloo waits for its receive)."""
        return not (self.last and self.number > 0)

    @property
    def kind(self) -> str:
        return "last" if self.last else "reserve" if self.number == 0 else "pre-copy"


class Move:
    """One request on its way out. ``run`` walks the states; each stage is one ``_stage`` call, and every
    way out of the walk ends in ``_abort`` (a named outcome) or the commit, then ``_release``."""

    def __init__(self, src: Source, request_id: str, dst: str, dst_address: str, blocking: bool = False,
                 paced: bool = True):
        """``blocking``: no pre-copy (suspend, then copy everything), the stop-and-copy baseline. ``paced``: False
        for a copy that must end soon whatever it costs the source's steps (a handover out of a prefill instance)."""
        self.paced = paced
        self.src = src
        self.clock = src.clock
        self.request_id, self.dst, self.dst_address, self.blocking = request_id, dst, dst_address, blocking
        self.phase = Phase.RESERVE
        self.out = Outgoing(uuid.uuid4().hex[:16], dst_address, dst=dst)
        self.result = wire.MigrationOutcome(request_id=request_id, src=src.host.instance_id, dst=dst, outcome="aborted")
        self.sent: list[int] = []  # block ids already at the destination, in order
        self.stage = 0
        self.entry = None  # the request table's entry, marked migrating
        self.lock: asyncio.Lock | None = None
        self.pair = None
        self.state: wire.RequestState | None = None  # the request as suspended for the last stage
        self.last_sent = False  # the last stage went out: from then on only the destination's answer tells
        self.suspended_at = 0.0
        self.committed_at = 0.0
        self.tracer = src.host.tracer  # daemons/tracing.py; None: tracing off
        self.traced: list[tuple] = []  # (stage, kind, start ns, end ns, blocks) with tracing on

    async def run(self) -> wire.MigrationOutcome:
        """Walk the states to the commit or an abort; never raises: the outcome says what happened."""
        src = self.src
        start = self.clock.monotonic()
        self.start_ns = now_ns(self.clock)
        src.opened(self.out)
        M_IN_FLIGHT.labels("source").inc()
        try:
            view = await self._reserve()
            while self.phase is not Phase.COMMITTED:
                view = await self._stage(view)
            await src.boundary(lambda: src.hand_over(self.request_id, self.dst, self.dst_address, self.state))
            self.result.outcome, self.result.reason = "committed", ""
            src.ended(committed=True)
        except Exception as exc:  # Aborted; anything else is our bug: report it, keep the request running
            await self._abort(exc)
        finally:
            await self._release()
        return self._report(start)

    async def _reserve(self):
        """Checks, the pair and the socket; the first look at the request. Stage 0 itself is the first
        ``_stage`` (it carries the request and reserves room on the destination)."""
        src = self.src
        if self.dst == src.host.instance_id:
            raise Aborted("source and destination are the same instance")
        src.peers.revive(self.dst_address)  # ordered after it was declared dead: the manager sees it back
        self.entry = src.requests.begin_migration(self.request_id)
        if self.entry is None:
            raise Aborted("the request is not here or is already migrating")
        lock = src.lock(self.dst)
        await lock.acquire()
        self.lock = lock
        if self.out.dead.is_set():  # declared dead while this move waited for its turn
            raise DestinationFailed(f"destination {self.dst} was declared dead")

        def first_look():
            view = src.engine.migration_view(self.request_id)
            return None if view is None else (src.engine.migrating_request(self.request_id), view)

        first = await src.boundary(first_look)
        if first is None or self.request_id not in src.requests:
            raise Aborted("the request is not running here (finished, waiting or unknown)")
        info, view = first
        self.info = msgspec.structs.replace(info, reply_to=self.entry.reply_to, traceparent=self.entry.traceparent)
        mark = self.entry.slo
        if mark is not None:  # its SLO, and what was measured here, travel: the destination judges it
            self.info = msgspec.structs.replace(self.info, slo_ttft_ms=mark.ttft_s * 1000.0,
                                                slo_tpot_ms=mark.tpot_s * 1000.0, first_token_time=mark.first_time,
                                                first_token_index=mark.first_index)
        self.kb = src.engine.kv_blocks()
        self.chunk_blocks = max(1, src.cfg.chunk_bytes // self.kb.block_nbytes)
        self.pair = src.kv.source_pair(src.host.instance_id, self.dst, self.dst_address)
        src.peers.pair_used(self.dst)
        peers, address = src.peers, self.dst_address
        peers.socket(address)
        peers.relay_rendezvous(self.pair, lambda msg: peers.send(address, msg))
        # Pacing and one-message chunks alike for this process's pairs and a tensor-parallel engine's ranks
        # (each rank's pair reads the duty the engine last handed it; both ends have the same TP size).
        self.pacer = DutyPacer(src.cfg.max_decode_slowdown) if src.cfg.max_decode_slowdown > 0 and self.paced else None
        return view

    # ---------------------------------------------------------------- one stage: plan → send → account

    async def _stage(self, view):
        """One stage: reserve (stage 0), a pre-copy stage or the last one. Returns the request's next view."""
        view, stage = await self._plan(view)  # where the request stands, and what this stage sends
        await self._announce(stage)  # MigStage; MigReady where the stage waits for it
        await self._copy(stage)  # the blocks, and the destination's MigDone
        self._account(stage)  # what went; the next phase
        return view

    async def _plan(self, view) -> tuple[object, Stage]:
        """The request's view as of now (suspended first if this is the last stage) and the stage's plan."""
        src, cfg = self.src, self.src.cfg
        started_ns = now_ns(self.clock) if self.tracer is not None else 0
        if self.stage > 0:
            view = await src.boundary(lambda: src.engine.migration_view(self.request_id))
            if view is None:
                raise Aborted("the request finished or was preempted on the source during pre-copy")
        if view.block_ids[:len(self.sent)] != self.sent:
            raise Aborted("the request was preempted on the source (its blocks changed)")
        bs = src.engine.block_size
        last = stages.is_last(view.computed_tokens, len(self.sent), self.stage, bs, cfg.last_stage_max_blocks,
                              cfg.max_stages, self.blocking)
        state = None
        if last:
            view, state = await self._suspend()
        # Pre-copy sends full blocks only and reserves headroom for the last stage; the last stage sends the
        # rest, of its partial block only the written token slots where the KV's bytes say which those are.
        plan = stages.plan(view.computed_tokens, len(self.sent), last, bs, cfg.last_stage_max_blocks,
                           self.info.max_total, getattr(self.kb, "token_slots", False))
        return view, Stage(self.stage, plan, view.block_ids[plan.first_block:plan.upto], state, started_ns)

    async def _announce(self, stage: Stage) -> None:
        """Tell the destination the stage (stage 0: the request, the KV layout, the pair); wait for its
        MigReady where the stage does. Blocks its prefix cache holds already leave the stage."""
        src, plan = self.src, stage.plan
        msg = wire.MigStage(mig_id=self.out.mig_id, stage=stage.number, tokens=plan.tokens, first_block=len(self.sent),
                            n_blocks=len(stage.ids), last=stage.last, state=stage.state, chunk_blocks=self.chunk_blocks,
                            await_ready=stage.await_ready, tail_tokens=plan.tail_tokens)
        if stage.number == 0:
            msg = msgspec.structs.replace(msg, request=self.info, kv_spec=self.kb.spec, src=src.host.instance_id,
                                          kv_address=src.kv.address, pair_key=self.pair.key)
        stage.timings["message"] = self.clock.monotonic()
        if not src.peers.send(self.dst_address, msg):
            raise DestinationFailed("the destination's socket is not accepting messages")
        self.last_sent = stage.last
        if stage.await_ready:
            ready = await src.reply(self.out, wire.MigReady, stage.number,
                                    "the reservation" if stage.number == 0 else f"stage {stage.number}")
            if stage.number == 0 and 0 < ready.cached_blocks <= len(stage.ids):
                # The destination's prefix cache holds the request's first blocks: they stay out of the copy.
                self.result.cached_blocks = ready.cached_blocks
                self.sent += stage.ids[:ready.cached_blocks]
                stage.ids = stage.ids[ready.cached_blocks:]
        stage.timings["ready"] = self.clock.monotonic()

    async def _copy(self, stage: Stage) -> None:
        """Send the stage's blocks and wait for the destination's MigDone (after the copy, or, for the last
        stage, whose blocks follow the message at once, before its bytes are counted)."""
        src, cfg, ids = self.src, self.src.cfg, stage.ids
        if stage.last:
            self.result.last_stage_blocks = len(ids)
        nbytes = len(ids) * self.kb.block_nbytes
        # The cap spares the engine during pre-copy; the last stage is downtime: never paced. Its few blocks
        # go as one message per chunk (daemons/kv/transfer.py: fewer Gloo rounds).
        paced = self.pacer if ids and not stage.last else None
        duty = (lambda: paced.duty) if paced else None
        sending = (asyncio.wrap_future(self.pair.send(
            self.kb, ids, self.chunk_blocks, 0.0 if stage.last else cfg.bandwidth_limit_mbps * 1e6,
            stage.plan.tail_tokens, duty=duty, one_message=stage.last)) if ids else None)
        if sending is not None and stage.await_ready:
            with src.pacing(self.out.mig_id, paced):
                self.result.bytes += await src.sent(self.out, sending, nbytes, paced is not None)
        stage.timings["sent"] = self.clock.monotonic()
        done = await src.reply(self.out, wire.MigDone, stage.number,
                               "the commit" if stage.last else f"stage {stage.number}'s copy")
        stage.timings["done"] = self.clock.monotonic()
        if stage.last:
            self.result.join_ms = done.join_ms
        if sending is not None and not stage.await_ready:  # done: the destination got it all
            self.result.bytes += await src.sent(self.out, sending, nbytes)
        t = stage.timings
        log.debug("migration %s stage %d (%s): %d blocks; ready %.2f ms, copy %.2f ms, done %.2f ms%s",
                  self.out.mig_id, stage.number, self.phase.value, len(ids), (t["ready"] - t["message"]) * 1e3,
                  (t["sent"] - t["ready"]) * 1e3, (t["done"] - t["sent"]) * 1e3,
                  f"; duty {paced.duty:.2f} ({paced.over}/{paced.steps} steps over)" if paced else "")

    def _account(self, stage: Stage) -> None:
        self.sent += stage.ids
        if self.tracer is not None:
            self.traced.append((stage.number, stage.kind, stage.started_ns, now_ns(self.clock), len(stage.ids)))
        self.stage += 1
        if stage.last:
            self.committed_at = stage.timings["done"]  # the request runs on the destination
            self.phase = Phase.COMMITTED
        else:
            self.phase = Phase.PRECOPY

    async def _suspend(self):
        """Enter the last stage: suspend the request at a step boundary, with its state as of then."""
        src = self.src

        def suspend():
            v = src.engine.migration_view(self.request_id)
            return (v, src.engine.suspend(self.request_id)) if v is not None else None

        got = await src.boundary(suspend)
        if got is None:
            raise Aborted("the request finished or was preempted on the source before the last stage")
        self.phase = Phase.LAST
        view, state = got
        self.state = state = msgspec.structs.replace(state, epoch=self.entry.epoch)
        self.suspended_at = self.clock.monotonic()
        self.result.resumed_at = state.emitted
        if view.block_ids[:len(self.sent)] != self.sent:
            raise Aborted("the request was preempted on the source (its blocks changed)")
        return view, state

    # ---------------------------------------------------------------- the end

    async def _abort(self, exc: Exception) -> None:
        """Name the outcome, tell the destination, and resume the request here if it was suspended."""
        src = self.src
        if not isinstance(exc, Aborted):
            log.exception("migration of %s failed unexpectedly", self.request_id)
        refused = isinstance(exc, Refused)
        uncertain = self.last_sent and self.suspended_at and not refused
        self.phase = (Phase.UNCERTAIN if uncertain else
                      Phase.ABORTED_DST if isinstance(exc, DestinationFailed) else Phase.ABORTED_SRC)
        self.result.reason = str(exc) if isinstance(exc, Aborted) else f"internal error: {exc!r}"
        self.result.resumed_at = -1
        if self.out.dead.is_set():
            M_RELEASED.labels("source", "peer_dead").inc()
        if self.pair is not None:  # the destination may have heard of this move
            src.peers.send(self.dst_address, wire.MigAbort(self.out.mig_id, self.result.reason))
            # The pair may be half-way through a rendezvous or a transfer the peer gave up on: start the next
            # migration to this peer on a fresh pair.
            src.kv.forget(self.dst)
        if self.suspended_at:
            if uncertain:
                self.result.reason += ("; it resumed here, and if the destination committed after all, the proxy "
                                       "keeps one of the two copies")
            await src.boundary(lambda: src.resume(self.request_id, self.state if uncertain else None))
        src.ended(committed=False)

    async def _release(self) -> None:
        src = self.src
        if self.lock is not None:
            self.lock.release()
        src.closed(self.out)
        if self.entry is not None and src.requests.end_migration(self.entry):  # its client left meanwhile
            if self.phase is Phase.COMMITTED:
                src.forward_abort(self.request_id)
            else:
                await src.boundary(lambda: src.host.abort_local(self.request_id))
        M_IN_FLIGHT.labels("source").dec()

    def _report(self, start: float) -> wire.MigrationOutcome:
        r = self.result
        r.stages, r.blocks, r.ended = self.stage, len(self.sent), self.phase.value
        end = self.clock.monotonic()
        r.total_ms = (end - start) * 1e3
        if self.phase is Phase.COMMITTED and self.suspended_at:
            r.downtime_ms = (self.committed_at - self.suspended_at) * 1e3
            M_DOWNTIME.observe(self.committed_at - self.suspended_at)
        M_DURATION.observe(end - start)
        M_MIGRATIONS.labels(r.outcome).inc()
        if self.tracer is not None and self.entry is not None and self.entry.traceparent:
            trace(self.tracer, self.entry.traceparent, self.request_id, self.start_ns, self.traced, r)
        log.info(OUTCOME_LOG, self.request_id, self.dst, r.ended, f" ({r.reason})" if r.reason else "", r.stages, r.blocks,
                 r.bytes / 1e6, r.downtime_ms, r.total_ms)
        return r


# One line per migration out; scripts/soak.py reads the aborted ones back from the instances' logs.
OUTCOME_LOG = "migration of %s to %s %s%s: %d stages, %d blocks, %.1f MB, downtime %.2f ms, total %.1f ms"


def trace(tr, traceparent: str, request_id: str, start_ns: int, traced: list[tuple], r: wire.MigrationOutcome) -> None:
    """A migration's span under the request's (its proxy's ``llumnix.request``), one child per stage
    (``traced``: (stage, kind, start ns, end ns, blocks))."""
    parent = tr.context(traceparent)
    if parent is None:
        return
    span = tr.start("llumnix.migration", parent, start_ns, {
        "llumnix.request_id": request_id, "llumnix.migration.src": r.src, "llumnix.migration.dst": r.dst,
        "llumnix.migration.outcome": r.outcome, "llumnix.migration.stages": r.stages,
        "llumnix.migration.blocks": r.blocks, "llumnix.migration.cached_blocks": r.cached_blocks,
        "llumnix.migration.bytes": r.bytes, "llumnix.migration.downtime_ms": round(r.downtime_ms, 3)})
    inner = tr.child_context(span)
    for stage, kind, t0, t1, blocks in traced:
        tr.record(f"llumnix.migration.stage {stage}", inner, t0, t1,
                  {"llumnix.migration.stage": stage, "llumnix.migration.stage_kind": kind,
                   "llumnix.migration.blocks": blocks, "llumnix.migration.downtime": kind == "last"})
    tr.end(span, error="" if r.outcome == "committed" else f"{r.outcome}: {r.reason}"[:200])
