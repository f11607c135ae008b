"""The instance traffic: requests and aborts out, tokens, moves and give-backs in."""

from __future__ import annotations

import logging

import zmq
import zmq.asyncio

from daemons import runtime, wire
from daemons.proxy.stream import Stream
from daemons.proxy.telemetry import M_BAD_FRAMES, M_FENCED, M_FORGED, M_PREFIX_INDEX

log = logging.getLogger("llumnix.proxy")


class TokenPathMixin:
    """Of the ClusterClient: sends on ``instances`` (one socket per request address), receives on ``pull``."""

    def _send_instance(self, address: str, msg: wire.Message) -> bool:
        sock = self.instances.get(address)
        if sock is None:
            sock = runtime.tune(self.ctx.socket(zmq.DEALER, socket_class=zmq.Socket))  # send-only
            sock.setsockopt(zmq.SNDHWM, 100_000)
            self.sec.client(self.links.prepare(sock), "instance")
            self.links.watch(address, sock)  # before the connect: its handshake must not go unseen
            try:
                sock.connect(address)
            except zmq.ZMQError as exc:
                self.links.forget(address)
                sock.close(0)
                log.warning("cannot connect to instance address %r (%s); not sending it a %s", address, exc,
                            type(msg).__name__)
                return False
            self.instances[address] = sock
        if not runtime.send_now(sock, wire.encode(msg)):
            log.warning("request path to %s is full; could not send a %s", address, type(msg).__name__)
            return False
        return True

    async def _recv_tokens(self) -> None:
        if self.sec.enabled:  # with CURVE, each message's sender key (ZAP User-Id) says which instance may send it
            async for frames in runtime.receive(self.pull, copy=False):
                for frame in frames:
                    try:
                        self.on_instance_message(wire.decode(frame.buffer), frame.get("User-Id"))
                    except Exception:  # this task is essential: one peer's message must not end it
                        M_BAD_FRAMES.inc()
                        log.exception("a message on the token path (%d bytes) broke its handler; dropped it",
                                      len(frame.buffer))
            return
        async for frames in runtime.receive(self.pull):
            for frame in frames:
                try:
                    self.on_instance_message(wire.decode(frame))
                except Exception:  # this task is essential: one peer's message must not end it (nor the proxy)
                    M_BAD_FRAMES.inc()
                    log.exception("a message on the token path (%d bytes) broke its handler; dropped it", len(frame))

    def _from_owner(self, instance_id: str, key: str) -> bool:
        """Whether ``key`` ("role:name" of the sender's CURVE key) may speak for ``instance_id``: the key the
        manager pinned that id to at registration (its snapshots), else the first key heard for it here (an
        instance newer than our snapshot; the next snapshot corrects a wrong first guess)."""
        pinned = self.owner_keys.get(instance_id)
        if pinned is None:
            self.owner_keys[instance_id] = key
            return True
        if pinned == key:
            return True
        M_FORGED.inc()
        if self._forged_logged.due((instance_id, key), self.clock.monotonic()):
            log.warning("dropped messages of instance %s from key %s: it registered with key %s", instance_id,
                        key.split(":", 1)[-1] or "(none)", pinned.split(":", 1)[-1])
        return False

    def on_instance_message(self, msg: wire.Message | None, key: str | None = None) -> None:
        """One message on the token path (tokens, heartbeats, ownership claims, give-backs, refusals);
        ``key``: its sender's CURVE key, "role:name" (None: not checked, no CURVE)."""
        if key is not None and getattr(msg, "instance_id", "") and not self._from_owner(msg.instance_id, key):
            return
        streams = self.streams
        if isinstance(msg, wire.TokenBatch):
            iid = msg.instance_id
            self.heard[iid] = now = self.clock.monotonic()
            for out in msg.outputs:
                stream = streams.get(out.request_id)
                if stream is None:
                    self._orphan(iid, out)
                    continue
                if stream.owns(iid, out):
                    stream.feed(out, now)
                elif not stream.done:
                    M_FENCED.inc()
                    self._fence(stream, iid, out.epoch)
        elif isinstance(msg, wire.Heartbeat):
            self.heard[msg.instance_id] = self.beat_at[msg.instance_id] = self.clock.monotonic()
            self.view.heard(msg, self.beats.get(msg.instance_id))
            self.beats[msg.instance_id] = msg
            self.addresses[msg.instance_id] = msg.request_address
            self.cache_index.on_beat(msg.instance_id, msg.cache_epoch, msg.cache_seq)
            self.check_taken(msg)
            if self._changed or (self.fair is not None and self.fair.waiting):
                self._wake_waiting()
        elif isinstance(msg, wire.CacheEvents):
            self.cache_index.on_events(msg)
            M_PREFIX_INDEX.set(self.cache_index.index.entries())
        elif isinstance(msg, wire.Moved):  # a migration committed: follow the request to its new owner
            stream = streams.get(msg.request_id)
            if stream is not None and not stream.done:
                self._moved(stream, msg)
        elif isinstance(msg, wire.Redispatch):
            stream = streams.get(msg.request_id)
            if stream is not None and not stream.done and stream.instance_id == msg.instance_id:
                self._give_back(stream, msg)
        elif isinstance(msg, wire.RequestFailed):
            stream = streams.get(msg.request_id)
            if stream is not None and stream.instance_id == msg.instance_id:
                # A request that already streamed tokens was valid: an instance that refuses to
                # continue it (a smaller context limit or cache) is that instance's limit, not the request's.
                retryable = msg.retryable or (stream.next_index > 0 and msg.status == 400)
                self._instance_failed(stream, msg.message, retryable, msg.status, cause="refused")
        else:
            M_BAD_FRAMES.inc()

    def _ask_cache(self, instance_id: str) -> None:
        """Ask an instance for its whole prefix cache (our index missed some of it, or we just started)."""
        address = self.addresses.get(instance_id)
        if address and self.token_address:
            self._send_instance(address, wire.CacheSync(self.token_address))

    def _orphan(self, instance_id: str, out: wire.TokenOut) -> None:
        """Tokens of a request we do not know (we restarted at the same address, or already let it go):
        nobody will read them; ask their instance to stop, once per request."""
        if out.finish_reason is not None or out.request_id in self._orphans:
            return
        address = self.addresses.get(instance_id)
        if address:
            self._orphans[out.request_id] = None
            if len(self._orphans) > 10_000:
                self._orphans.pop(next(iter(self._orphans)))
            self._send_instance(address, wire.Abort(out.request_id, out.epoch))

    def _moved(self, stream: Stream, msg: wire.Moved) -> None:
        """An ownership claim: the first one heard for a newer epoch wins; a claim that lost (a late commit
        against a resumed source, or the reverse) is aborted by epoch."""
        self.addresses[msg.instance_id] = msg.request_address
        if msg.request_address not in self.instances:  # it holds our streams now: it must hear that we live
            self._send_instance(msg.request_address, wire.ProxyAlive(self.token_address))
        if msg.epoch > stream.epoch:
            if stream.trace is not None:
                stream.trace.moved(stream.instance_id, msg.instance_id, msg.epoch, msg.from_index)
            stream.instance_id, stream.address = msg.instance_id, msg.request_address
            stream.epoch, stream.owner_from = msg.epoch, msg.from_index
            stream.sent_at = self.clock.monotonic()
            if msg.instance_id not in stream.tried:
                stream.tried.append(msg.instance_id)
        elif msg.epoch < stream.epoch or msg.instance_id != stream.instance_id:
            M_FENCED.inc()
            log.warning("request %s: instance %s claims epoch %d, but %s owns epoch %d; aborting that copy",
                        stream.request_id, msg.instance_id, msg.epoch, stream.instance_id, stream.epoch)
            self._fence(stream, msg.instance_id, msg.epoch, msg.request_address)
