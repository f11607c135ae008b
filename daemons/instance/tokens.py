"""The token path: tokens, failures and moves to the proxies that own the requests, and messages to the
manager and to peers."""

from __future__ import annotations

import logging

from daemons import runtime, wire
from daemons.instance.telemetry import M_FINISHED, M_TOKENS

log = logging.getLogger("llumnix.instance")


class TokenPathMixin:
    """Of the Instance: sends on ``proxies`` (daemons/proxylinks.py), ``msock`` and ``rsock``."""

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
