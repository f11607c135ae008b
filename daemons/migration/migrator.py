"""The Migrator: both roles of one instance, its KV transport, the pacing baseline, its tasks."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import zmq
import zmq.asyncio
import zmq.utils.monitor

from daemons.config import MigrationConfig
from daemons.engine.base import Engine
from daemons.kvtransfer import KvTransfer
from daemons.migration.records import Host, Outgoing, Incoming
from daemons.pacing import Baseline, DutyPacer
from daemons.requests import RequestTable
from daemons.watchdog import Faults

log = logging.getLogger("llumnix.migration")

from daemons.migration.destination import DestinationMixin
from daemons.migration.peers import PeersMixin
from daemons.migration.source import SourceMixin


class Migrator(PeersMixin, SourceMixin, DestinationMixin):
    """Both roles of this instance. Built by the instance, which gives it ``boundary`` (run a function
    between engine steps) and its request table, through whose verbs a migration hands requests over."""

    def __init__(self, host: Host, cfg: MigrationConfig, engine: Engine, requests: RequestTable, boundary: Callable,
                 faults: Faults | None = None, kv=None):
        """``kv``: the KV transport (``source_pair``, ``dest_pair``, ``forget``, ``close``, ``address``; pairs
        with ``send`` and ``recv`` returning futures): Gloo pairs (daemons/kvtransfer.py) unless given
        (tests/support/kv.py moves blocks in memory)."""
        self.inst = host
        self.cfg = cfg
        self.engine = engine
        self.requests = requests
        self.boundary = boundary
        self.faults = faults or Faults("", "")
        self.kv = kv if kv is not None else KvTransfer(self.cfg.kv_host, self.cfg.kv_port, self.cfg.timeout_s)
        transport = getattr(engine, "kv_transport", None)  # a tensor-parallel engine moves KV rank by rank
        if transport is not None:
            self.kv = transport(self.kv, boundary)
        self.outgoing: dict[str, Outgoing] = {}  # by migration id
        self.incoming: dict[str, Incoming] = {}  # by migration id
        self.peers: dict[str, zmq.asyncio.Socket] = {}  # destination request address -> our DEALER
        self._peer_tasks: dict[str, tuple] = {}  # its reader and watcher
        self._peer_used: dict[str, float] = {}  # destination request address -> loop time of its last use
        self._pair_used: dict[str, float] = {}  # KV pair name (a destination id, or a source's key) -> last use
        self._next_prune = 0.0
        self._dst_locks: dict[str, asyncio.Lock] = {}
        self.committed = 0
        self.aborted = 0
        self._prefix_queries = 0
        self._prefix_waits: dict[int, asyncio.Future] = {}
        self._tasks: set[asyncio.Task] = set()
        self.step_baseline = Baseline()  # engine steps while no migration runs here
        self._pacers: dict[str, DutyPacer] = {}  # by migration id, while its pre-copy sends

    @property
    def busy(self) -> int:
        return len(self.outgoing) + len(self.incoming)

    def stepped(self, step_s: float) -> None:
        """(Instance, after each engine step) A step with no migration here joins the baseline; one during a
        paced pre-copy adjusts that copy's duty."""
        if self._pacers:
            baseline = self.step_baseline.value()
            for pacer in self._pacers.values():
                pacer.step(step_s, baseline)
        elif not self.outgoing and not self.incoming:
            self.step_baseline.add(step_s)

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        for inc in list(self.incoming.values()):
            inc.ended = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.kv.close()
