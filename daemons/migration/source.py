"""The source's side of the moves out of this instance: what they share (the moves in flight, one lock per
destination, the paced copies, the counts) and the verbs a ``Move`` (daemons/migration/move.py: one
request's way out, as a state machine) runs on it. A Move reads nothing else of the Migrator."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from daemons import wire
from daemons.migration.records import DEAD, GONE, DestinationFailed, Outgoing, Refused
from daemons.migration.side import Parts, Side
from daemons.migration.telemetry import M_BYTES
from daemons.migration.transport import TransferError
from daemons.pacing import MIN_DUTY, DutyPacer


log = logging.getLogger("llumnix.migration")


class Source(Side):
    """Owns ``outgoing`` (by migration id), a lock per destination, the pacers of the copies running now and
    the counts of moves committed and aborted. Receives the instance (``host``: its id and address, its wake
    event, its word to the proxies, its tracer), the engine (between steps only, through ``boundary``), the
    request table (whose verbs mark a request migrating and hand it over), the KV transport and the peers."""

    def __init__(self, parts: Parts):
        super().__init__(parts)
        self.outgoing: dict[str, Outgoing] = {}
        self.locks: dict[str, asyncio.Lock] = {}  # by destination id
        self.pacers: dict[str, DutyPacer] = {}  # by migration id, while its pre-copy sends
        self.committed = 0
        self.aborted = 0

    # ---------------------------------------------------------------- what the peers tell

    def deliver(self, msg: wire.MigReady | wire.MigDone) -> None:
        """A destination's answer, to the move it belongs to."""
        out = self.outgoing.get(msg.mig_id)
        if out is not None:
            out.replies.put_nowait(msg)

    def peer_gone(self, address: str) -> None:
        """The connection to ``address`` dropped: the moves there stop waiting."""
        for out in self.outgoing.values():
            if out.dst_address == address:
                out.replies.put_nowait(GONE)

    def peer_dead(self, instance_id: str, address: str) -> int:
        """The manager declared ``instance_id`` (at ``address``) dead: the moves there stop at once, whatever
        they wait for (an answer, a copy, their turn); a suspended request resumes here. How many."""
        n = 0
        for out in self.outgoing.values():
            if (out.dst == instance_id or (address and out.dst_address == address)) and not out.dead.is_set():
                out.dead.set()
                out.replies.put_nowait(DEAD)
                n += 1
        return n

    def addresses(self) -> set[str]:
        return {o.dst_address for o in self.outgoing.values()}

    def pair_names(self) -> set[str]:
        return {o.dst for o in self.outgoing.values()}

    def step_pacers(self, step_s: float, baseline: float) -> None:
        """An engine step during the paced copies: each adjusts its duty."""
        for pacer in self.pacers.values():
            pacer.step(step_s, baseline)

    # ---------------------------------------------------------------- the verbs of a move

    def opened(self, out: Outgoing) -> None:
        self.outgoing[out.mig_id] = out

    def ended(self, committed: bool) -> None:
        if committed:
            self.committed += 1
        else:
            self.aborted += 1

    def closed(self, out: Outgoing) -> None:
        del self.outgoing[out.mig_id]
        self.host.wake.set()  # refresh the load report at the next boundary

    def lock(self, dst: str) -> asyncio.Lock:
        """One migration at a time per destination: both ends of a pair run its transfers in the order they
        were posted, so two interleaved migrations could pair one's send with the other's receive."""
        return self.locks.setdefault(dst, asyncio.Lock())

    async def reply(self, out: Outgoing, kind: type, stage: int, what: str):
        """The destination's ``kind`` answer to ``stage``, within migration.timeout_s."""
        deadline = self.clock.monotonic() + self.cfg.timeout_s
        while True:
            if out.dead.is_set():
                raise DestinationFailed(f"the destination was declared dead while waiting for {what}")
            left = deadline - self.clock.monotonic()
            if left <= 0:
                raise DestinationFailed(f"destination did not answer {what} within {self.cfg.timeout_s:g}s")
            try:
                msg = await asyncio.wait_for(out.replies.get(), left)
            except asyncio.TimeoutError:
                continue
            if msg is DEAD:
                continue  # said at the top of the loop
            if msg is GONE:
                raise DestinationFailed(f"the connection to the destination dropped while waiting for {what} (did it die?)")
            if isinstance(msg, kind) and msg.stage == stage:
                if not msg.ok:
                    raise Refused(f"destination refused: {msg.reason}")
                return msg

    async def sent(self, out: Outgoing, sending: asyncio.Future, nbytes: int, paced: bool = False) -> int:
        """The bytes of a transfer, once it ended (within migration.timeout_s plus its bytes at a floor rate),
        unless the destination is declared dead first: then at once (the copy only reads our blocks, and the
        request keeps them: it may end on the pair's thread whenever)."""
        rate = 1e8 * (MIN_DUTY if paced else 1.0)  # at least 100 MB/s, or that at the lowest duty where paced
        dead = asyncio.ensure_future(out.dead.wait())
        try:
            done, _ = await asyncio.wait({sending, dead}, timeout=self.cfg.timeout_s + nbytes / rate,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            dead.cancel()
        if sending not in done:
            sending.cancel()
            raise DestinationFailed("the destination was declared dead during the copy" if out.dead.is_set()
                                    else "KV transfer failed: timed out")
        try:
            sent = sending.result()
        except (TransferError, asyncio.CancelledError) as exc:  # cancelled: its pair was closed before it ran
            raise DestinationFailed(f"KV transfer failed: {str(exc) or 'cancelled'}") from None
        M_BYTES.labels("out").inc(sent)
        return sent

    @contextlib.contextmanager
    def pacing(self, mig_id: str, pacer: DutyPacer | None):
        """While a paced copy runs, the engine's steps adjust its duty (Migrator.stepped)."""
        if pacer is not None:
            self.pacers[mig_id] = pacer
        try:
            yield
        finally:
            self.pacers.pop(mig_id, None)

    def resume(self, request_id: str, uncertain: wire.RequestState | None = None) -> None:
        """(At a step boundary) Undo the suspend. ``uncertain``: the last stage went out and no answer came, so
        the destination may have committed: claim the next epoch here as well and let the proxy keep one of
        the two."""
        host = self.host
        try:
            self.engine.resume(request_id)
        except KeyError:  # aborted by its client while suspended: nothing to resume
            return
        finally:
            host.wake.set()
        if uncertain is not None:
            entry = self.requests.reclaim(request_id)
            if entry is not None:
                log.warning("migration of %s: no answer to its last stage; resuming it here as epoch %d (the "
                            "proxy keeps one copy if the destination committed too)", request_id, entry.epoch)
                host.announce_move(request_id, entry.reply_to, host.instance_id, host.request_address, entry.epoch,
                                   uncertain.emitted)

    def hand_over(self, request_id: str, dst: str, dst_address: str, state: wire.RequestState) -> None:
        """(At a step boundary, after the commit) The request lives on the destination; forget it here (late
        aborts follow it), and tell the proxy as well, in case the destination's own word was lost with it."""
        self.engine.drop_migrated(request_id)
        entry = self.requests.hand_over(request_id, dst_address)
        if entry is not None:
            self.host.announce_move(request_id, entry.reply_to, dst, dst_address, state.epoch + 1, state.emitted)

    def forward_abort(self, request_id: str, epoch: int = 0) -> bool:
        """An abort for a request that moved away goes after it. False if it never moved from here."""
        address = self.requests.moved_to(request_id)
        if address is None:
            return False
        self.peers.send(address, wire.Abort(request_id, epoch))
        return True
