"""The manager's request listings (ListRequests): answered from the engine's request rows, at a step boundary
or, while the rows are fresh and nothing waits for the boundary, at once during a step."""

from __future__ import annotations

import logging
from typing import Callable

import msgspec

from daemons import wire
from daemons.clock import Clock
from daemons.engine.base import Engine
from daemons.instance.mailbox import Mailbox
from daemons.instance.standing import Identity
from daemons.instance.telemetry import LISTING_WINDOW_S, LONG_STEP_S, MOVED_LATELY_S, M_QUERY, ROWS_EVERY_S
from daemons.requests import RequestTable

log = logging.getLogger("llumnix.instance")


class Listings:
    """Owns the listings that wait for the boundary and the engine's request rows as of the end of the last
    step or boundary (None: not kept, or stale), kept for LISTING_WINDOW_S after a listing. ``others_wait``:
    whether requests, aborts or engine calls wait for the boundary (a listing must then wait with them)."""

    def __init__(self, engine: Engine, requests: RequestTable, mailbox: Mailbox, others_wait: Callable[[], bool],
                 tell_manager: Callable[[wire.Message], None], ident: Identity, clock: Clock):
        self.engine = engine
        self.requests = requests
        self.mailbox = mailbox
        self.others_wait = others_wait
        self.tell_manager = tell_manager
        self.ident = ident
        self.clock = clock
        self._queries: list[tuple[int, float]] = []  # (query id, arrival) answered at the next boundary
        self.rows: list[wire.RequestLoad] | None = None
        self._rows_until = 0.0  # rows are kept until then
        self._rows_at = 0.0  # when they were read

    def waiting(self) -> bool:
        """(Any thread) Listings wait for the boundary. Reads only."""
        return bool(self._queries)

    def on_list_requests(self, qid: int) -> None:
        """A request listing: during steps, answered now from the rows of the last step or boundary when they
        are kept and nothing waits for the boundary (the step in flight may be long; nothing but steps has
        touched the engine since), else at the next boundary: a request, an abort (a fenced copy, say) or an
        engine call (a migration's commit) that waits for it must be in the answer, as it would be there."""
        now = self.clock.monotonic()
        self._rows_until = now + LISTING_WINDOW_S
        if self.mailbox.stepping and self.rows is not None and not self._queries and not self.others_wait():
            self._answer(qid, now, self.rows)
        else:
            self._queries.append((qid, now))
            self.mailbox.wake.set()

    def at_boundary(self) -> None:
        """Read the rows if they are kept (or asked for), and answer the listings that waited."""
        self.rows = None
        if self._queries or self.clock.monotonic() < self._rows_until:
            self.rows, self._rows_at = self.engine.requests(), self.clock.monotonic()
        if self._queries:
            for qid, arrived in self._queries:
                self._answer(qid, arrived, self.rows)
            self._queries.clear()

    def rows_due(self, step_s: float, now: float) -> bool:
        """(Engine thread, after a step) Whether to read the rows now: a long step, or listings lately, and
        not read within ROWS_EVERY_S."""
        return (step_s >= LONG_STEP_S or now < self._rows_until) and now - self._rows_at >= ROWS_EVERY_S

    def stepped(self, rows: list[wire.RequestLoad] | None) -> None:
        """(Event loop) Rows a step read: a few steps old, they stay good until the boundary (only steps have
        run since)."""
        if rows is not None and self.mailbox.stepping:
            self.rows, self._rows_at = rows, self.clock.monotonic()

    def _answer(self, qid: int, arrived: float, rows: list[wire.RequestLoad]) -> None:
        migrating = self.requests.migrating()
        if migrating:  # pre-copy too, not only the suspended last stage
            rows = [msgspec.structs.replace(r, state="migrating") if r.request_id in migrating else r for r in rows]
        self.tell_manager(wire.RequestList(qid, self.ident.instance_id, rows,
                                           self.requests.moved_lately(MOVED_LATELY_S)))
        M_QUERY.observe(self.clock.monotonic() - arrived)
        log.debug("listing %d: %d rows (%s), %d requests held", qid, len(rows),
                  "during a step" if self.mailbox.stepping else "at the boundary", len(self.requests))
