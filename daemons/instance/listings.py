"""The manager's request listings (ListRequests, for ``llumnixctl requests``, ``describe`` and the lookup before
``migrate REQ``): answered at once by the event loop from the llumlet's own request table, never waiting for
the engine's step, whatever its length (a long prefill, a tensor-parallel step on a contended host)."""

from __future__ import annotations

import logging
from typing import Callable

from daemons import wire
from daemons.instance.shared import Shared
from daemons.instance.telemetry import LISTING_WINDOW_S, LONG_STEP_S, MOVED_LATELY_S, M_QUERY, ROWS_EVERY_S

log = logging.getLogger("llumnix.instance")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Listings:
    """Owns the engine's request rows as of the end of the last step or boundary (``rows``; None: not kept),
    kept for LISTING_WINDOW_S after a listing: the details of a listing's rows (state, blocks, tokens).

    Which requests a listing names is the llumlet's own answer, as the next boundary will leave it: the request
    table (``requests``: admitted, taken over by migration, migrating out), plus the Submits waiting in the
    inbox (``pending()``: waiting), less the requests whose Abort waits there (gone at the boundary; a fenced
    copy among them must not be taken for the request). A request the rows do not show yet (admitted since they
    were read, or no rows kept) gets its row from the table: waiting until its first token, then running with
    the blocks its tokens fill."""

    def __init__(self, shared: Shared, pending: Callable[[], list[wire.Submit | wire.Abort]]):
        self.engine, self.requests, self.tell_manager, self.ident, self.clock = (
            shared.engine, shared.requests, shared.tell_manager, shared.ident, shared.clock)
        self.pending = pending
        self.rows: list[wire.RequestLoad] | None = None
        self._rows_until = 0.0  # rows are kept until then
        self._rows_at = 0.0  # when they were read

    def on_list_requests(self, qid: int) -> None:
        """(Event loop) A request listing: answered now, and the engine's rows kept current for the next ones."""
        arrived = self.clock.monotonic()
        self._rows_until = arrived + LISTING_WINDOW_S
        rows = self.current()
        self.tell_manager(wire.RequestList(qid, self.ident.instance_id, rows, self.requests.moved_lately(MOVED_LATELY_S)))
        M_QUERY.observe(self.clock.monotonic() - arrived)
        log.debug("listing %d: %d rows (engine rows %s)", qid, len(rows),
                  "kept" if self.rows is not None else "not kept: from the request table")

    def current(self) -> list[wire.RequestLoad]:
        """(Event loop) The rows a listing answers with now."""
        pending = self.pending()
        dropped = {m.request_id for m in pending if isinstance(m, wire.Abort) and self._drops(m)}
        migrating = self.requests.migrating()
        out: list[wire.RequestLoad] = []
        seen: set[str] = set()
        for r in self.rows or ():  # the engine's order: running, suspended, waiting
            entry = self.requests.get(r.request_id)
            if entry is None or r.request_id in dropped:
                continue  # finished or moved out since the rows were read, or about to be aborted
            seen.add(r.request_id)
            out.append(wire.RequestLoad(r.request_id, "migrating" if r.request_id in migrating else r.state, r.blocks,
                                        r.prompt_tokens, max(r.output_tokens, entry.emitted), r.priority))
        for rid, entry in self.requests.items():
            if rid in seen or rid in dropped:
                continue
            seen.add(rid)
            state = "migrating" if rid in migrating else "running" if entry.emitted else "waiting"
            blocks = _cdiv(entry.prompt_tokens + entry.emitted, self.engine.block_size) if entry.emitted else 0
            out.append(wire.RequestLoad(rid, state, blocks, entry.prompt_tokens, entry.emitted, entry.priority))
        for m in pending:
            if isinstance(m, wire.Submit) and m.request_id not in seen:
                seen.add(m.request_id)
                out.append(wire.RequestLoad(m.request_id, "waiting", 0, len(m.prompt_token_ids),
                                            len(m.output_token_ids), m.priority))
        return out

    def _drops(self, msg: wire.Abort) -> bool:
        """Whether the boundary's take-in of ``msg`` ends the copy held here (as ``RequestTable.abort`` says HERE)."""
        entry = self.requests.get(msg.request_id)
        return entry is not None and not entry.migrating and (not msg.epoch or msg.epoch == entry.epoch)

    # ------------------------------------------------------------------ the engine's rows (the details)

    def at_boundary(self) -> None:
        """Read the rows if they are kept."""
        self.rows = None
        if self.clock.monotonic() < self._rows_until:
            self.rows, self._rows_at = self.engine.requests(), self.clock.monotonic()

    def rows_due(self, step_s: float, now: float) -> bool:
        """(Engine thread, after a step) Whether to read the rows now: a long step, or listings lately, and
        not read within ROWS_EVERY_S."""
        return (step_s >= LONG_STEP_S or now < self._rows_until) and now - self._rows_at >= ROWS_EVERY_S

    def stepped(self, rows: list[wire.RequestLoad] | None) -> None:
        """(Event loop) Rows a step read: a few steps old, they stay good until the boundary (only steps have
        run since)."""
        if rows is not None:
            self.rows, self._rows_at = rows, self.clock.monotonic()
