"""The destination's side of a move: reserve, receive each stage into reserved blocks, commit or release,
and give everything back when the source goes quiet."""

from __future__ import annotations

import asyncio
import logging
import time

from daemons.clock import loop_time
from daemons import stages, wire
from daemons.engine.base import EngineError
from daemons.engine.kvblocks import KvLayout
from daemons.kvtransfer import TransferError
from daemons.migration.records import Aborted, Incoming
from daemons.migration.telemetry import M_BYTES, M_IN_FLIGHT

log = logging.getLogger("llumnix.migration")


class DestinationMixin:
    """Of the Migrator: owns ``incoming``."""

    def receiving(self, request_id: str) -> bool:
        return any(inc.request_id == request_id and not inc.ended for inc in self.incoming.values())

    async def cancel_incoming(self, request_id: str) -> None:
        """Give up receiving ``request_id`` (it was placed here anew): never commit, release its blocks."""
        for inc in [i for i in self.incoming.values() if i.request_id == request_id]:
            inc.aborted = True
            await self._end_in(inc)

    def _refusal(self, msg: wire.MigStage) -> str:
        if self.faults.get("refuse_migrations"):
            return "fault injection: this instance refuses every migration"
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
        if not msg.request.reply_to:
            return "the request names no proxy to stream to (reply_to)"
        return ""

    def _answer(self, identity: bytes, msg) -> None:
        self.inst.reply_peer(identity, msg)

    async def _stage_in(self, inc: Incoming, msg: wire.MigStage) -> None:
        t_in = time.perf_counter()
        async with inc.busy:
            if inc.ended:
                return
            try:
                if msg.stage == 0:  # join the pair first: it forms (on its thread) even if we refuse below
                    try:
                        self.prune_peers()
                        inc.pair = self.kv.dest_pair(msg.pair_key, msg.kv_address)
                        self.pair_used(msg.pair_key)
                        identity = inc.identity
                        self.relay_rendezvous(inc.pair, lambda m: self._answer(identity, m))
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
                inc.last_heard = loop_time()
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

    def _commit(self, inc: Incoming, state: wire.RequestState) -> None:
        if inc.aborted:
            raise EngineError("the source aborted the migration before the commit")
        self.engine.commit(inc.request_id, state)
        epoch = state.epoch + 1
        host = self.inst
        self.requests.take_over(inc.request_id, inc.request.reply_to, epoch, state.emitted, inc.request.traceparent)
        host.proxies.seen(inc.request.reply_to)  # its proxy has not spoken to us yet: count from now
        host.announce_move(inc.request_id, inc.request.reply_to, host.instance_id, host.request_address, epoch,
                           state.emitted)
        host.wake.set()

    async def _end_in(self, inc: Incoming) -> None:
        async with inc.busy:
            await self._release(inc)

    async def _release(self, inc: Incoming) -> None:
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

    def _forget_in(self, inc: Incoming) -> None:
        if self.incoming.pop(inc.mig_id, None) is not None:
            M_IN_FLIGHT.labels("destination").dec()
            self.inst.wake.set()

    async def _watch(self, inc: Incoming) -> None:
        """Release a reservation whose source went quiet (it died, or lost our answers)."""
        idle = self.cfg.dest_idle_timeout_s
        while not inc.ended:
            await asyncio.sleep(min(idle, 1.0) / 2)
            if inc.ended or inc.busy.locked():
                continue  # a stage in progress has its own timeouts
            if loop_time() - inc.last_heard > idle:
                log.warning("migration of %s from %s: no word from the source for %.1fs; releasing its blocks",
                            inc.request_id, inc.src, idle)
                await self._end_in(inc)
