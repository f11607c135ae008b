"""An instance's requests: whose tokens they are, at which placement epoch, and how far they got.

The one home of per-request state on an instance. The llumlet (daemons/instance/), the migrator
(daemons/migration/) and the failover path all change it through the verbs below, so each rule of
ownership lives here once:

- ``admit``      a proxy placed the request here (first dispatch, or a failover that re-prefills it);
- ``take_over``  a migration committed here: the request continues at the index its source reached;
- ``hand_over``  a migration out of here committed: forget the request, remember where it went so that a
                 late abort can follow it;
- ``forget``     it finished or was aborted;
- ``abort``      what an Abort for it means here (see ``AbortAction``).

Placement epochs (the fencing token): every placement of a request has an epoch larger than the one it
replaces. A first dispatch is epoch 1, a migration commit is the source's epoch + 1, a failover is the
proxy's current epoch + 1. Token outputs carry the epoch, and the proxy accepts them only from its current
(instance, epoch) owner, so a copy that lost a race (a late commit against an abort) can never reach the
client; the proxy aborts it by epoch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from daemons.clock import Clock


@dataclass(slots=True)
class SloMark:
    """A request's SLO and what was measured of it so far (judged where it finishes: daemons/instance/attainment.py)."""

    ttft_s: float  # targets (0: none of that kind)
    tpot_s: float
    arrival: float  # when the proxy took it (wall clock: wire.Submit.arrival_time)
    first_time: float = 0.0  # when its first token went out (wall clock; 0: not yet)
    first_index: int = 0  # that token's output index
    predicted_ttft_s: float = 0.0  # what the proxy predicted its TTFT would be (0: nothing)


def slo_mark(ttft_ms: float, tpot_ms: float, arrival: float, first_time: float = 0.0,
             first_index: int = 0, predicted_ttft_ms: float = 0.0) -> SloMark | None:
    """The mark of a request with these targets (ms, as wire.Submit and wire.MigratingRequest carry them), or with
    a predicted TTFT to judge; None when it has neither."""
    if not (ttft_ms > 0 or tpot_ms > 0 or predicted_ttft_ms > 0):
        return None
    return SloMark(ttft_ms / 1000.0, tpot_ms / 1000.0, arrival, first_time, first_index, predicted_ttft_ms / 1000.0)


@dataclass(slots=True)
class Entry:
    reply_to: str  # the owning proxy's token address
    epoch: int  # placement epoch of the copy held here
    emitted: int = 0  # index of the next token the client is to see
    arrived: float = 0.0  # monotonic time it came here by migration (0: placed by a proxy)
    migrating: bool = False  # a migration out of here is in progress
    abort_pending: bool = False  # an abort came while migrating: applied once the outcome is known
    traceparent: str = ""  # the request's trace (wire.Submit.traceparent; empty: untraced)
    prompt_tokens: int = 0  # its prompt's length (the request listings' row while the engine's is not read yet)
    priority: int = 0
    slo: SloMark | None = None  # its SLO, when it has one and is judged here
    adapter: str = ""  # its LoRA adapter (its tokens are counted by adapter)
    session: str = ""  # its session (wire.Submit.session; "": none): one with a request here is not idle


class AbortAction(enum.Enum):
    HERE = "here"  # abort the local copy now
    DEFERRED = "deferred"  # it is migrating out: the migration applies the abort when it ends
    FOLLOW = "follow"  # it moved away: forward the abort to ``RequestTable.moved_to``
    STALE = "stale"  # the abort names another epoch than the copy held here: ignore it
    UNKNOWN = "unknown"  # finished, never here, or moved too long ago


