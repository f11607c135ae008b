"""Live migration of running requests between instances: the llumlet's protocol, engine-agnostic.

Source, for one request (docs/architecture.md "Live migration"):

    stage 0     MigStage(request, KV layout, how to reach our KV store) -> destination reserves blocks,
                MigReady; the full blocks written so far go over Gloo while the request keeps decoding; MigDone
    stage k     the same for the blocks that filled up during stage k-1
    last stage  once at most ``last_stage_max_blocks`` remain (or after ``max_stages``): suspend the request
                at a step boundary, send the rest and the request's state (of the partial last block only
                its written token slots); the destination commits it (it is running there now) and answers
                MigDone: one round trip, the blocks right behind the message, no MigReady (a destination
                whose reservation the request outgrew grows it first; stage 0's headroom makes that rare)
    then        drop the request here; its tokens come from the destination, at the next index, to the same
                proxy (which is told the request moved)

Pre-copy is paced (daemons/pacing.py): with ``max_decode_slowdown`` set, the copy runs only so much of the
time that the engine's steps stay within that much of their time without a migration (``stepped``, which
the instance calls after every step), under ``bandwidth_limit_mbps`` as the hard cap; the last stage never.

Every step is acknowledged and has a timeout. The source aborts when the request finishes or is preempted
during pre-copy, or when the destination refuses, times out, dies or a transfer fails; it resumes the
request if it had suspended it, and tells the destination to release. A destination that hears nothing for
``dest_idle_timeout_s`` releases its reservation; one whose receive fails releases at once. Blocks that a
transfer may still write are only released after the transfer has ended, so a late chunk never lands in a
block that another request got in the meantime.

Engine calls that change scheduler state run between steps (``boundary``); Gloo work runs on the pair's
thread (kvtransfer.Pair) and only touches blocks no step writes.

Ownership (daemons/requests.py): the destination commits the request as the source's placement epoch + 1
and tells the proxy (``Moved``); so does the source once it hears of the commit. A source whose last stage
ends without an answer cannot know whether the destination committed: it resumes the request under the
next epoch too and tells the proxy, which keeps the first claim it hears of and aborts the other copy.
A destination that got ``MigAbort`` before committing never commits.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Protocol

import msgspec
import zmq
import zmq.asyncio
import zmq.utils.monitor

from daemons import metrics, runtime, stages, wire
from daemons.config import MigrationConfig
from daemons.engine.base import Engine, EngineError
from daemons.engine.kvblocks import KvLayout
from daemons.kvtransfer import KvTransfer, TransferError
from daemons.pacing import MIN_DUTY, Baseline, DutyPacer
from daemons.proxylinks import ProxyLinks
from daemons.requests import RequestTable
from daemons.security import Security
from daemons.watchdog import Faults

log = logging.getLogger("llumnix.migration")

M_MIGRATIONS = metrics.counter("instance", "llumnix_migrations_total", "Migrations out of this instance, by outcome",
                               ["outcome"], preset=[("committed",), ("aborted",)])
M_DOWNTIME = metrics.histogram("instance", "llumnix_migration_downtime_seconds",
                               "Time a committed migration kept its request suspended",
                               buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
M_DURATION = metrics.histogram("instance", "llumnix_migration_seconds", "Duration of migrations out, start to outcome",
                               buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
M_BYTES = metrics.counter("instance", "llumnix_migration_bytes_total", "KV bytes moved, by direction", ["direction"],
                          preset=[("out",), ("in",)])
M_IN_FLIGHT = metrics.gauge("instance", "llumnix_migrations_in_flight", "Migrations in progress, by role", ["role"],
                            preset=[("source",), ("destination",)])


class Aborted(Exception):
    """Ends a migration; the message is the reason reported to the operator."""


class Refused(Aborted):
    """The destination said no: it holds no copy of the request."""


class Host(Protocol):
    """What the migrator needs of its instance (daemons/instance/)."""

    ctx: zmq.asyncio.Context
    sec: Security
    instance_id: str
    request_address: str
    accepting: bool
    draining: str
    wake: asyncio.Event
    proxies: ProxyLinks

    def reply_peer(self, identity: bytes, msg: wire.Message) -> None: ...

    def announce_move(self, request_id: str, address: str, instance_id: str, request_address: str, epoch: int,
                      from_index: int) -> None: ...

    def abort_local(self, request_id: str) -> bool: ...


@dataclass
class _Out:
    mig_id: str
    dst_address: str = ""
    replies: asyncio.Queue = field(default_factory=asyncio.Queue)  # MigReady / MigDone / _GONE from the destination


PREFIX_QUERY_TIMEOUT_S = 1.0  # a destination that does not answer is taken to hold nothing
_GONE = object()  # put in a migration's replies when the connection to its destination drops


@dataclass
class _In:
    mig_id: str
    request_id: str
    identity: bytes  # the source's socket identity on our ROUTER: replies go there
    src: str
    request: wire.MigratingRequest
    pair: object = None
    last_heard: float = field(default_factory=time.monotonic)
    busy: asyncio.Lock = field(default_factory=asyncio.Lock)  # stages of one migration run one at a time
    receiving: asyncio.Future | None = None  # a Gloo receive that may still write our blocks
    ids: list[int] = field(default_factory=list)  # the blocks reserved so far, in token order
    ended: bool = False
    aborted: bool = False  # the source sent MigAbort: never commit


class Migrator:
    """Both roles of this instance. Built by the instance, which gives it ``boundary`` (run a function
    between engine steps) and its request table, through whose verbs a migration hands requests over."""

    def __init__(self, host: Host, cfg: MigrationConfig, engine: Engine, requests: RequestTable, boundary: Callable,
                 faults: Faults | None = None):
        self.inst = host
        self.cfg = cfg
        self.engine = engine
        self.requests = requests
        self.boundary = boundary
        self.faults = faults or Faults("", "")
        self.kv = KvTransfer(self.cfg.kv_host, self.cfg.kv_port, self.cfg.timeout_s)
        transport = getattr(engine, "kv_transport", None)  # a tensor-parallel engine moves KV rank by rank
        if transport is not None:
            self.kv = transport(self.kv, boundary)
        self.outgoing: dict[str, _Out] = {}  # by migration id
        self.incoming: dict[str, _In] = {}  # by migration id
        self.peers: dict[str, zmq.asyncio.Socket] = {}  # destination request address -> our DEALER
        self._dst_locks: dict[str, asyncio.Lock] = {}
        self.committed = 0
        self.aborted = 0
        self._prefix_queries = 0
        self._prefix_waits: dict[int, asyncio.Future] = {}
        self._tasks: set[asyncio.Task] = set()
        self.step_baseline = Baseline()  # engine steps while no migration runs here
        self._pacers: dict[str, DutyPacer] = {}  # by migration id, while its pre-copy sends

    @property
    def busy(self) -> int:
        return len(self.outgoing) + len(self.incoming)

    def stepped(self, step_s: float) -> None:
        """(Instance, after each engine step) A step with no migration here joins the baseline; one during a
        paced pre-copy adjusts that copy's duty."""
        if self._pacers:
            baseline = self.step_baseline.value()
            for pacer in self._pacers.values():
                pacer.step(step_s, baseline)
        elif not self.outgoing and not self.incoming:
            self.step_baseline.add(step_s)

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ================================================================ source

    def _peer(self, address: str) -> zmq.asyncio.Socket:
        sock = self.peers.get(address)
        if sock is None:
            sock = self.peers[address] = self.inst.sec.client(runtime.tune(self.inst.ctx.socket(zmq.DEALER)), "instance")
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sock.connect(address)
            self.spawn(self._read_peer(sock))
            self.spawn(self._watch_peer(address, monitor))
        return sock

    async def _watch_peer(self, address: str, monitor) -> None:
        """A destination that dies drops its connection (the kernel closes it): end the waits of our
        migrations to it at once rather than after migration.timeout_s, while the request is suspended."""
        try:
            while True:
                event = await zmq.utils.monitor.recv_monitor_message(monitor)
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    for out in self.outgoing.values():
                        if out.dst_address == address:
                            out.replies.put_nowait(_GONE)
        finally:
            monitor.close(0)

    async def _read_peer(self, sock) -> None:
        while True:
            msg = wire.decode(await sock.recv())
            if isinstance(msg, (wire.MigReady, wire.MigDone)):
                out = self.outgoing.get(msg.mig_id)
                if out is not None:
                    out.replies.put_nowait(msg)
            elif isinstance(msg, wire.PrefixHits):
                waiting = self._prefix_waits.get(msg.query_id)
                if waiting is not None and not waiting.done():
                    waiting.set_result(msg.blocks)
            else:
                log.warning("dropped an unexpected message from a migration peer")

    async def _reply(self, out: _Out, kind: type, stage: int, what: str):
        deadline = time.monotonic() + self.cfg.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Aborted(f"destination did not answer {what} within {self.cfg.timeout_s:g}s")
            try:
                msg = await asyncio.wait_for(out.replies.get(), left)
            except asyncio.TimeoutError:
                continue
            if msg is _GONE:
                raise Aborted(f"the connection to the destination dropped while waiting for {what} (did it die?)")
            if isinstance(msg, kind) and msg.stage == stage:
                if not msg.ok:
                    raise Refused(f"destination refused: {msg.reason}")
                return msg

    async def migrate_out(self, request_id: str, dst: str, dst_address: str, blocking: bool = False) -> wire.MigrationOutcome:
        """Move one request to ``dst``; never raises: the outcome says what happened. ``blocking`` skips
        pre-copy (suspend, then copy everything): the stop-and-copy baseline that benchmarks compare with."""
        me = self.inst.instance_id
        out = _Out(uuid.uuid4().hex[:16], dst_address)
        result = wire.MigrationOutcome(request_id=request_id, src=me, dst=dst, outcome="aborted")
        start = time.perf_counter()
        suspended_at = 0.0
        sock = None
        sent: list[int] = []  # block ids already at the destination, in order
        stage = 0
        lock = None
        entry = None
        state = None
        last_sent = False  # the last stage went out: from then on only the destination's answer tells
        self.outgoing[out.mig_id] = out
        M_IN_FLIGHT.labels("source").inc()
        try:
            if dst == me:
                raise Aborted("source and destination are the same instance")
            entry = self.requests.begin_migration(request_id)
            if entry is None:
                raise Aborted("the request is not here or is already migrating")
            # One migration at a time per destination: both ends of a pair run its transfers in the order
            # they were posted, so two interleaved migrations could pair one's send with the other's receive.
            await self._dst_locks.setdefault(dst, asyncio.Lock()).acquire()
            lock = self._dst_locks[dst]
            first = await self.boundary(lambda: self._first_look(request_id))
            if first is None or request_id not in self.requests:
                raise Aborted("the request is not running here (finished, waiting or unknown)")
            info, view = first
            info = msgspec.structs.replace(info, reply_to=entry.reply_to)
            kb = self.engine.kv_blocks()
            chunk_blocks = max(1, self.cfg.chunk_bytes // kb.block_nbytes)
            limit = self.cfg.bandwidth_limit_mbps * 1e6
            bs = self.engine.block_size
            pair = self.kv.source_pair(me, dst)
            sock = self._peer(dst_address)
            # Pacing and one-message chunks alike for this process's pairs and a tensor-parallel engine's ranks
            # (each rank's pair reads the duty the engine last handed it; both ends have the same TP size).
            pacer = DutyPacer(self.cfg.max_decode_slowdown) if self.cfg.max_decode_slowdown > 0 else None
            while True:
                if stage > 0:
                    view = await self.boundary(lambda: self.engine.migration_view(request_id))
                    if view is None:
                        raise Aborted("the request finished or was preempted on the source during pre-copy")
                if view.block_ids[:len(sent)] != sent:
                    raise Aborted("the request was preempted on the source (its blocks changed)")
                last = stages.is_last(view.computed_tokens, len(sent), stage, bs, self.cfg.last_stage_max_blocks,
                                      self.cfg.max_stages, blocking)
                state = None
                if last:
                    def suspend():
                        v = self.engine.migration_view(request_id)
                        return (v, self.engine.suspend(request_id)) if v is not None else None

                    got = await self.boundary(suspend)
                    if got is None:
                        raise Aborted("the request finished or was preempted on the source before the last stage")
                    view, state = got
                    state = msgspec.structs.replace(state, epoch=entry.epoch)
                    suspended_at = time.perf_counter()
                    result.resumed_at = state.emitted
                    if view.block_ids[:len(sent)] != sent:
                        raise Aborted("the request was preempted on the source (its blocks changed)")
                # Pre-copy sends full blocks only and reserves headroom for the last stage; the last stage sends
                # the rest, of its partial block only the written token slots where the KV's bytes say which
                # those are (daemons/stages.py).
                planned = stages.plan(view.computed_tokens, len(sent), last, bs, self.cfg.last_stage_max_blocks,
                                      info.max_total, getattr(kb, "token_slots", False))
                ids = view.block_ids[planned.first_block:planned.upto]
                tail, tokens = planned.tail_tokens, planned.tokens
                # The last stage is the request's downtime: one round trip (MigStage, MigDone). The blocks go
                # right behind the message; the destination, which knows the pair and the request by now,
                # grows its reservation first if the request outgrew it (then Gloo waits for its receive).
                await_ready = not (last and stage > 0)
                msg = wire.MigStage(mig_id=out.mig_id, stage=stage, tokens=tokens, first_block=len(sent),
                                    n_blocks=len(ids), last=last, state=state, chunk_blocks=chunk_blocks,
                                    await_ready=await_ready, tail_tokens=tail)
                if stage == 0:
                    msg = msgspec.structs.replace(msg, request=info, kv_spec=kb.spec, src=me,
                                                  kv_address=self.kv.address, pair_key=pair.key)
                t_msg = time.perf_counter()
                if not runtime.send_now(sock, wire.encode(msg)):
                    raise Aborted("the destination's socket is not accepting messages")
                last_sent = last
                if await_ready:
                    ready = await self._reply(out, wire.MigReady, stage, "the reservation" if stage == 0 else f"stage {stage}")
                    if stage == 0 and 0 < ready.cached_blocks <= len(ids):
                        # The destination's prefix cache holds the request's first blocks: they stay out of the copy.
                        result.cached_blocks = ready.cached_blocks
                        sent += ids[:ready.cached_blocks]
                        ids = ids[ready.cached_blocks:]
                t_ready = time.perf_counter()
                if last:
                    result.last_stage_blocks = len(ids)
                # The cap spares the engine during pre-copy; the last stage is downtime: never paced.
                cap = 0.0 if last else limit
                paced = pacer if ids and not last else None
                # The last stage's few blocks go as one message per chunk (kvtransfer: fewer Gloo rounds).
                duty = (lambda: pacer.duty) if paced else None
                sending = (asyncio.wrap_future(pair.send(kb, ids, chunk_blocks, cap, tail, duty=duty, one_message=last))
                           if ids else None)
                if sending is not None and await_ready:
                    if paced:
                        self._pacers[out.mig_id] = paced
                    try:
                        result.bytes += await self._sent(sending, dst, len(ids) * kb.block_nbytes, paced is not None)
                    finally:
                        self._pacers.pop(out.mig_id, None)
                t_sent = time.perf_counter()
                await self._reply(out, wire.MigDone, stage, "the commit" if last else f"stage {stage}'s copy")
                t_done = time.perf_counter()  # after the last stage: the request runs on the destination
                if sending is not None and not await_ready:  # done: the destination got it all
                    result.bytes += await self._sent(sending, dst, len(ids) * kb.block_nbytes)
                log.debug("migration %s stage %d%s: %d blocks; ready %.2f ms, copy %.2f ms, done %.2f ms%s",
                          out.mig_id, stage, " (last)" if last else "", len(ids), (t_ready - t_msg) * 1e3,
                          (t_sent - t_ready) * 1e3, (t_done - t_sent) * 1e3,
                          f"; duty {pacer.duty:.2f} ({pacer.over}/{pacer.steps} steps over)" if paced else "")
                sent += ids
                stage += 1
                if last:
                    break
            await self.boundary(lambda: self._hand_over(request_id, dst, dst_address, state))
            result.outcome, result.reason = "committed", ""
            self.committed += 1
        except Exception as exc:  # Aborted; anything else is our bug: report it, keep the request running
            if not isinstance(exc, Aborted):
                log.exception("migration of %s failed unexpectedly", request_id)
            result.reason = str(exc) if isinstance(exc, Aborted) else f"internal error: {exc!r}"
            result.resumed_at = -1
            if sock is not None:
                runtime.send_now(sock, wire.encode(wire.MigAbort(out.mig_id, result.reason)))
                # The pair may be half-way through a rendezvous or a transfer the peer gave up on: start
                # the next migration to this peer on a fresh pair.
                self.kv.forget(dst)
            if suspended_at:
                uncertain = last_sent and not isinstance(exc, Refused)
                if uncertain:
                    result.reason += ("; it resumed here, and if the destination committed after all, the proxy "
                                      "keeps one of the two copies")
                await self.boundary(lambda: self._resume(request_id, state if uncertain else None))
            self.aborted += 1
        finally:
            if lock is not None:
                lock.release()
            del self.outgoing[out.mig_id]
            self.inst.wake.set()  # refresh the load report at the next boundary
            if entry is not None and self.requests.end_migration(entry):  # its client left meanwhile
                if result.outcome == "committed":
                    self.forward_abort(request_id)
                else:
                    await self.boundary(lambda: self.inst.abort_local(request_id))
            M_IN_FLIGHT.labels("source").dec()
        result.stages = stage
        result.blocks = len(sent)
        end = time.perf_counter()
        result.total_ms = (end - start) * 1e3
        if suspended_at and result.outcome == "committed":
            result.downtime_ms = (t_done - suspended_at) * 1e3
            M_DOWNTIME.observe(t_done - suspended_at)
        M_DURATION.observe(end - start)
        M_MIGRATIONS.labels(result.outcome).inc()
        log.info("migration of %s to %s %s%s: %d stages, %d blocks, %.1f MB, downtime %.2f ms, total %.1f ms",
                 request_id, dst, result.outcome, f" ({result.reason})" if result.reason else "", result.stages,
                 result.blocks, result.bytes / 1e6, result.downtime_ms, result.total_ms)
        return result

    async def _sent(self, sending: asyncio.Future, dst: str, nbytes: int, paced: bool = False) -> int:
        rate = 1e8 * (MIN_DUTY if paced else 1.0)  # at least 100 MB/s, or that at the lowest duty where paced
        try:
            sent = await asyncio.wait_for(sending, self.cfg.timeout_s + nbytes / rate)
        except (TransferError, asyncio.TimeoutError) as exc:
            raise Aborted(f"KV transfer failed: {exc or 'timed out'}") from None
        M_BYTES.labels("out").inc(sent)
        return sent

    def _first_look(self, request_id: str):
        view = self.engine.migration_view(request_id)
        return None if view is None else (self.engine.migrating_request(request_id), view)

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

    # ================================================================ destination

    def on_peer_message(self, identity: bytes, msg) -> None:
        if isinstance(msg, wire.MigStage):
            inc = self.incoming.get(msg.mig_id)
            if inc is None:
                if msg.stage != 0 or msg.request is None:
                    self._answer(identity, wire.MigReady(msg.mig_id, msg.stage, False, "unknown migration (released?)"))
                    return
                refusal = self._refusal(msg)
                if refusal:
                    self._answer(identity, wire.MigReady(msg.mig_id, msg.stage, False, refusal))
                    return
                inc = self.incoming[msg.mig_id] = _In(msg.mig_id, msg.request.request_id, identity, msg.src, msg.request)
                M_IN_FLIGHT.labels("destination").inc()
                self.spawn(self._watch(inc))
            inc.last_heard = time.monotonic()
            self.spawn(self._stage_in(inc, msg))
        elif isinstance(msg, wire.MigAbort):
            inc = self.incoming.get(msg.mig_id)
            if inc is not None:
                inc.aborted = True  # a commit waiting for its step boundary will not happen
                log.info("migration of %s from %s aborted by the source: %s", inc.request_id, inc.src, msg.reason)
                self.spawn(self._end_in(inc))
        elif isinstance(msg, wire.PrefixQuery):
            self.spawn(self._answer_prefix(identity, msg))

    # ---------------------------------------------------------------- what a move would not need to send

    async def prefix_hits(self, dst_address: str, prompts: list[list[int]]) -> list[int]:
        """Of each prompt, the leading full blocks the destination's prefix cache holds: blocks a migration
        there would not send. Zeros where the destination does not answer within PREFIX_QUERY_TIMEOUT_S."""
        self._prefix_queries += 1
        qid = self._prefix_queries
        waiting = self._prefix_waits[qid] = asyncio.get_running_loop().create_future()
        try:
            runtime.send_now(self._peer(dst_address), wire.encode(wire.PrefixQuery(qid, prompts)))
            blocks = await asyncio.wait_for(waiting, PREFIX_QUERY_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.info("%s did not say within %gs what of %d prompt(s) it holds; choosing as if nothing",
                     dst_address, PREFIX_QUERY_TIMEOUT_S, len(prompts))
            return [0] * len(prompts)
        finally:
            self._prefix_waits.pop(qid, None)
        if len(blocks) != len(prompts):
            log.warning("%s answered a prefix query about %d prompts with %d counts; ignored",
                        dst_address, len(prompts), len(blocks))
            return [0] * len(prompts)
        return [max(0, int(b)) for b in blocks]

    async def _answer_prefix(self, identity: bytes, msg: wire.PrefixQuery) -> None:
        try:
            blocks = await self.boundary(lambda: self.engine.prefix_hits(msg.prompts))
        except EngineError as exc:  # a prompt this engine cannot hash (out of its vocabulary)
            log.info("prefix query: %s", exc)
            blocks = [0] * len(msg.prompts)
        self._answer(identity, wire.PrefixHits(msg.query_id, blocks))

    def receiving(self, request_id: str) -> bool:
        return any(inc.request_id == request_id and not inc.ended for inc in self.incoming.values())

    async def cancel_incoming(self, request_id: str) -> None:
        """Give up receiving ``request_id`` (it was placed here anew): never commit, release its blocks."""
        for inc in [i for i in self.incoming.values() if i.request_id == request_id]:
            inc.aborted = True
            await self._end_in(inc)

    def _refusal(self, msg: wire.MigStage) -> str:
        if not self.inst.accepting:
            return f"instance {self.inst.instance_id} is shutting down"
        if self.inst.draining:
            return f"instance {self.inst.instance_id} is draining"
        spec = self.engine.kv_blocks().spec
        if msg.kv_spec != spec:
            return f"KV layout differs: {KvLayout.difference(msg.kv_spec, spec)}"
        if self.busy >= self.cfg.max_in_flight:
            return f"already in {self.busy} migrations (migration.max_in_flight)"
        if msg.request.request_id in self.requests:
            return "the request id is already in use here"
        return ""

    def _answer(self, identity: bytes, msg) -> None:
        self.inst.reply_peer(identity, msg)

    async def _stage_in(self, inc: _In, msg: wire.MigStage) -> None:
        t_in = time.perf_counter()
        async with inc.busy:
            if inc.ended:
                return
            try:
                if msg.stage == 0:  # join the pair first: it forms (on its thread) even if we refuse below
                    try:
                        inc.pair = self.kv.dest_pair(msg.pair_key, msg.kv_address)
                    except TransferError as exc:
                        raise Aborted(str(exc)) from None
                if stages.cdiv(msg.tokens, self.engine.block_size) > len(inc.ids):
                    try:
                        inc.ids = await self.boundary(lambda: self.engine.reserve(inc.request, msg.tokens))
                    except EngineError as exc:
                        raise Aborted(str(exc)) from None
                ids = inc.ids
                if msg.first_block + msg.n_blocks > len(ids):
                    raise Aborted(f"stage {msg.stage} sends blocks past the reservation")
                if not 0 <= msg.tail_tokens < self.engine.block_size or (msg.tail_tokens and not msg.n_blocks):
                    raise Aborted(f"stage {msg.stage} sends a partial block of {msg.tail_tokens} tokens")
                # Stage 0: the blocks of the request's prompt that the destination's prefix cache held at the
                # reservation are in place already; the source leaves them out (MigReady.cached_blocks).
                cached = min(self.engine.cached_blocks(inc.request_id), msg.n_blocks) if msg.stage == 0 else 0
                if msg.n_blocks > cached:
                    target = ids[msg.first_block + cached:msg.first_block + msg.n_blocks]
                    receive = inc.pair.recv(self.engine.kv_blocks(), target, msg.chunk_blocks, msg.tail_tokens,
                                            one_message=msg.last)
                    inc.receiving = asyncio.wrap_future(receive)
                if msg.await_ready:
                    self._answer(inc.identity, wire.MigReady(msg.mig_id, msg.stage, cached_blocks=cached))
                if inc.receiving is not None:
                    try:
                        got = await inc.receiving
                    except TransferError as exc:
                        raise Aborted(f"KV transfer failed: {exc}") from None
                    finally:
                        inc.receiving = None
                    M_BYTES.labels("in").inc(got)
                t_got = time.perf_counter()
                inc.last_heard = time.monotonic()
                if msg.last:
                    if msg.state is None:
                        raise Aborted("the last stage carried no request state")
                    slow = self.faults.get("slow_commit_s")
                    if slow:  # tests: the commit waits as if behind a long engine step
                        await asyncio.sleep(slow)
                    try:
                        await self.boundary(lambda: self._commit(inc, msg.state))
                    except EngineError as exc:
                        raise Aborted(str(exc)) from None
                if not (msg.last and self.faults.get("drop_commit_ack")):
                    self._answer(inc.identity, wire.MigDone(msg.mig_id, msg.stage))
                log.debug("migration %s stage %d in: %d blocks, %.2f ms from message to done (received %.2f ms)",
                          msg.mig_id, msg.stage, msg.n_blocks, (time.perf_counter() - t_in) * 1e3, (t_got - t_in) * 1e3)
                if msg.last:
                    inc.ended = True
                    self._forget_in(inc)
            except Aborted as exc:
                log.info("migration of %s from %s refused at stage %d: %s", inc.request_id, inc.src, msg.stage, exc)
                # The source waits for one or the other, depending on how far the stage got.
                self._answer(inc.identity, wire.MigReady(msg.mig_id, msg.stage, False, str(exc)))
                self._answer(inc.identity, wire.MigDone(msg.mig_id, msg.stage, False, str(exc)))
                await self._release(inc)

    def _commit(self, inc: _In, state: wire.RequestState) -> None:
        if inc.aborted:
            raise EngineError("the source aborted the migration before the commit")
        self.engine.commit(inc.request_id, state)
        epoch = state.epoch + 1
        host = self.inst
        self.requests.take_over(inc.request_id, inc.request.reply_to, epoch, state.emitted)
        host.proxies.seen(inc.request.reply_to)  # its proxy has not spoken to us yet: count from now
        host.announce_move(inc.request_id, inc.request.reply_to, host.instance_id, host.request_address, epoch,
                           state.emitted)
        host.wake.set()

    async def _end_in(self, inc: _In) -> None:
        async with inc.busy:
            await self._release(inc)

    async def _release(self, inc: _In) -> None:
        if inc.ended:
            return
        inc.ended = True
        if inc.receiving is not None:  # the transfer may still write our blocks: let it end first
            try:
                await inc.receiving
            except (TransferError, asyncio.CancelledError):
                pass
        await self.boundary(lambda: self.engine.release(inc.request_id))
        self._forget_in(inc)

    def _forget_in(self, inc: _In) -> None:
        if self.incoming.pop(inc.mig_id, None) is not None:
            M_IN_FLIGHT.labels("destination").dec()
            self.inst.wake.set()

    async def _watch(self, inc: _In) -> None:
        """Release a reservation whose source went quiet (it died, or lost our answers)."""
        idle = self.cfg.dest_idle_timeout_s
        while not inc.ended:
            await asyncio.sleep(min(idle, 1.0) / 2)
            if inc.ended or inc.busy.locked():
                continue  # a stage in progress has its own timeouts
            if time.monotonic() - inc.last_heard > idle:
                log.warning("migration of %s from %s: no word from the source for %.1fs; releasing its blocks",
                            inc.request_id, inc.src, idle)
                await self._end_in(inc)

    # ================================================================ life cycle

    async def close(self) -> None:
        for inc in list(self.incoming.values()):
            inc.ended = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.kv.close()
