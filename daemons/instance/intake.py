"""Requests in and out: Submits and Aborts from the proxies arrive on the request socket and wait in the
inbox; at each step boundary they are applied to the engine. Requests also leave here: aborted, given back
to their proxies (draining, rebalancing) or orphaned (their proxy is gone)."""

from __future__ import annotations

import logging
from types import MappingProxyType
from typing import TYPE_CHECKING, Callable, Mapping

import zmq.asyncio

from daemons import runtime, wire
from daemons.engine.base import EngineError, EngineRequest
from daemons.instance.shared import Shared
from daemons.instance.telemetry import (
    M_ADAPTER_REQUESTS, M_BAD_FRAMES, M_FAILOVERS_IN, M_FINISHED, M_ORPHANED, M_REDISPATCHED, M_REJECTED, M_REQUESTS)
from daemons.instance.tokens import TokenPath
from daemons.proxylinks import ProxyLinks
from daemons.requests import AbortAction, slo_mark

if TYPE_CHECKING:
    from daemons.migration import Migrator

log = logging.getLogger("llumnix.instance")

PEER_MESSAGES = (wire.MigStage, wire.MigAbort, wire.PrefixQuery, wire.KvRendezvous, wire.LinkOpen, wire.PullAsk,
                 wire.RehomePull)