class RequestTable:
    MOVED_TTL_S = 300.0  # how long aborts follow a request that migrated away
    MOVED_MAX = 10_000

    def __init__(self, clock: Clock | None = None):
        """``clock``: what arrivals and hand-overs are timed on (the instance's)."""
        self.clock = clock or Clock()
        self._reqs: dict[str, Entry] = {}
        self._moved: dict[str, tuple[str, float]] = {}  # request id -> (destination's request address, when)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._reqs

    def __len__(self) -> int:
        return len(self._reqs)

    def get(self, request_id: str) -> Entry | None:
        return self._reqs.get(request_id)

    def items(self):
        return self._reqs.items()

    # ---------------------------------------------------------------- placement

    def admit(self, request_id: str, reply_to: str, epoch: int, emitted: int = 0, traceparent: str = "",
              slo: SloMark | None = None, *, prompt_tokens: int = 0, priority: int = 0, adapter: str = "",
              session: str = "") -> Entry:
        """Placed here by a proxy (``emitted`` > 0: a failover continuing at that index)."""
        self._moved.pop(request_id, None)
        entry = self._reqs[request_id] = Entry(reply_to, max(epoch, 1), emitted, traceparent=traceparent, slo=slo,
                                               prompt_tokens=prompt_tokens, priority=priority, adapter=adapter,
                                               session=session)
        return entry

    def take_over(self, request_id: str, reply_to: str, epoch: int, emitted: int, traceparent: str = "",
                  slo: SloMark | None = None, *, prompt_tokens: int = 0, priority: int = 0, adapter: str = "",
                  session: str = "") -> Entry:
        """A migration committed here: the request continues at ``emitted`` under ``epoch``."""
        self._moved.pop(request_id, None)
        entry = self._reqs[request_id] = Entry(reply_to, epoch, emitted, arrived=self.clock.monotonic(),
                                               traceparent=traceparent, slo=slo, prompt_tokens=prompt_tokens,
                                               priority=priority, adapter=adapter, session=session)
        return entry

    def hand_over(self, request_id: str, address: str) -> Entry | None:
        """A migration out of here committed: forget the request; aborts now follow it to ``address``."""
        entry = self._reqs.pop(request_id, None)
        now = self.clock.monotonic()
        self._moved[request_id] = (address, now)
        if len(self._moved) > self.MOVED_MAX or next(iter(self._moved.values()))[1] < now - self.MOVED_TTL_S:
            self._moved = {k: v for k, v in self._moved.items() if v[1] > now - self.MOVED_TTL_S}
        return entry

    def forget(self, request_id: str) -> Entry | None:
        return self._reqs.pop(request_id, None)

    def reclaim(self, request_id: str) -> Entry | None:
        """A migration out of here ended without knowing whether the destination committed (its answer never
        came): the copy here resumes under a new epoch. If the destination did commit, it claimed the same
        epoch, and the proxy keeps exactly one of the two and aborts the other."""
        entry = self._reqs.get(request_id)
        if entry is not None:
            entry.epoch += 1
        return entry

    # ---------------------------------------------------------------- progress

    def advance(self, request_id: str, index: int, finished: bool) -> Entry | None:
        """A token at ``index`` went out; a finished request is forgotten. None if it is not ours."""
        entry = self._reqs.get(request_id)
        if entry is None:
            return None
        entry.emitted = index + 1
        if finished:
            del self._reqs[request_id]
        return entry

    # ---------------------------------------------------------------- migration out

    def begin_migration(self, request_id: str) -> Entry | None:
        """Mark it migrating out; None if it is not here or already migrating."""
        entry = self._reqs.get(request_id)
        if entry is None or entry.migrating:
            return None
        entry.migrating = True
        return entry

    @staticmethod
    def end_migration(entry: Entry) -> bool:
        """The migration ``begin_migration`` started ended (either way; after a commit the entry has already
        been handed over); True if an abort waited for it."""
        entry.migrating = False
        pending, entry.abort_pending = entry.abort_pending, False
        return pending

    # ---------------------------------------------------------------- aborts and queries

    def abort(self, request_id: str, epoch: int = 0) -> AbortAction:
        """What an Abort for ``request_id`` (of placement ``epoch``; 0: whichever copy) means here."""
        entry = self._reqs.get(request_id)
        if entry is None:
            return AbortAction.FOLLOW if request_id in self._moved else AbortAction.UNKNOWN
        if epoch and epoch != entry.epoch:
            return AbortAction.STALE
        if entry.migrating:
            entry.abort_pending = True
            return AbortAction.DEFERRED
        return AbortAction.HERE

    def moved_lately(self, within_s: float) -> dict[str, str]:
        """Requests handed over in the last ``within_s`` seconds: id -> the destination's request address."""
        since = self.clock.monotonic() - within_s
        return {rid: address for rid, (address, at) in self._moved.items() if at > since}

    def moved_to(self, request_id: str) -> str | None:
        """Where it migrated (once: an abort follows a request one hop at a time)."""
        moved = self._moved.pop(request_id, None)
        return None if moved is None else moved[0]

    def of_proxy(self, address: str) -> list[str]:
        return [rid for rid, e in self._reqs.items() if e.reply_to == address]

    def proxies(self) -> set[str]:
        return {e.reply_to for e in self._reqs.values()}

    def arrivals(self) -> dict[str, float]:
        """Requests that came by migration, and when (monotonic): they stay a while (cooldown)."""
        return {rid: e.arrived for rid, e in self._reqs.items() if e.arrived > 0}

    def sessions(self) -> set[str]:
        """The sessions of the requests held here (running, queued or migrating out)."""
        return {e.session for e in self._reqs.values() if e.session}

    def migrating(self) -> set[str]:
        return {rid for rid, e in self._reqs.items() if e.migrating}
