"""The instance's outgoing paths: tokens, failures, moves and give-backs to the proxies that own the requests
(``TokenPath``, over daemons/proxylinks.py), and messages to the manager (``ManagerLine``)."""

from __future__ import annotations

import logging
from typing import Callable

import zmq.asyncio

from daemons import runtime, wire
from daemons.instance.standing import Identity
from daemons.instance.telemetry import M_ADAPTER_TOKENS, M_FINISHED, M_TOKENS
from daemons.proxylinks import ProxyLinks
from daemons.requests import RequestTable, SloMark

log = logging.getLogger("llumnix.instance")


class ManagerLine:
    """The DEALER socket to the manager. Never waits on the manager: while it is away, messages are dropped,
    and it will ask us to register."""

    def __init__(self, sock: zmq.asyncio.Socket):
        self.sock = sock

    def tell(self, msg: wire.Message) -> None:
        if not runtime.send_now(self.sock, wire.encode(msg)):
            log.debug("manager unreachable or its queue full; dropped a %s", type(msg).__name__)

    async def recv(self) -> wire.Message | None:
        return wire.decode(await self.sock.recv())


class TokenPath:
    """Sends to proxies on ``proxies``, stamping each token with the placement epoch the request table holds
    (``requests.advance``: a finished request is forgotten there)."""

    def __init__(self, proxies: ProxyLinks, requests: RequestTable, ident: Identity,
                 judge: Callable[[SloMark, wire.TokenOut], None] | None = None):
        """``judge``: sees each token of a request with an SLO as it goes out (daemons/instance/attainment.py)."""
        self.proxies = proxies
        self.requests = requests
        self.ident = ident
        self.judge = judge

    @property
    def instance_id(self) -> str:
        return self.ident.instance_id

    def send(self, address: str, msg: wire.Message) -> None:
        self.proxies.send(address, msg)

    def flush(self) -> None:
        """What waited for a full queue goes out now if it can."""
        self.proxies.flush()

    def emit(self, outputs: list[wire.TokenOut]) -> None:
        by_proxy: dict[str, list[wire.TokenOut]] = {}
        advance, judge = self.requests.advance, self.judge
        for out in outputs:
            entry = advance(out.request_id, out.index, out.finish_reason is not None)
            if entry is None:
                continue
            if entry.slo is not None and judge is not None:
                judge(entry.slo, out)
            out.epoch = entry.epoch
            if entry.adapter:
                M_ADAPTER_TOKENS.labels(entry.adapter).inc()
            by_proxy.setdefault(entry.reply_to, []).append(out)
            if out.finish_reason is not None:
                M_FINISHED.labels(out.finish_reason).inc()
        for address, batch in by_proxy.items():
            self.send(address, wire.TokenBatch(self.ident.instance_id, batch))
        M_TOKENS.inc(len(outputs))

    def fail(self, request_id: str, address: str, message: str, retryable: bool, status: int = 503) -> None:
        self.send(address, wire.RequestFailed(request_id, self.ident.instance_id, message, retryable, status))

    def give_back(self, request_id: str, address: str, reason: str) -> None:
        """The proxy dispatches the request again (it produced nothing here)."""
        self.send(address, wire.Redispatch(request_id, self.ident.instance_id, reason))

    def announce_move(self, request_id: str, address: str, instance_id: str, request_address: str, epoch: int,
                      from_index: int) -> None:
        """Tell the owning proxy that a request's tokens (from ``from_index``, of ``epoch``) and its aborts now
        go through ``instance_id``: sent by a migration's destination at its commit and by the source once
        it knows, so that the proxy learns it even if one of the two dies."""
        self.send(address, wire.Moved(request_id, instance_id, request_address, epoch, from_index))
