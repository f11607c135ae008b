"""The proxy's side of ZeroMQ: dispatch through the manager, requests to instances, tokens back.

Each request gets a ``Stream`` that puts token outputs in index order and emits each index exactly once,
whichever instance produced it. If the manager does not answer in time (or is known to be down), the
proxy picks an instance from its last snapshot itself, by the dispatch policy the manager's snapshots name
(from load reports alone: no headroom, credit or unreported dispatches of other proxies). A request whose instance fails or dies
before producing a token is sent elsewhere; after that, the client gets an error. A request that migrates
is followed: the destination says so (``Moved``), and aborts go there from then on. A queued request that a
draining instance gives back (``Redispatch``) is dispatched again; that is not a failed attempt.
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
M_GIVEN_BACK = Counter("llumnix_proxy_given_back_total", "Queued requests a draining instance gave back, dispatched again")
M_BAD_FRAMES = Counter("llumnix_proxy_malformed_frames_total", "Frames dropped because they did not decode")
M_DUPLICATES = Counter("llumnix_proxy_duplicate_tokens_total", "Token outputs dropped because their index was already emitted")


class NoInstance(Exception):
    """No live instance can take the request."""


class Stream:
    """One request's outputs, in index order, each index once."""

    __slots__ = ("request_id", "submit", "ready", "next_index", "early", "event", "done", "error",
                 "status", "instance_id", "address", "tried", "sent_at", "given_back")

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
        self.address = ""
        self.tried: list[str] = []
        self.sent_at = 0.0
        self.given_back = 0  # times a draining instance gave it back (not failed attempts)

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
        self.instances: dict[str, zmq.Socket] = {}  # by request address: a restarted instance may move
        self.streams: dict[str, Stream] = {}
        self.snapshot: list[wire.InstanceView] = []
        self.dispatch_policy = "llumnix"  # the manager's, from its snapshots: our fallback dispatches the same way
        self.snapshot_at = 0.0  # monotonic time of the last answer from the manager
        self._snapshot_asked_at = 0.0
        self.token_address = ""
        self._queries: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._turn = 0
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        bound = runtime.bind(self.pull, self.pc.token_address)
        self.token_address = self.pc.advertise_address or bound
        runtime.connect(self.manager, self.cfg.manager.address)
        self._tasks = [asyncio.create_task(c) for c in (self._recv_tokens(), self._recv_manager(), self._poll_snapshot())]
        log.info("token path on %s, manager %s", self.token_address, self.cfg.manager.address)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for rid, stream in list(self.streams.items()):
            if not stream.done and stream.address:
                self._send_instance(stream.address, wire.Abort(rid))
        for sock in self.instances.values():
            sock.close(200)  # the aborts above still go out
        self.ctx.destroy(linger=0)

    # ------------------------------------------------------------------ manager

    def manager_ok(self) -> bool:
        return time.monotonic() - self.snapshot_at < max(3 * self.pc.snapshot_interval_s, 1.0)

    def alive(self) -> list[wire.InstanceView]:
        return [v for v in self.snapshot if v.state == "alive" and not v.draining and not v.cordoned]

    async def _ask(self, msg, timeout: float):
        fut = asyncio.get_running_loop().create_future()
        self._queries[msg.query_id] = fut
        try:
            if not runtime.send_now(self.manager, wire.encode(msg)):
                return None
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            return None
        finally:
            self._queries.pop(msg.query_id, None)

    async def _recv_manager(self) -> None:
        while True:
            msg = wire.decode(await self.manager.recv())
            if isinstance(msg, wire.Snapshot):
                self.snapshot, self.snapshot_at = msg.instances, time.monotonic()
                if msg.dispatch_policy in policy.DISPATCH_POLICIES:
                    self.dispatch_policy = msg.dispatch_policy
                self._check_gone()
            if isinstance(msg, (wire.DispatchReply, wire.Snapshot)):
                fut = self._queries.get(msg.query_id)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif msg is None:
                M_BAD_FRAMES.inc()

    async def _poll_snapshot(self) -> None:
        while True:
            self._snapshot_asked_at = time.monotonic()
            await self._ask(wire.SnapshotQuery(next(self._ids)), self.pc.snapshot_interval_s)
            await asyncio.sleep(self.pc.snapshot_interval_s)

    def _check_gone(self) -> None:
        """Requests on an instance the manager marked dead, or no longer knows, are re-sent or failed."""
        states = {v.instance_id: v.state for v in self.snapshot}
        for stream in list(self.streams.values()):
            if stream.done or not stream.instance_id:
                continue
            state = states.get(stream.instance_id)
            # Absent: gone for good, unless we sent the request after the manager took this snapshot.
            if state == "dead" or (state is None and stream.sent_at < self._snapshot_asked_at):
                self._instance_failed(stream, f"instance {stream.instance_id} died")

    # ------------------------------------------------------------------ dispatch

    async def _choose(self, stream: Stream) -> tuple[str, str]:
        sub = stream.submit
        if self.manager_ok() or not self.snapshot:
            q = wire.Dispatch(next(self._ids), sub.request_id, len(sub.prompt_token_ids), sub.priority, stream.tried)
            reply = await self._ask(q, self.pc.dispatch_timeout_s)
            if reply is not None:
                if not reply.instance_id:
                    raise NoInstance(reply.reason or "no live instance")
                return reply.instance_id, reply.request_address
        M_FALLBACK.inc()
        views = [v for v in self.alive() if v.instance_id not in stream.tried]
        states = [policy.state_of(v.instance_id, v.load, pending_requests=v.pending_dispatches) for v in views]
        self._turn += 1
        chosen = policy.dispatch(self.dispatch_policy, states, self._turn, priority=sub.priority)
        if chosen is None:
            raise NoInstance("no live instance (the manager is unreachable and the last snapshot has none)")
        return chosen, next(v.request_address for v in views if v.instance_id == chosen)

    def _send_instance(self, address: str, msg: wire.Message) -> None:
        sock = self.instances.get(address)
        if sock is None:
            sock = runtime.tune(self.ctx.socket(zmq.DEALER, socket_class=zmq.Socket))  # send-only
            sock.setsockopt(zmq.SNDHWM, 100_000)
            sock.connect(address)
            self.instances[address] = sock
        if not runtime.send_now(sock, wire.encode(msg)):
            log.warning("request path to %s is full; dropped a %s", address, type(msg).__name__)

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
        stream.instance_id, stream.address = await self._choose(stream)
        stream.tried.append(stream.instance_id)
        stream.sent_at = time.monotonic()
        self._send_instance(stream.address, stream.submit)

    def _instance_failed(self, stream: Stream, message: str, retryable: bool = True, status: int = 503) -> None:
        if retryable and stream.next_index == 0 and len(stream.tried) - stream.given_back < self.pc.max_dispatch_attempts:
            log.warning("request %s: %s; sending it elsewhere", stream.request_id, message)
            M_RETRIES.inc()
            stream.instance_id = stream.address = ""
            self._spawn(self._redispatch(stream, message))
        else:
            stream.fail(message, status)

    def _give_back(self, stream: Stream, msg: wire.Redispatch) -> None:
        if stream.next_index:  # it produced tokens meanwhile (cannot happen: the instance checks); keep it there
            return
        log.debug("request %s: instance %s gave it back (%s); dispatching it again", stream.request_id,
                 msg.instance_id, msg.reason or "draining")
        M_GIVEN_BACK.inc()
        stream.given_back += 1
        stream.instance_id = stream.address = ""
        self._spawn(self._redispatch(stream, f"instance {msg.instance_id} gave it back"))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    async def _redispatch(self, stream: Stream, why: str) -> None:
        try:
            await self._dispatch(stream)
        except NoInstance as exc:
            stream.fail(f"{why}; no other instance: {exc}")

    def finish(self, stream: Stream) -> None:
        """Forget a stream; abort it on its instance if it is still running there (client went away, stop string)."""
        self.streams.pop(stream.request_id, None)
        if not stream.done and stream.address:
            self._send_instance(stream.address, wire.Abort(stream.request_id))
        stream.done = True

    # ------------------------------------------------------------------ token path

    async def _recv_tokens(self) -> None:
        streams = self.streams
        async for frames in runtime.receive(self.pull):
            for frame in frames:
                msg = wire.decode(frame)
                if isinstance(msg, wire.TokenBatch):
                    for out in msg.outputs:
                        stream = streams.get(out.request_id)
                        if stream is not None:
                            stream.feed(out)
                elif isinstance(msg, wire.Moved):  # live migration: follow the request to its new instance
                    stream = streams.get(msg.request_id)
                    if stream is not None and not stream.done:
                        stream.instance_id, stream.address = msg.instance_id, msg.request_address
                        stream.sent_at = time.monotonic()
                        if msg.instance_id not in stream.tried:
                            stream.tried.append(msg.instance_id)
                elif isinstance(msg, wire.Redispatch):
                    stream = streams.get(msg.request_id)
                    if stream is not None and not stream.done and stream.instance_id == msg.instance_id:
                        self._give_back(stream, msg)
                elif isinstance(msg, wire.RequestFailed):
                    stream = streams.get(msg.request_id)
                    if stream is not None and stream.instance_id == msg.instance_id:
                        self._instance_failed(stream, msg.message, msg.retryable, msg.status)
                else:
                    M_BAD_FRAMES.inc()
