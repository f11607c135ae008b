"""Requests and aborts from the proxies: received on the request socket, applied to the engine between steps."""

from __future__ import annotations

import logging
import time

from daemons import runtime, wire
from daemons.engine.base import EngineError, EngineRequest
from daemons.instance.telemetry import M_BAD_FRAMES, M_FAILOVERS_IN, M_FINISHED, M_REDISPATCHED, M_REJECTED, M_REQUESTS
from daemons.requests import AbortAction

log = logging.getLogger("llumnix.instance")


class IntakeMixin:
    """Of the Instance: fills ``inbox`` and ``requests`` (daemons/requests.py) between steps."""

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
            held = self.requests.get(msg.request_id)
            if held is not None and held.epoch == msg.epoch:
                continue  # sent again by a proxy that took it for lost (daemons/proxy/failover.py check_taken)
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
            self.requests.admit(msg.request_id, msg.reply_to, msg.epoch, len(msg.output_token_ids), msg.traceparent)
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
                try:
                    self._take(frames)
                except Exception:  # one peer's message must not end the request socket's loop (nor the instance)
                    M_BAD_FRAMES.inc()
                    log.exception("a message on the request socket broke its handler; dropped it")
            self.wake.set()

    def _take(self, frames: list[bytes]) -> None:
        msg = wire.decode(frames[-1]) if len(frames) == 2 else None
        if isinstance(msg, (wire.MigStage, wire.MigAbort, wire.PrefixQuery, wire.KvRendezvous)):
            self.migrator.on_peer_message(frames[0], msg)
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
        elif not isinstance(msg, wire.Abort):
            M_BAD_FRAMES.inc()
            if msg is not None or len(frames) != 2:
                log.warning("dropped an unexpected message on the request socket")
            return
        self.inbox.append(msg)
