"""``Side``: what the two sides of the moves (``Source``, ``Destination``) both receive from the migrator, as one
``Parts``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from daemons.clock import Clock
from daemons.config import MigrationConfig
from daemons.engine.base import Engine
from daemons.migration.peers import Peers
from daemons.migration.records import Host
from daemons.migration.transport import KvTransport
from daemons.requests import RequestTable


@dataclass(frozen=True)
class Parts:
    """What the migrator gives both sides (and its link warm-up): the instance (``host``), the migration
    settings, the engine (between steps only, through ``boundary``), the request table, the KV transport, the
    peers and the clock."""

    host: Host
    cfg: MigrationConfig
    engine: Engine
    requests: RequestTable
    boundary: Callable
    kv: KvTransport
    peers: Peers
    clock: Clock


class Side:
    """One side of the moves: out of this instance (``Source``) or into it (``Destination``). Holds what both
    are given (``Parts``)."""

    def __init__(self, parts: Parts):
        self.host, self.cfg, self.engine, self.requests = parts.host, parts.cfg, parts.engine, parts.requests
        self.boundary, self.kv, self.peers, self.clock = parts.boundary, parts.kv, parts.peers, parts.clock
