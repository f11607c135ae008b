"""The source's side of a move: reserve on the destination, pre-copy stages while the request decodes,
suspend at a step boundary, the last stage, commit, and the outcomes when something fails."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import msgspec

from daemons import runtime, stages, wire
from daemons.kvtransfer import TransferError
from daemons.migration.records import Aborted, Outgoing, Refused
from daemons.migration.telemetry import M_BYTES, M_DOWNTIME, M_DURATION, M_IN_FLIGHT, M_MIGRATIONS
from daemons.pacing import MIN_DUTY, DutyPacer

log = logging.getLogger("llumnix.migration")


class SourceMixin:
    """Of the Migrator: owns ``outgoing``."""

    async def migrate_out(self, request_id: str, dst: str, dst_address: str, blocking: bool = False) -> wire.MigrationOutcome:
        """Move one request to ``dst``; never raises: the outcome says what happened. ``blocking`` skips
        pre-copy (suspend, then copy everything): the stop-and-copy baseline that benchmarks compare with."""
        me = self.inst.instance_id
        out = Outgoing(uuid.uuid4().hex[:16], dst_address)
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
            raise Aborted(f"KV transfer failed: {str(exc) or 'timed out'}") from None
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