class Intake:
    """Owns the inbox and, per proxy, how many of its Submits were taken in (``taken``, told back in the
    heartbeats). Serves the request socket: proxies' messages go to the inbox, migration peers' to the
    migrator (``migrator()``: None until the instance has started it)."""

    def __init__(self, shared: Shared, router: zmq.asyncio.Socket | None, tokens: TokenPath, proxies: ProxyLinks,
                 on_cache_sync: Callable[[str], None]):
        self.engine, self.requests, self.phases, self.standing = (shared.engine, shared.requests, shared.phases,
                                                                  shared.standing)
        self.wake, self.migrator, self.clock = shared.mailbox.wake, shared.migrator, shared.clock
        self.router = router
        self.tokens = tokens
        self.proxies = proxies
        self.on_cache_sync = on_cache_sync
        self._inbox: list[wire.Submit | wire.Abort] = []
        self._taken: dict[str, int] = {}  # by proxy token address: its Submits taken in at step boundaries

    @property
    def taken(self) -> Mapping[str, int]:
        return MappingProxyType(self._taken)

    def waiting(self) -> bool:
        """(Any thread) Requests or aborts wait for the boundary. Reads only."""
        return bool(self._inbox)

    def pending(self) -> list[wire.Submit | wire.Abort]:
        """(Event loop) The Submits and Aborts that the next boundary takes in, in order. Reads only."""
        return list(self._inbox)

    def post(self, msg: wire.Submit | wire.Abort) -> None:
        """Take ``msg`` in at the next boundary."""
        self._inbox.append(msg)
        self.wake.set()

    # ------------------------------------------------------------------ the request socket

    async def serve(self) -> None:
        async for batch in runtime.receive(self.router, multipart=True):
            for frames in batch:
                try:
                    self.take(frames)
                except Exception:  # one peer's message must not end the request socket's loop (nor the instance)
                    M_BAD_FRAMES.inc()
                    log.exception("a message on the request socket broke its handler; dropped it")
            self.wake.set()

    def take(self, frames: list[bytes]) -> None:
        msg = wire.decode(frames[-1]) if len(frames) == 2 else None
        if isinstance(msg, PEER_MESSAGES):
            self.migrator().on_peer_message(frames[0], msg)
            return
        if isinstance(msg, wire.ProxyAlive):
            self.proxies.seen(msg.token_address)
            return
        if isinstance(msg, wire.CacheSync):
            if msg.reply_to:
                self.on_cache_sync(msg.reply_to)
            return
        if isinstance(msg, wire.Submit):
            self.proxies.seen(msg.reply_to)
            migrator = self.migrator()
            if msg.pull_from and migrator is not None:  # its leading blocks come from there first (pulls.py)
                migrator.pulls.start(msg, self.post)
                return
        elif isinstance(msg, wire.Abort) and (migrator := self.migrator()) is not None:
            migrator.pulls.drop(msg.request_id)  # (one waiting for its pull never reaches the engine)
        elif not isinstance(msg, wire.Abort):
            M_BAD_FRAMES.inc()
            if msg is not None or len(frames) != 2:
                log.warning("dropped an unexpected message on the request socket")
            return
        self._inbox.append(msg)

    def reply(self, identity: bytes, msg: wire.Message) -> None:
        """To a migration peer, on the socket it spoke on."""
        if not runtime.send_now(self.router, [identity, wire.encode(msg)]):
            log.warning("a migration peer's queue is full; dropped a %s", type(msg).__name__)

    # ------------------------------------------------------------------ at the boundary

    def apply(self) -> None:
        inbox, self._inbox = self._inbox, []
        migrator = self.migrator()
        for msg in inbox:
            if isinstance(msg, wire.Abort):
                self.on_abort(msg)
                continue
            if migrator is not None and migrator.receiving(msg.request_id):
                # A failover of a request we were receiving by migration (its source died): the proxy's new
                # placement wins; drop the reservation first, then take the request (counted then).
                migrator.spawn(self._after_reservation(migrator, msg))
                continue
            # The proxy counts this dispatch as ours until a heartbeat's load shows it (wire.Heartbeat.taken).
            self._taken[msg.reply_to] = self._taken.get(msg.reply_to, 0) + 1
            held = self.requests.get(msg.request_id)
            if held is not None and held.epoch == msg.epoch:
                continue  # sent again by a proxy that took it for lost (daemons/proxy/cluster/failover.py check_taken)
            reason = self.standing.give_back_reason()
            if reason:
                M_REDISPATCHED.inc()
                self.tokens.give_back(msg.request_id, msg.reply_to, reason)
                continue
            if held is not None and held.epoch < msg.epoch and not held.migrating:
                self.abort_local(msg.request_id)  # an older copy the proxy gave up on: the new placement wins
            self._admit(msg)

    def _admit(self, msg: wire.Submit) -> None:
        if msg.adapter and self.engine.adapters is None:
            M_REJECTED.inc()
            self.tokens.fail(msg.request_id, msg.reply_to, f"adapter {msg.adapter!r}: instance "
                             f"{self.tokens.ident.instance_id} serves no LoRA adapters (lora.slots = 0)", True, status=503)
            return
        try:
            self.engine.add_request(EngineRequest(msg.request_id, msg.prompt_token_ids, msg.sampling,
                                                  msg.arrival_time or self.clock.time(), msg.priority,
                                                  list(msg.output_token_ids), msg.adapter, msg.adapter_path,
                                                  msg.session, msg.retain_s))
        except EngineError as exc:
            M_REJECTED.inc()
            self.tokens.fail(msg.request_id, msg.reply_to, str(exc), False, status=400)
            return
        M_REQUESTS.inc()
        if msg.adapter:
            M_ADAPTER_REQUESTS.labels(msg.adapter).inc()
        if msg.output_token_ids:
            M_FAILOVERS_IN.inc()
            log.info("request %s failed over to us: continues at token %d (epoch %d)", msg.request_id,
                     len(msg.output_token_ids), msg.epoch)
        # A failover's re-prefill is not judged: its first token went out elsewhere.
        mark = None if msg.output_token_ids else slo_mark(msg.slo_ttft_ms, msg.slo_tpot_ms, msg.arrival_time,
                                                          predicted_ttft_ms=msg.predicted_ttft_ms)
        self.requests.admit(msg.request_id, msg.reply_to, msg.epoch, len(msg.output_token_ids), msg.traceparent, mark,
                            prompt_tokens=len(msg.prompt_token_ids), priority=msg.priority, adapter=msg.adapter,
                            session=msg.session)
        self.phases.admitted(msg.request_id)

    async def _after_reservation(self, migrator: Migrator, msg: wire.Submit) -> None:
        await migrator.cancel_incoming(msg.request_id)
        self.post(msg)

    def on_abort(self, msg: wire.Abort) -> None:
        action = self.requests.abort(msg.request_id, msg.epoch)
        migrator = self.migrator()
        if action is AbortAction.HERE:
            self.abort_local(msg.request_id)
        elif action is AbortAction.FOLLOW and migrator is not None:
            migrator.forward_abort(msg.request_id, msg.epoch)

    # ------------------------------------------------------------------ requests that leave (at the boundary)

    def abort_local(self, request_id: str) -> bool:
        self.requests.forget(request_id)
        self.phases.drop(request_id)
        if not self.engine.abort_request(request_id):
            return False
        M_FINISHED.labels("abort").inc()
        log.debug("request %s aborted", request_id)
        return True

    def redispatch_queued(self, only: set[str] | None = None) -> int:
        """Give queued requests that produced nothing back to their proxies, which dispatch them again (the
        engine is touched: call at a step boundary). ``only``: just these. Returns how many went."""
        gone = 0
        reason = self.standing.draining or "rebalancing"
        for r in self.engine.requests():
            rid = r.request_id
            entry = self.requests.get(rid)
            if (r.state != "waiting" or r.output_tokens or entry is None or entry.emitted
                    or (only is not None and rid not in only)):
                continue
            self.requests.forget(rid)
            self.phases.drop(rid)
            self.engine.abort_request(rid)
            self.tokens.give_back(rid, entry.reply_to, reason)
            M_REDISPATCHED.inc()
            gone += 1
        if gone:
            log.info("gave %d queued request(s) back for re-dispatch", gone)
        return gone

    def abort_orphans(self, address: str, why: str) -> int:
        """The proxy at ``address`` is gone: abort its requests, and forget it."""
        rids = self.requests.of_proxy(address)
        aborted = [rid for rid in rids if self.requests.abort(rid) is AbortAction.HERE and self.abort_local(rid)]
        n = len(aborted)
        if rids:
            M_ORPHANED.inc(n)
            log.warning("proxy %s is gone (%s): aborted its %d request(s)", address, why, n)
        for rid in aborted:  # a proxy that was only slow hears why, and places them again, rather than waiting
            self.tokens.fail(rid, address, f"aborted on instance {self.tokens.instance_id}: its proxy was taken "
                                           f"for gone ({why})", True)
        self.proxies.drop(address)
        self._taken.pop(address, None)
        return n
