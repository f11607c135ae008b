"""``Side``: what the two sides of the moves (``Source``, ``Destination``) both receive from the migrator."""

from __future__ import annotations

from typing import Callable

from daemons.clock import Clock
from daemons.config import MigrationConfig
from daemons.engine.base import Engine
from daemons.migration.peers import Peers
from daemons.migration.records import Host
from daemons.migration.transport import KvTransport
from daemons.requests import RequestTable


class Side:
    """One side of the moves: out of this instance (``Source``) or into it (``Destination``). Holds what both
    are given: the instance (``host``), the migration settings, the engine (between steps only, through
    ``boundary``), the request table, the KV transport, the peers and the clock."""

    def __init__(self, host: Host, cfg: MigrationConfig, engine: Engine, requests: RequestTable, boundary: Callable,
                 kv: KvTransport, peers: Peers, clock: Clock):
        self.host = host
        self.cfg = cfg
        self.engine = engine
        self.requests = requests
        self.boundary = boundary
        self.kv = kv
        self.peers = peers
        self.clock = clock
