"""The proxy's side of ZeroMQ: dispatch through the manager, requests to instances, tokens back.

Each request gets a ``Stream`` that puts token outputs in index order and emits each index exactly once,
whichever instance produced it. If the manager does not answer in time (or is known to be down), the
proxy picks the freest instance from its last snapshot itself. A request whose instance fails or dies
before producing a token is sent elsewhere; after that, the client gets an error.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import zmq
import zmq.asyncio
from prometheus_client import Counter

from daemons import policy, runtime, wire

log = logging.getLogger("llumnix.proxy")

M_FALLBACK = Counter("llumnix_proxy_local_dispatches_total", "Requests dispatched from the proxy's own snapshot (manager slow or down)")
M_RETRIES = Counter("llumnix_proxy_redispatches_total", "Requests sent to another instance after one failed before any token")
M_BAD_FRAMES = Counter("llumnix_proxy_malformed_frames_total", "Frames dropped because they did not decode")
M_DUPLICATES = Counter("llumnix_proxy_duplicate_tokens_total", "Token outputs dropped because their index was already emitted")


class NoInstance(Exception):
    """No live instance can take the request."""


class Stream:
    """One request's outputs, in index order, each index once."""

    __slots__ = ("request_id", "submit", "ready", "next_index", "early", "event", "done", "error",
                 "status", "instance_id", "tried")

    def __init__(self, request_id: str, submit: wire.Submit):
        self.request_id = request_id
        self.submit = submit
        self.ready: list[wire.TokenOut] = []
        self.next_index = 0
        self.early: dict[int, wire.TokenOut] = {}
        self.event = asyncio.Event()
        self.done = False
        self.error: str | None = None
        self.status = 200
        self.instance_id = ""
        self.tried: list[str] = []

    def feed(self, out: wire.TokenOut) -> None:
        if self.done or out.index < self.next_index or out.index in self.early:
            M_DUPLICATES.inc()
            return
        if out.index != self.next_index:
            self.early[out.index] = out
            return
        self._accept(out)
        while self.next_index in self.early:
            self._accept(self.early.pop(self.next_index))
        self.event.set()

    def _accept(self, out: wire.TokenOut) -> None:
        self.ready.append(out)
        self.next_index += 1
        if out.finish_reason is not None:
            self.done = True

    def fail(self, message: str, status: int = 503) -> None:
        if not self.done:
            self.error, self.status, self.done = message, status, True
            self.event.set()

    async def take(self) -> list[wire.TokenOut]:
        """Wait for outputs; returns [] only when the stream ended with an error."""
        while not self.ready:
            if self.done:
                return []
            self.event.clear()
            await self.event.wait()
        out, self.ready = self.ready, []
        return out


