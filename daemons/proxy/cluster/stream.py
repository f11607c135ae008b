"""One request's stream: token outputs in index order, each index once, from its current owner (instance,
epoch) only; and the errors that end a dispatch. A stream reads no clock: its owner passes the time."""

from __future__ import annotations

import asyncio
import logging

from daemons import wire
from daemons.policy.slo import NO_SLO, RequestSlo
from daemons.proxy.cluster.telemetry import M_DUPLICATES, M_MIGRATION_GAP

log = logging.getLogger("llumnix.proxy")


class NoInstance(Exception):
    """No live instance can take the request."""

    def __init__(self, message: str, reason: str = "no_instance"):
        super().__init__(message)
        self.reason = reason


class Overloaded(Exception):
    """Admission control: the cluster's queued work is past the bounds for this request's priority.
    ``retry_after_s``: when to try again (0: admission.retry_after_s)."""

    def __init__(self, message: str, reason: str, retry_after_s: float = 0.0):
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


class Stream:
    """One request's outputs, in index order, each index once, from its current owner only."""

    __slots__ = ("request_id", "submit", "ready", "next_index", "early", "waiter", "done", "error", "status",
                 "instance_id", "address", "tried", "sent_at", "given_back", "epoch", "owner_from", "token_ids",
                 "failovers", "progress_at", "deadline", "fenced", "exclude", "tenant", "weight", "trace",
                 "prefix_keys", "starts", "first_by", "predicted", "disagg", "gap_from", "moves", "slo", "fits",
                 "tiers", "pull", "how")

    def __init__(self, request_id: str, submit: wire.Submit, timeout_s: float = 0.0, now: float = 0.0,
                 slo_: RequestSlo = NO_SLO):
        """``now``: its owner's clock (daemons.clock.Clock ``monotonic``); ``timeout_s`` counts from it. ``slo_``:
        its SLO class and targets (daemons/policy/slo.py ``Classes.of``, where the request came in)."""
        self.request_id = request_id
        self.submit = submit
        self.slo = slo_
        self.ready: list[wire.TokenOut] = []
        self.next_index = 0
        self.early: dict[int, wire.TokenOut] = {}
        self.waiter: asyncio.Future | None = None  # take()'s, while it waits (cheaper than an asyncio.Event)
        self.done = False
        self.error: str | None = None
        self.status = 200
        self.instance_id = ""  # the owner: (instance_id, epoch)
        self.address = ""
        self.tried: list[str] = []
        self.sent_at = 0.0
        self.given_back = 0  # times a draining instance gave it back (not failed attempts)
        self.epoch = 0
        self.owner_from = 0  # the first index the current owner produces
        self.starts: list[tuple[int, int]] = []  # (epoch, first index) of every placement taken, in epoch order
        self.token_ids: list[int] = []  # every token accepted, in order: a failover re-prefills them
        self.failovers = 0
        self.progress_at = now
        self.first_by = 0.0  # (an SLO's TTFT target) past this with no token yet, it gives up: 429 (0: never)
        self.predicted: tuple[float, float] | None = None  # (TTFT, TPOT) predicted where it was first placed
        self.deadline = now + timeout_s if timeout_s > 0 else 0.0
        self.fenced: set[tuple[str, int]] = set()  # copies already told to abort
        self.exclude: list[str] = []  # instances that failed it: not placed there again
        # (Admission by SLO) the instances predicted to meet its TTFT target when it was admitted: its first
        # placement is among them (None: any). Dispatch by another policy would otherwise place it where admission
        # did not look.
        self.fits: frozenset[str] | None = None
        self.tenant = ""  # the API key it was charged to in the fair queue (daemons/proxy/cluster/fairgate.py)
        self.weight = 1.0
        self.trace = None  # its spans (daemons/proxy/cluster/traces.py StreamTrace), with tracing on
        self.prefix_keys: list[int] | None = None  # its prompt's block keys (llumnix-cache), once computed
        self.disagg = ""  # with roles: where it was decided to prefill (daemons/policy/disagg.py DECISIONS)
        self.tiers: dict[str, tuple[int, int]] | None = None  # its cached leading blocks by instance and tier
        self.pull: tuple[str, int] = ("", 0)  # the prefix pull its placement chose: (from, blocks)
        self.how = ""  # a session's turn: how it was placed (daemons/policy/sessions.py HOW)
        self.gap_from = -1  # a migration's first index: the gap before it is measured (-1: none pending)
        self.moves = 0  # live migrations it followed

    def place(self, instance_id: str, address: str, epoch: int, from_index: int) -> None:
        """A new placement (a dispatch, a failover, a migration's claim): owned by ``instance_id`` under
        ``epoch`` (newer than the current one) from index ``from_index`` on."""
        self.instance_id, self.address, self.epoch, self.owner_from = instance_id, address, epoch, from_index
        self.starts.append((epoch, from_index))

    def migrated(self, from_index: int) -> None:
        """A live migration moved it (wire.Moved): the gap before its token ``from_index`` is measured."""
        self.moves += 1
        if from_index >= self.next_index and from_index > 0:
            self.gap_from = from_index

    def owns(self, instance_id: str, out: wire.TokenOut) -> bool:
        """Whether ``out`` may reach the client: from the current owner, or from an earlier placement for an
        index before the placement that replaced it began (tokens in flight from a migration's source). Not
        before the current one began: a copy that stalled, was failed over and then the request moved on,
        produced nothing the client may take past the failover's first index."""
        if out.epoch == self.epoch:
            return instance_id == self.instance_id
        if out.epoch > self.epoch:
            return False
        for epoch, start in self.starts:
            if epoch > out.epoch:
                return out.index < start
        return out.index < self.owner_from

    def feed(self, out: wire.TokenOut, now: float | None = None) -> None:
        """Take one output; ``now`` (the owner's clock) marks progress (None: a caller that does not watch
        for stalls, e.g. a test's fake instance)."""
        index = out.index
        if index == self.next_index and not self.done and not self.early and self.gap_from < 0:
            # The common case, once per token: the next index, nothing held early, no migration gap pending
            # (what the general way below does then, without its calls).
            if index == 0 and self.trace is not None:
                self.trace.first_token()
            self.ready.append(out)
            self.token_ids.append(out.token_id)
            self.next_index = index + 1
            if out.finish_reason is not None:
                self.done = True
            if now is not None:
                self.progress_at = now
            waiter = self.waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
            return
        if self.done or index < self.next_index or index in self.early:
            M_DUPLICATES.inc()
            return
        if out.index != self.next_index:
            self.early[out.index] = out
            return
        self._accept(out)
        while self.next_index in self.early:
            self._accept(self.early.pop(self.next_index))
        if now is not None:
            if 0 <= self.gap_from < self.next_index:
                kind = "handover" if self.moves == 1 and self.disagg == "remote" else "migration"
                M_MIGRATION_GAP.labels(kind).observe(max(0.0, now - self.progress_at))
                self.gap_from = -1
            self.progress_at = now
        self._wake()

    def _accept(self, out: wire.TokenOut) -> None:
        if self.next_index == 0 and self.trace is not None:
            self.trace.first_token()
        self.ready.append(out)
        self.token_ids.append(out.token_id)
        self.next_index += 1
        if out.finish_reason is not None:
            self.done = True

    def fail(self, message: str, status: int = 503) -> None:
        if not self.done:
            self.error, self.status, self.done = message, status, True
            self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[wire.TokenOut]:
        """Wait for outputs; returns [] only when the stream ended with an error."""
        while not self.ready:
            if self.done:
                return []
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        out, self.ready = self.ready, []
        return out
