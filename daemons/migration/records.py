"""What a migration is made of: its outcomes as exceptions, what the migrator needs of its instance, and
the state of one move on each side."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

import zmq.asyncio

from daemons import wire
from daemons.proxylinks import ProxyLinks
from daemons.migration.transport import KvPair
from daemons.security import Security


class Aborted(Exception):
    """Ends a migration; the message is the reason reported to the operator."""


class DestinationFailed(Aborted):
    """The destination's end failed the move: it did not answer, its connection dropped, the copy to it failed."""


class Refused(DestinationFailed):
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
    tracer: object  # daemons/tracing.py's Tracer; None: tracing off

    def reply_peer(self, identity: bytes, msg: wire.Message) -> None: ...

    def announce_move(self, request_id: str, address: str, instance_id: str, request_address: str, epoch: int,
                      from_index: int) -> None: ...

    def abort_local(self, request_id: str) -> bool: ...


@dataclass
class Outgoing:
    mig_id: str
    dst_address: str = ""
    replies: asyncio.Queue = field(default_factory=asyncio.Queue)  # MigReady / MigDone / GONE / DEAD
    dst: str = ""  # the destination's instance id (its KV pair's name here)
    dead: asyncio.Event = field(default_factory=asyncio.Event)  # the manager declared the destination dead


# A destination that does not answer a prefix query within this is taken to hold nothing. It answers at its
# next step boundary, after a long prefill step or on a loaded host seconds away: the order's choice may wait.
PREFIX_QUERY_TIMEOUT_S = 5.0
GONE = object()  # put in a migration's replies when the connection to its destination drops
DEAD = object()  # ... when the manager declares its destination dead (wire.PeerDead)

# Why a destination released a reservation that never committed, besides its source's word (MigAbort) or a
# refused stage: its source was declared dead (at once), its copy failed (a dead source's connection closes: at
# once, often before the manager's word), or it heard nothing for dest_idle_timeout_s (the lease).
PEER_DEAD, LEASE_EXPIRED, TRANSFER_FAILED = "peer_dead", "lease_expired", "transfer_failed"


@dataclass
class Incoming:
    mig_id: str
    request_id: str
    identity: bytes  # the source's socket identity on our ROUTER: replies go there
    src: str
    request: wire.MigratingRequest
    pair: KvPair | None = None
    last_heard: float = 0.0  # when the source last spoke (the migrator's clock)
    busy: asyncio.Lock = field(default_factory=asyncio.Lock)  # stages of one migration run one at a time
    receiving: asyncio.Future | None = None  # a Gloo receive that may still write our blocks
    ids: list[int] = field(default_factory=list)  # the blocks reserved so far, in token order
    ended: bool = False
    aborted: bool = False  # the source sent MigAbort (or was declared dead): never commit
    cause: str = ""  # PEER_DEAD, TRANSFER_FAILED or LEASE_EXPIRED: why it was released without its source's word