class ClusterClient:
    def __init__(self, cfg):
        self.cfg = cfg
        self.pc = cfg.proxy
        self.ctx = zmq.asyncio.Context()
        self.pull = runtime.tune(self.ctx.socket(zmq.PULL))
        self.pull.setsockopt(zmq.RCVHWM, 0)
        self.manager = runtime.tune(self.ctx.socket(zmq.DEALER))
        self.manager.setsockopt(zmq.IMMEDIATE, 1)  # while the manager is away, fail fast and dispatch locally
        self.instances: dict[str, zmq.asyncio.Socket] = {}
        self.streams: dict[str, Stream] = {}
        self.snapshot: list[wire.InstanceView] = []
        self.snapshot_at = 0.0  # monotonic time of the last answer from the manager
        self.token_address = ""
        self._queries: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._turn = 0
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        bound = runtime.bind(self.pull, self.pc.token_address)
        self.token_address = self.pc.advertise_address or bound
        self.manager.connect(self.cfg.manager.address)
        self._tasks = [asyncio.create_task(c) for c in (self._recv_tokens(), self._recv_manager(), self._poll_snapshot())]
        log.info("token path on %s, manager %s", self.token_address, self.cfg.manager.address)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for rid, stream in list(self.streams.items()):
            if not stream.done and stream.instance_id:
                self._send_instance(stream.instance_id, wire.Abort(rid))
        for sock in self.instances.values():
            sock.close(200)
        self.pull.close(0)
        self.manager.close(0)
        self.ctx.term()

    # ------------------------------------------------------------------ manager

    def manager_ok(self) -> bool:
        return time.monotonic() - self.snapshot_at < max(3 * self.pc.snapshot_interval_s, 1.0)

    def alive(self) -> list[wire.InstanceView]:
        return [v for v in self.snapshot if v.state == "alive" and not v.draining]

    async def _ask(self, msg, timeout: float):
        fut = asyncio.get_running_loop().create_future()
        self._queries[msg.query_id] = fut
        try:
            self.manager.send(wire.encode(msg), zmq.NOBLOCK)
            return await asyncio.wait_for(fut, timeout)
        except (zmq.Again, asyncio.TimeoutError):
            return None
        finally:
            self._queries.pop(msg.query_id, None)

    async def _recv_manager(self) -> None:
        while True:
            msg = wire.decode(await self.manager.recv())
            if isinstance(msg, wire.Snapshot):
                self.snapshot, self.snapshot_at = msg.instances, time.monotonic()
                self._check_dead()
            if isinstance(msg, (wire.DispatchReply, wire.Snapshot)):
                fut = self._queries.get(msg.query_id)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif msg is None:
                M_BAD_FRAMES.inc()

    async def _poll_snapshot(self) -> None:
        while True:
            await self._ask(wire.SnapshotQuery(next(self._ids)), self.pc.snapshot_interval_s)
            await asyncio.sleep(self.pc.snapshot_interval_s)

    def _check_dead(self) -> None:
        """Requests on an instance the manager marked dead (or forgot) are re-sent or failed."""
        alive = {v.instance_id for v in self.snapshot if v.state == "alive"}
        for stream in list(self.streams.values()):
            if not stream.done and stream.instance_id and stream.instance_id not in alive:
                self._instance_failed(stream, f"instance {stream.instance_id} died")

    # ------------------------------------------------------------------ dispatch

    async def _choose(self, stream: Stream) -> tuple[str, str]:
        sub = stream.submit
        if self.manager_ok():
            q = wire.Dispatch(next(self._ids), sub.request_id, len(sub.prompt_token_ids), sub.priority, stream.tried)
            reply = await self._ask(q, self.pc.dispatch_timeout_s)
            if reply is not None:
                if not reply.instance_id:
                    raise NoInstance(reply.reason or "no live instance")
                return reply.instance_id, reply.request_address
        M_FALLBACK.inc()
        views = [v for v in self.alive() if v.instance_id not in stream.tried]
        cands = [policy.Candidate(v.instance_id, v.load.blocks_total, v.load.blocks_total - v.freeness * v.load.batch_size,
                                  v.load.batch_size) for v in views]
        self._turn += 1
        chosen = policy.dispatch("llumnix", cands, self._turn)
        if chosen is None:
            raise NoInstance("no live instance (the manager is unreachable and the last snapshot has none)")
        return chosen, next(v.request_address for v in views if v.instance_id == chosen)

    def _send_instance(self, instance_id: str, msg: wire.Message, address: str = "") -> None:
        sock = self.instances.get(instance_id)
        if sock is None:
            if not address:
                return
            sock = runtime.tune(self.ctx.socket(zmq.DEALER))
            sock.setsockopt(zmq.SNDHWM, 100_000)
            sock.connect(address)
            self.instances[instance_id] = sock
        try:
            sock.send(wire.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("request path to %s is full; dropped a %s", instance_id, type(msg).__name__)

    async def submit(self, submit: wire.Submit) -> Stream:
        """Dispatch and send a request; the returned stream yields its tokens. Raises NoInstance."""
        stream = Stream(submit.request_id, submit)
        self.streams[submit.request_id] = stream
        try:
            await self._dispatch(stream)
        except BaseException:
            self.streams.pop(submit.request_id, None)
            raise
        return stream

    async def _dispatch(self, stream: Stream) -> None:
        instance_id, address = await self._choose(stream)
        stream.instance_id = instance_id
        stream.tried.append(instance_id)
        self._send_instance(instance_id, stream.submit, address)

    def _instance_failed(self, stream: Stream, message: str, retryable: bool = True, status: int = 503) -> None:
        if retryable and stream.next_index == 0 and len(stream.tried) < self.pc.max_dispatch_attempts:
            log.warning("request %s: %s; sending it elsewhere", stream.request_id, message)
            M_RETRIES.inc()
            stream.instance_id = ""
            task = asyncio.create_task(self._redispatch(stream, message))
            self._tasks.append(task)
            task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)
        else:
            stream.fail(message, status)

    async def _redispatch(self, stream: Stream, why: str) -> None:
        try:
            await self._dispatch(stream)
        except NoInstance as exc:
            stream.fail(f"{why}; no other instance: {exc}")

    def finish(self, stream: Stream) -> None:
        """Forget a stream; abort it on its instance if it is still running there (client went away, stop string)."""
        self.streams.pop(stream.request_id, None)
        if not stream.done and stream.instance_id:
            self._send_instance(stream.instance_id, wire.Abort(stream.request_id))
        stream.done = True

    # ------------------------------------------------------------------ token path

    async def _recv_tokens(self) -> None:
        streams = self.streams
        while True:
            msg = wire.decode(await self.pull.recv())
            if isinstance(msg, wire.TokenBatch):
                for out in msg.outputs:
                    stream = streams.get(out.request_id)
                    if stream is not None:
                        stream.feed(out)
            elif isinstance(msg, wire.RequestFailed):
                stream = streams.get(msg.request_id)
                if stream is not None and stream.instance_id == msg.instance_id:
                    self._instance_failed(stream, msg.message, msg.retryable, msg.status)
            else:
                M_BAD_FRAMES.inc()
