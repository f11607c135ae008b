"""The destination's side of a move: reserve, receive each stage into reserved blocks, commit or release,
and give everything back when the source goes quiet."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from daemons import stages, wire
from daemons.engine.base import EngineError
from daemons.kv.layout import KvLayout
from daemons.migration.records import LEASE_EXPIRED, PEER_DEAD, TRANSFER_FAILED, Aborted, Incoming
from daemons.migration.side import Parts, Side
from daemons.migration.telemetry import M_BYTES, M_IN_FLIGHT, M_RELEASED
from daemons.migration.transport import TransferError
from daemons.requests import slo_mark
from daemons.watchdog import Faults

log = logging.getLogger("llumnix.migration")


class Destination(Side):
    """Owns ``incoming`` (by migration id): the moves into this instance. Receives the instance (``host``: its
    replies to peers, its state, its proxies), the engine (between steps only, through ``boundary``), the
    request table a commit takes the request into, the KV transport and the peers (pair bookkeeping),
    ``spawn`` for its tasks and ``busy`` (migrations in flight here, both roles) for ``max_in_flight``."""

    def __init__(self, parts: Parts, faults: Faults, spawn: Callable, busy: Callable[[], int]):
        super().__init__(parts)
        self.faults = faults  # tests swap it (Migrator.faults)
        self.spawn = spawn
        self.busy = busy
        self.incoming: dict[str, Incoming] = {}

    def receiving(self, request_id: str) -> bool:
        return any(inc.request_id == request_id and not inc.ended for inc in self.incoming.values())

    def pair_names(self) -> set[str]:
        """The KV pairs our moves in hold (never pruned)."""
        return {inc.pair.key for inc in self.incoming.values() if inc.pair is not None}

    async def cancel(self, request_id: str) -> None:
        """Give up receiving ``request_id`` (it was placed here anew): never commit, release its blocks."""
        for inc in [i for i in self.incoming.values() if i.request_id == request_id]:
            inc.aborted = True
            await self._end(inc)

    def peer_dead(self, instance_id: str) -> list[Incoming]:
        """The manager declared the source ``instance_id`` dead: its moves here will never commit. Each is
        released at once (as soon as no transfer can still write its blocks: closing their KV pairs, which
        the caller does, ends those). Returns them."""
        ending = [inc for inc in self.incoming.values() if inc.src == instance_id and not inc.ended]
        for inc in ending:
            inc.aborted = True  # a commit waiting for its step boundary will not happen
            inc.cause = inc.cause or PEER_DEAD
            log.warning("migration of %s from %s: the source was declared dead; releasing its reservation",
                        inc.request_id, inc.src)
            self.spawn(self._end(inc))
        return ending

    def close(self) -> None:
        for inc in self.incoming.values():
            inc.ended = True

    # ---------------------------------------------------------------- the source's messages

    def on_stage(self, identity: bytes, msg: wire.MigStage) -> None:
        inc = self.incoming.get(msg.mig_id)
        if inc is None:
            if msg.stage != 0 or msg.request is None:
                self.host.reply_peer(identity, wire.MigReady(msg.mig_id, msg.stage, False, "unknown migration (released?)"))
                return
            refusal = self._refusal(msg)
            if refusal:
                self.host.reply_peer(identity, wire.MigReady(msg.mig_id, msg.stage, False, refusal))
                return
            inc = self.incoming[msg.mig_id] = Incoming(msg.mig_id, msg.request.request_id, identity, msg.src,
                                                       msg.request)
            M_IN_FLIGHT.labels("destination").inc()
            self.spawn(self._watch(inc))
        inc.last_heard = self.clock.monotonic()
        self.spawn(self._stage_in(inc, msg))

    def on_abort(self, msg: wire.MigAbort) -> None:
        inc = self.incoming.get(msg.mig_id)
        if inc is not None:
            inc.aborted = True  # a commit waiting for its step boundary will not happen
            log.info("migration of %s from %s aborted by the source: %s", inc.request_id, inc.src, msg.reason)
            self.spawn(self._end(inc))

    async def answer_prefix(self, identity: bytes, msg: wire.PrefixQuery) -> None:
        """Of each prompt asked about, the leading full blocks our prefix cache holds (Peers.prefix_hits)."""
        try:
            blocks = await self.boundary(lambda: self.engine.prefix_hits(msg.prompts))
        except EngineError as exc:  # a prompt this engine cannot hash (out of its vocabulary)
            log.info("prefix query: %s", exc)
            blocks = [0] * len(msg.prompts)
        self.host.reply_peer(identity, wire.PrefixHits(msg.query_id, blocks))

    def _refusal(self, msg: wire.MigStage) -> str:
        host = self.host
        if self.faults.get("refuse_migrations"):
            return "fault injection: this instance refuses every migration"
        if not host.accepting:
            return f"instance {host.instance_id} is shutting down"
        if host.draining:
            return f"instance {host.instance_id} is draining"
        spec = self.engine.kv_blocks().spec
        if msg.kv_spec != spec:
            return f"KV layout differs: {KvLayout.difference(msg.kv_spec, spec)}"
        if self.busy() >= self.cfg.max_in_flight:
            return f"already in {self.busy()} migrations (migration.max_in_flight)"
        if msg.request.request_id in self.requests:
            return "the request id is already in use here"
        if not msg.request.reply_to:
            return "the request names no proxy to stream to (reply_to)"
        return ""

    # ---------------------------------------------------------------- one stage in

    async def _stage_in(self, inc: Incoming, msg: wire.MigStage) -> None:
        t_in = self.clock.monotonic()
        answer = self.host.reply_peer
        async with inc.busy:
            if inc.ended:
                return
            try:
                if msg.stage == 0:  # join the pair first: it forms (on its thread) even if we refuse below
                    self._join(inc, msg)
                await self._reserve(inc, msg)
                # Stage 0: the blocks of the request's prompt that the destination's prefix cache held at the
                # reservation are in place already; the source leaves them out (MigReady.cached_blocks).
                cached = min(self.engine.cached_blocks(inc.request_id), msg.n_blocks) if msg.stage == 0 else 0
                if msg.n_blocks > cached:
                    target = inc.ids[msg.first_block + cached:msg.first_block + msg.n_blocks]
                    receive = inc.pair.recv(self.engine.kv_blocks(), target, msg.chunk_blocks, msg.tail_tokens,
                                            one_message=msg.last)
                    inc.receiving = asyncio.wrap_future(receive)
                if msg.await_ready:
                    answer(inc.identity, wire.MigReady(msg.mig_id, msg.stage, cached_blocks=cached))
                await self._received(inc)
                t_got = self.clock.monotonic()
                inc.last_heard = t_got
                join_ms = 0.0
                if msg.last:
                    await self._commit_at_boundary(inc, msg)
                    join_ms = (self.clock.monotonic() - t_got) * 1e3
                if not (msg.last and self.faults.get("drop_commit_ack")):
                    answer(inc.identity, wire.MigDone(msg.mig_id, msg.stage, join_ms=join_ms))
                log.debug("migration %s stage %d in: %d blocks, %.2f ms from message to done (received %.2f ms)",
                          msg.mig_id, msg.stage, msg.n_blocks, (self.clock.monotonic() - t_in) * 1e3,
                          (t_got - t_in) * 1e3)
                if msg.last:
                    inc.ended = True
                    self._forget(inc)
            except Aborted as exc:
                log.info("migration of %s from %s refused at stage %d: %s", inc.request_id, inc.src, msg.stage, exc)
                # The source waits for one or the other, depending on how far the stage got.
                answer(inc.identity, wire.MigReady(msg.mig_id, msg.stage, False, str(exc)))
                answer(inc.identity, wire.MigDone(msg.mig_id, msg.stage, False, str(exc)))
                await self._release(inc)

    def _join(self, inc: Incoming, msg: wire.MigStage) -> None:
        try:
            self.peers.prune()
            inc.pair = self.kv.dest_pair(msg.pair_key, msg.kv_address)
            self.peers.pair_used(msg.pair_key)
            identity, reply = inc.identity, self.host.reply_peer
            self.peers.relay_rendezvous(inc.pair, lambda m: reply(identity, m))
        except TransferError as exc:
            raise Aborted(str(exc)) from None

    async def _reserve(self, inc: Incoming, msg: wire.MigStage) -> None:
        """Room for the tokens the stage says (grown at a step boundary where the request outgrew it)."""
        bs = self.engine.block_size
        if stages.cdiv(msg.tokens, bs) > len(inc.ids):
            try:
                inc.ids = await self.boundary(lambda: self.engine.reserve(inc.request, msg.tokens))
            except EngineError as exc:
                raise Aborted(str(exc)) from None
        if msg.first_block + msg.n_blocks > len(inc.ids):
            raise Aborted(f"stage {msg.stage} sends blocks past the reservation")
        if not 0 <= msg.tail_tokens < bs or (msg.tail_tokens and not msg.n_blocks):
            raise Aborted(f"stage {msg.stage} sends a partial block of {msg.tail_tokens} tokens")

    async def _received(self, inc: Incoming) -> None:
        if inc.receiving is None:
            return
        try:
            got = await inc.receiving
        except TransferError as exc:
            inc.cause = inc.cause or TRANSFER_FAILED
            raise Aborted(f"KV transfer failed: {exc}") from None
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise
            # Its pair was closed before the receive ran (the source declared dead): nothing was written.
            raise Aborted("KV transfer cancelled: its pair was closed") from None
        finally:
            inc.receiving = None
        M_BYTES.labels("in").inc(got)

    async def _commit_at_boundary(self, inc: Incoming, msg: wire.MigStage) -> None:
        if msg.state is None:
            raise Aborted("the last stage carried no request state")
        slow = self.faults.get("slow_commit_s")
        if slow:  # tests: the commit waits as if behind a long engine step
            await self.clock.sleep(slow)
        try:
            await self.boundary(lambda: self._commit(inc, msg.state))
        except EngineError as exc:
            raise Aborted(str(exc)) from None

    def _commit(self, inc: Incoming, state: wire.RequestState) -> None:
        if inc.aborted:
            raise EngineError("the source aborted the migration before the commit")
        self.engine.commit(inc.request_id, state)
        epoch = state.epoch + 1
        host = self.host
        r = inc.request  # its SLO and what its source measured of it travelled with it
        self.requests.take_over(inc.request_id, inc.request.reply_to, epoch, state.emitted, inc.request.traceparent,
                                slo_mark(r.slo_ttft_ms, r.slo_tpot_ms, r.arrival_time, r.first_token_time,
                                         r.first_token_index),
                                prompt_tokens=len(inc.request.prompt_token_ids), priority=inc.request.priority,
                                adapter=inc.request.adapter, session=inc.request.session)
        host.proxies.seen(inc.request.reply_to)  # its proxy has not spoken to us yet: count from now
        host.announce_move(inc.request_id, inc.request.reply_to, host.instance_id, host.request_address, epoch,
                           state.emitted)
        host.wake.set()

    # ---------------------------------------------------------------- the end

    async def _end(self, inc: Incoming) -> None:
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
        if inc.cause:
            M_RELEASED.labels("destination", inc.cause).inc()
        self._forget(inc)

    def _forget(self, inc: Incoming) -> None:
        if self.incoming.pop(inc.mig_id, None) is not None:
            M_IN_FLIGHT.labels("destination").dec()
            self.host.wake.set()

    async def _watch(self, inc: Incoming) -> None:
        """Release a reservation whose source went quiet (it died, or lost our answers)."""
        idle = self.cfg.dest_idle_timeout_s
        while not inc.ended:
            await self.clock.sleep(min(idle, 1.0) / 2)
            if inc.ended or inc.busy.locked():
                continue  # a stage in progress has its own timeouts
            if self.clock.monotonic() - inc.last_heard > idle:
                log.warning("migration of %s from %s: no word from the source for %.1fs; releasing its blocks",
                            inc.request_id, inc.src, idle)
                inc.cause = inc.cause or LEASE_EXPIRED
                await self._end(inc)
