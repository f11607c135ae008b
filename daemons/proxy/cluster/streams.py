"""Stream ownership: the proxy's streams by request id, and which copy of each request may feed it.

Every placement of a request (dispatch, migration commit, failover) has an epoch, and a stream takes tokens
only from its current owner (instance, epoch), or from an older placement for the indices before the current
one began (daemons/proxy/cluster/stream.py ``owns``). A copy that lost a race is aborted by epoch ("fenced", once per
copy); tokens of a request we do not know are an orphan's, and their instance is asked to stop it."""

from __future__ import annotations

import logging
from typing import Callable, Iterator, Protocol

from daemons import wire
from daemons.proxy.cluster.stream import Stream
from daemons.proxy.cluster.telemetry import M_FENCED

log = logging.getLogger("llumnix.proxy")

ORPHANS_KEPT = 10_000  # request ids whose orphan tokens we asked to stop, remembered to ask once


class Port(Protocol):
    """What stream ownership sends through (daemons/proxy/cluster/tokens.py InstancePort)."""

    def send(self, address: str, msg: wire.Message) -> bool: ...

    def greet(self, address: str) -> None: ...


class Streams:
    """Owns the streams by request id and the orphans asked to stop. Receives the port to the instances,
    ``address_of`` (an instance id's request address, from daemons/proxy/cluster/known.py) and ``moved_to`` (records
    a claimant's address there)."""

    def __init__(self, port: Port, address_of: Callable[[str], str], moved_to: Callable[[str, str], None]):
        self.port = port
        self.address_of = address_of
        self.moved_to = moved_to
        self.by_id: dict[str, Stream] = {}
        self._orphans: dict[tuple[str, str, int], None] = {}  # (request, instance, epoch) copies told to abort, in order

    def add(self, stream: Stream) -> None:
        self.by_id[stream.request_id] = stream

    def get(self, request_id: str) -> Stream | None:
        return self.by_id.get(request_id)

    def drop(self, request_id: str) -> None:
        self.by_id.pop(request_id, None)

    def __iter__(self) -> Iterator[Stream]:
        """The streams, as a list taken now (a caller may end some)."""
        return iter(list(self.by_id.values()))

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.by_id

    def __len__(self) -> int:
        return len(self.by_id)

    def finish(self, stream: Stream) -> None:
        """Forget a stream; abort it on its instance if it is still running there (client went away, stop
        string)."""
        self.by_id.pop(stream.request_id, None)
        if stream.trace is not None:
            stream.trace.finished(stream.next_index, stream.error)
        if not stream.done and stream.address:
            self.port.send(stream.address, wire.Abort(stream.request_id, stream.epoch))
        stream.done = True

    def abort_all(self) -> None:
        """At stop: every running stream is aborted on its instance."""
        for rid, stream in list(self.by_id.items()):
            if not stream.done and stream.address:
                self.port.send(stream.address, wire.Abort(rid))

    # ------------------------------------------------------------------ the token path's messages

    def tokens(self, instance_id: str, outputs: list[wire.TokenOut], now: float) -> None:
        """A TokenBatch of ``instance_id``: each output to its stream if it comes from a copy that owns it."""
        get = self.by_id.get
        for out in outputs:
            stream = get(out.request_id)
            if stream is None:
                self._orphan(instance_id, out)
                continue
            # From its current owner (the common case, decided here without a call), or Stream.owns.
            if (out.epoch == stream.epoch and instance_id == stream.instance_id) or stream.owns(instance_id, out):
                stream.feed(out, now)
            elif not stream.done:
                M_FENCED.inc()
                self.fence(stream, instance_id, out.epoch)

    def moved(self, stream: Stream, msg: wire.Moved, now: float) -> None:
        """An ownership claim: the first one heard for a newer epoch wins; a claim that lost (a late commit
        against a resumed source, or the reverse) is aborted by epoch."""
        self.moved_to(msg.instance_id, msg.request_address)
        self.port.greet(msg.request_address)  # it holds our streams now: it must hear that we live
        if msg.epoch > stream.epoch:
            if stream.trace is not None:
                stream.trace.moved(stream.instance_id, msg.instance_id, msg.epoch, msg.from_index)
            stream.place(msg.instance_id, msg.request_address, msg.epoch, msg.from_index)
            stream.migrated(msg.from_index)
            stream.sent_at = now
            if msg.instance_id not in stream.tried:
                stream.tried.append(msg.instance_id)
        elif msg.epoch < stream.epoch or msg.instance_id != stream.instance_id:
            M_FENCED.inc()
            log.warning("request %s: instance %s claims epoch %d, but %s owns epoch %d; aborting that copy",
                        stream.request_id, msg.instance_id, msg.epoch, stream.instance_id, stream.epoch)
            self.fence(stream, msg.instance_id, msg.epoch, msg.request_address)

    def fence_owner(self, stream: Stream) -> None:
        """The copy we leave may still be running (a stalled or unhealthy instance): abort it by epoch."""
        if stream.address:
            self.fence(stream, stream.instance_id, stream.epoch, stream.address)

    def fence(self, stream: Stream, instance_id: str, epoch: int, address: str = "") -> None:
        key = (instance_id, epoch)
        if key in stream.fenced:
            return
        stream.fenced.add(key)
        address = address or self.address_of(instance_id)
        if address:
            self.port.send(address, wire.Abort(stream.request_id, epoch))

    def _orphan(self, instance_id: str, out: wire.TokenOut) -> None:
        """Tokens of a request we do not know (we restarted at the same address, or already let it go):
        nobody will read them; ask their instance to stop, once per copy (one instance may hold two: a stalled
        copy we failed over from, and a later placement there that lost a race)."""
        key = (out.request_id, instance_id, out.epoch)
        if out.finish_reason is not None or key in self._orphans:
            return
        address = self.address_of(instance_id)
        if address:
            self._orphans[key] = None
            if len(self._orphans) > ORPHANS_KEPT:
                self._orphans.pop(next(iter(self._orphans)))
            self.port.send(address, wire.Abort(out.request_id, out.epoch))
