"""The proxy's side of ZeroMQ: dispatch through the manager, requests to instances, tokens back.

Each request gets a ``Stream`` that puts token outputs in index order and emits each index exactly once,
whichever instance produced it. If the manager does not answer in time (or is known to be down), the
proxy picks an instance from its last snapshot itself, by the dispatch policy the manager's snapshots name
(from load reports alone: no headroom, credit or unreported dispatches of other proxies). A request that
migrates is followed: the destination says so (``Moved``), and aborts go there from then on. A queued
request that a draining instance gives back (``Redispatch``) is dispatched again; that is not a failed attempt.

Ownership: every placement of a request (dispatch, migration commit, failover) has an epoch, and the
stream takes tokens only from its current owner (instance, epoch), or from an older placement for the
indices before the current one began. A copy that lost a race is aborted by epoch (daemons/requests.py).

Failover: the proxy keeps its own view of instance liveness: its connection to each instance (daemons/links.py:
a killed instance closes it at once, a frozen or unreachable one stops answering keepalives), the
instances' heartbeats, and the manager's snapshots while it answers. Slow is not dead: a late heartbeat
alone fails nothing over. When the instance that holds a stream dies, stalls, stops or says it is
unhealthy, the request is submitted to another instance with its prompt plus every token already
streamed, under a new epoch; it continues at the next index, so the client sees nothing but a pause.

Admission: a new request is refused at once (429, Retry-After) while the cluster's queued work is past the
``[admission]`` bounds, counted from the instances' heartbeats and our own dispatches they do not show yet;
high priority has larger bounds. A request that finds no instance that can take it right now waits for
one (admission.queue_timeout_s); with no live instance at all it is refused at once (503).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import msgspec

import zmq
import zmq.asyncio

from daemons import metrics, policy, runtime, security, wire
from daemons.links import DOWN, UP, LinkWatch
from daemons.proxy.view import DispatchView

log = logging.getLogger("llumnix.proxy")

M_LOCAL = metrics.counter("proxy", "llumnix_proxy_local_dispatches_total",
                          "Requests dispatched from the proxy's own view (proxy.dispatch = local, or the manager "
                          "slow or down)")
M_ASKED = metrics.counter("proxy", "llumnix_proxy_manager_dispatches_total",
                          "Requests whose instance the manager chose (proxy.dispatch = manager, or no view yet)")
M_PEERS = metrics.gauge("proxy", "llumnix_proxy_peers", "Proxies the manager hears from, this one included (with "
                        "proxy.dispatch = local their tie starts are spread over the instances by rank)")
M_RETRIES = metrics.counter("proxy", "llumnix_proxy_redispatches_total",
                            "Requests sent to another instance after one failed before any token")
M_GIVEN_BACK = metrics.counter("proxy", "llumnix_proxy_given_back_total",
                               "Queued requests a draining instance gave back, dispatched again")
M_BAD_FRAMES = metrics.counter("proxy", "llumnix_proxy_malformed_frames_total", "Frames dropped because they did not decode")
M_DUPLICATES = metrics.counter("proxy", "llumnix_proxy_duplicate_tokens_total",
                               "Token outputs dropped because their index was already emitted")
M_FAILOVERS = metrics.counter("proxy", "llumnix_proxy_failovers_total",
                              "Streams continued on another instance by re-prefill, by cause", ["cause"],
                              preset=[(c,) for c in ("dead", "silent", "unhealthy", "stalled", "refused", "full", "failed")])
M_FENCED = metrics.counter("proxy", "llumnix_proxy_fenced_total", "Token outputs or ownership claims refused because "
                           "they came from a copy that is not the request's current owner")
M_TIMEOUTS = metrics.counter("proxy", "llumnix_proxy_request_timeouts_total",
                             "Requests ended because they passed proxy.request_timeout_s")
REJECT_REASONS = ("queued_requests", "queued_tokens", "no_instance", "wait_timeout")
M_REJECTED = metrics.counter("proxy", "llumnix_proxy_admission_rejections_total",
                             "Requests refused by admission control, by reason: queued_requests and queued_tokens "
                             "(429: the cluster's queue is past [admission]'s bounds), no_instance (503: no live "
                             "instance), wait_timeout (503: none could take it within admission.queue_timeout_s)",
                             ["reason"], preset=[(r,) for r in REJECT_REASONS])
M_WAITED = metrics.counter("proxy", "llumnix_proxy_dispatch_waits_total",
                           "Requests that found no instance able to take them at once and waited for one")
M_LINKS_DOWN = metrics.counter("proxy", "llumnix_proxy_instance_links_lost_total",
                               "Connections to instances lost (process gone, or no keepalive answered within "
                               "proxy.instance_timeout_s)")
M_LINKS_HEALED = metrics.counter("proxy", "llumnix_proxy_instance_links_healed_total",
                                 "Connections to instances dropped (no keepalive answered within "
                                 "proxy.instance_timeout_s) that a reconnection healed: nothing failed over")


TIE_TURN_S = 60.0
# Admission's defaults (-1), per instance: this many batches of requests and KV caches of prompt tokens may wait.
# Enough that a bursty trace that saturates the cluster for minutes is served whole (bench steady); sustained
# overload fills them and is refused at once.
AUTO_BATCHES = 4
AUTO_KV_CACHES = 8


class NoInstance(Exception):
    """No live instance can take the request."""

    def __init__(self, message: str, reason: str = "no_instance"):
        super().__init__(message)
        self.reason = reason


class Overloaded(Exception):
    """Admission control: the cluster's queued work is past the bounds for this request's priority."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


class Stream:
    """One request's outputs, in index order, each index once, from its current owner only."""

    __slots__ = ("request_id", "submit", "ready", "next_index", "early", "waiter", "done", "error", "status",
                 "instance_id", "address", "tried", "sent_at", "given_back", "epoch", "owner_from", "token_ids",
                 "failovers", "progress_at", "deadline", "fenced", "exclude")

    def __init__(self, request_id: str, submit: wire.Submit, timeout_s: float = 0.0):
        self.request_id = request_id
        self.submit = submit
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
        self.token_ids: list[int] = []  # every token accepted, in order: a failover re-prefills them
        self.failovers = 0
        self.progress_at = time.monotonic()
        self.deadline = time.monotonic() + timeout_s if timeout_s > 0 else 0.0
        self.fenced: set[tuple[str, int]] = set()  # copies already told to abort
        self.exclude: list[str] = []  # instances that failed it: not placed there again

    def owns(self, instance_id: str, out: wire.TokenOut) -> bool:
        """Whether ``out`` may reach the client: from the current owner, or from an earlier placement for an
        index before the current one began (tokens in flight from a migration's source)."""
        if out.epoch == self.epoch:
            return instance_id == self.instance_id
        return out.epoch < self.epoch and out.index < self.owner_from

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
        self.progress_at = time.monotonic()
        self._wake()

    def _accept(self, out: wire.TokenOut) -> None:
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


class ClusterClient:
    def __init__(self, cfg):
        metrics.bind("proxy", cfg.model.name)
        self.cfg = cfg
        self.pc = cfg.proxy
        self.ctx = zmq.asyncio.Context()
        self.sec = security.Security(cfg.security, "proxy", self.ctx)
        self.pull = self.sec.server(runtime.tune(self.ctx.socket(zmq.PULL)), "proxy")  # only instances' keys
        self.pull.setsockopt(zmq.RCVHWM, 0)
        self.manager = self.sec.client(runtime.tune(self.ctx.socket(zmq.DEALER)), "manager")
        self.manager.setsockopt(zmq.IMMEDIATE, 1)  # while the manager is away, fail fast and dispatch locally
        self.instances: dict[str, zmq.Socket] = {}  # by request address: a restarted instance may move
        self.streams: dict[str, Stream] = {}
        self.snapshot: list[wire.InstanceView] = []
        # Our own view of the instances, from their heartbeats: it outlives the manager.
        self.heard: dict[str, float] = {}  # instance id -> monotonic time of its last heartbeat or tokens
        self.beats: dict[str, wire.Heartbeat] = {}  # instance id -> its last heartbeat
        self.beat_at: dict[str, float] = {}  # instance id -> monotonic time of its last heartbeat
        self.addresses: dict[str, str] = {}  # instance id -> request address
        self._orphans: dict[str, None] = {}  # request ids we asked instances to abort (insertion-ordered)
        self.dispatch_policy = "llumnix"  # the manager's, from its snapshots: our fallback dispatches the same way
        self.snapshot_at = 0.0  # monotonic time of the last answer from the manager
        self._snapshot_asked_at = 0.0
        self.token_address = ""
        self._queries: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._turn = 0
        self.rank, self.proxies = 0, 1  # our place among the proxies the manager hears from (see tie_start)
        self.view = DispatchView(cfg.manager.pending_dispatch_ttl_s, cfg.scheduling.high_priority_headroom)
        self._tasks: list[asyncio.Task] = []
        self._soon: list[wire.Message] = []  # for the manager at the end of this loop turn (_tell_manager_soon)
        self.essential: list[asyncio.Task] = []  # if one of these ends, the proxy exits (it would be deaf)
        self.adm = cfg.admission
        self.links = LinkWatch(self.pc.instance_timeout_s, self._link_changed,  # by request address
                               lambda _: M_LINKS_HEALED.inc())
        self._changed: list[asyncio.Future] = []  # dispatches waiting for an instance to take them
        self.placing: dict[str, int] = {}  # request id -> prompt tokens, while it waits for an instance

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        self.sec.check_bind("proxy.token_address", self.pc.token_address)
        bound = runtime.bind(self.pull, self.pc.token_address)
        self.token_address = self.pc.advertise_address or bound
        runtime.connect(self.manager, self.cfg.manager.address)
        self._tasks = [asyncio.create_task(c) for c in
                       (self._recv_tokens(), self._recv_manager(), self._poll_snapshot(), self._watch())]
        self.essential = list(self._tasks)
        log.info("token path on %s, manager %s", self.token_address, self.cfg.manager.address)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for rid, stream in list(self.streams.items()):
            if not stream.done and stream.address:
                self._send_instance(stream.address, wire.Abort(rid))
        self.links.close()
        for sock in self.instances.values():
            sock.close(200)  # the aborts above still go out
        self.sec.close()
        self.ctx.destroy(linger=0)

    # ------------------------------------------------------------------ manager

    def manager_ok(self) -> bool:
        return time.monotonic() - self.snapshot_at < max(3 * self.pc.snapshot_interval_s, 1.0)

    def alive(self) -> list[wire.InstanceView]:
        """Instances that take requests: the manager's view, less those our own view says are dead or
        unhealthy, with the load of their latest heartbeat when it is newer."""
        out = []
        for v in self.snapshot:
            beat = self.beats.get(v.instance_id)
            # A drain or cordon (or their end) reaches the instance first: its heartbeat, if newer than the
            # snapshot, says whether it takes requests.
            flagged = (v.draining or v.cordoned) and not (beat is not None and self.beat_at.get(v.instance_id, 0.0)
                                                          > self.snapshot_at and beat.accepting)
            if v.state != "alive" or flagged or self._dead(v.instance_id):
                continue
            if beat is not None and beat.load is not None:
                if not beat.healthy or not beat.accepting:
                    continue
                v = msgspec.structs.replace(v, load=beat.load)
            out.append(v)
        # Instances the manager does not show (it restarted and they have not registered again yet) but that
        # we hear from.
        known = {v.instance_id for v in self.snapshot}
        now = time.monotonic()
        for iid, beat in self.beats.items():
            if (iid not in known and beat.load is not None and beat.healthy and beat.accepting
                    and now - self.heard.get(iid, 0.0) < self.pc.instance_timeout_s):
                out.append(wire.InstanceView(iid, "", 0, "alive", beat.request_address, "", "", beat.load, 0.0, 0.0))
        return out

    def instance_timeout(self) -> float:
        return self.pc.instance_timeout_s

    def _dead(self, instance_id: str, since: float = 0.0) -> bool:
        """Its connection went down (daemons/links.py). An instance whose connection is up is alive however
        late its heartbeats; one whose connection never came up is judged by silence: not heard from for
        proxy.instance_timeout_s (counting from ``since`` if later: a dispatch)."""
        link = self.links.state(self.addresses.get(instance_id, ""))
        if link != "unknown":
            return link == DOWN
        last = max(self.heard.get(instance_id, 0.0), since)
        return last > 0 and time.monotonic() - last > self.pc.instance_timeout_s

    def _link_changed(self, address: str, state: str) -> None:
        if state == DOWN:
            M_LINKS_DOWN.inc()
            ids = [iid for iid, a in self.addresses.items() if a == address]
            log.warning("lost the connection to instance %s at %s (its process is gone, or it answered no keepalive "
                        "for %gs)", "/".join(ids) or "?", address, self.pc.instance_timeout_s)
            self.view.invalidate()
            self.check_streams(time.monotonic())
        elif state == UP:
            self.view.invalidate()
            self._wake_waiting()

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
                self._wake_waiting()
                self.view.invalidate()
                self.rank, self.proxies = msg.proxy_rank, msg.proxies
                M_PEERS.set(msg.proxies)
                for v in msg.instances:
                    self.addresses[v.instance_id] = v.request_address
                    if v.state != "dead" and v.request_address and v.request_address not in self.instances:
                        # An instance streams its load to the proxies it knows: tell it about us now.
                        self._send_instance(v.request_address, wire.ProxyAlive(self.token_address))
                if msg.dispatch_policy in policy.DISPATCH_POLICIES:
                    self.dispatch_policy = msg.dispatch_policy
                self._check_gone(msg.uptime_s)
            if isinstance(msg, (wire.DispatchReply, wire.Snapshot)):
                fut = self._queries.get(msg.query_id)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif msg is None:
                M_BAD_FRAMES.inc()

    async def _poll_snapshot(self) -> None:
        while True:
            self._snapshot_asked_at = time.monotonic()
            await self._ask(wire.SnapshotQuery(next(self._ids), self.token_address), self.pc.snapshot_interval_s)
            await asyncio.sleep(self.pc.snapshot_interval_s)

    def _check_gone(self, manager_uptime_s: float) -> None:
        """Requests on an instance the manager marked dead, or no longer knows, are re-sent or failed. A
        manager that has just (re)started does not know every instance yet: absence counts only later."""
        states = {v.instance_id: v.state for v in self.snapshot}
        mc = self.cfg.manager
        settled = manager_uptime_s > 2 * mc.heartbeat_interval_s * mc.dead_after_missed
        for stream in list(self.streams.values()):
            if stream.done or not stream.instance_id:
                continue
            iid = stream.instance_id
            state = states.get(iid)
            # The manager's word is confirmed by our own view: an instance whose tokens or heartbeats reached
            # us within the manager's own dead-after time is alive, whatever a loaded manager concluded.
            heard_lately = time.monotonic() - self.heard.get(iid, 0.0) < mc.heartbeat_interval_s * mc.dead_after_missed
            # Absent: gone for good, unless we sent the request after the manager took this snapshot, or the
            # manager has only just (re)started.
            gone = state is None and settled and stream.sent_at < self._snapshot_asked_at
            if (state == "dead" or gone) and not heard_lately:
                self._instance_failed(stream, f"instance {stream.instance_id} died", cause="dead")

    # ------------------------------------------------------------------ dispatch

    async def _choose(self, stream: Stream) -> tuple[str, str]:
        """Where the request goes: by default from our own view (the manager hears of it afterwards);
        with proxy.dispatch = manager, before we have any view, or when our view has no instance for it (one
        that just joined may not be in it yet), the manager's answer."""
        sub = stream.submit
        if self.pc.dispatch == "local" and self.snapshot:
            chosen = self._choose_here(stream)
            if chosen is not None:
                return self._chose(sub, chosen)
        return await self._ask_or_choose(stream)

    def _chose(self, sub: wire.Submit, chosen: str) -> tuple[str, str]:
        M_LOCAL.inc()
        self._tell_manager_soon(wire.Dispatched(sub.request_id, chosen, len(sub.prompt_token_ids), sub.priority))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s -> %s (own view: %s)", sub.request_id, chosen, self.view.describe(chosen))
        return chosen, self.addresses[chosen]

    async def _ask_or_choose(self, stream: Stream) -> tuple[str, str]:
        sub = stream.submit
        if self.manager_ok() or not self.snapshot:
            q = wire.Dispatch(next(self._ids), sub.request_id, len(sub.prompt_token_ids), sub.priority, stream.exclude)
            reply = await self._ask(q, self.pc.dispatch_timeout_s)
            if reply is not None:
                if not reply.instance_id and not any(v.instance_id not in stream.exclude for v in self.alive()):
                    raise NoInstance(reply.reason or "no live instance")
            if reply is not None and reply.instance_id:
                M_ASKED.inc()
                self.addresses[reply.instance_id] = reply.request_address
                return reply.instance_id, reply.request_address
        chosen = self._choose_here(stream)
        if chosen is None:
            raise NoInstance("no live instance" if self.manager_ok() else
                             "no live instance (the manager is unreachable and the last snapshot has none)")
        return self._chose(sub, chosen)

    async def _place(self, stream: Stream) -> tuple[str, str]:
        """``_choose``, waiting while no instance can take the request right now but some live instance could
        later (stalled, draining, cordoned, or not in our view yet): until one can, for at most
        admission.queue_timeout_s. With no live instance at all, NoInstance at once."""
        deadline = 0.0
        try:
            while True:
                try:
                    return await self._choose(stream)
                except NoInstance as exc:
                    if not self._could_serve(stream):
                        raise
                    now = time.monotonic()
                    if not deadline:
                        deadline = now + self.adm.queue_timeout_s
                        M_WAITED.inc()
                        self.placing[stream.request_id] = len(stream.submit.prompt_token_ids)
                        log.info("request %s: %s; waiting up to %gs for an instance (admission.queue_timeout_s)",
                                 stream.request_id, exc, self.adm.queue_timeout_s)
                    if now >= deadline or stream.done:
                        raise NoInstance(f"{exc}; no instance could take it within {self.adm.queue_timeout_s:g}s "
                                         f"(admission.queue_timeout_s)", "wait_timeout") from None
                    await self._wait_change(min(deadline - now, 1.0))
        finally:
            self.placing.pop(stream.request_id, None)

    def _could_serve(self, stream: Stream) -> bool:
        """Whether some live instance that the request has not failed on exists, taking requests or not."""
        exclude = stream.exclude
        states = {v.instance_id: v.state for v in self.snapshot}
        for iid in {*states, *self.beats}:
            if iid in exclude or states.get(iid) == "dead" or self._dead(iid):
                continue
            if iid in states or self.links.state(self.addresses.get(iid, "")) == UP:
                return True
        return False

    async def _wait_change(self, timeout: float) -> None:
        """Until a heartbeat, a snapshot or a connection changes what instances can take (or ``timeout``)."""
        fut = asyncio.get_running_loop().create_future()
        self._changed.append(fut)
        try:
            await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            if fut in self._changed:
                self._changed.remove(fut)

    def _wake_waiting(self) -> None:
        waiting, self._changed = self._changed, []
        for fut in waiting:
            if not fut.done():
                fut.set_result(None)

    # ------------------------------------------------------------------ admission

    def admit(self, priority: int) -> None:
        """Raise Overloaded if the work that would wait in the cluster is past [admission]'s bounds for
        ``priority``. Requests that would wait: those waiting to start on the instances that take requests
        (their heartbeats), our own dispatches they do not show yet, the requests waiting here for an
        instance and this one, less the free batch slots; prompt tokens likewise, less the free KV. High
        priority's bounds are admission.high_priority_factor times larger."""
        adm = self.adm
        serving = requests = tokens = free_slots = free_tokens = room = capacity = kv = 0
        for iid, beat in self.beats.items():
            load = beat.load
            if load is None or not beat.accepting or not beat.healthy or self._dead(iid):
                continue
            serving += 1
            requests += load.waiting
            tokens += load.waiting_tokens
            free_slots += max(load.batch_size - load.running, 0)
            free_tokens += max(load.blocks_total - load.blocks_used, 0) * load.block_size
            kv += load.blocks_total * load.block_size
            room += AUTO_BATCHES * load.batch_size if adm.max_queued_requests < 0 else adm.max_queued_requests
            capacity += (AUTO_KV_CACHES * load.blocks_total * load.block_size if adm.max_queued_tokens < 0
                         else adm.max_queued_tokens)
        if not serving:
            return  # nothing to measure against: placement waits for an instance, or says none is alive
        fresh = time.monotonic() - self.view.ttl_s
        for iid, mine in self.view.mine.items():
            beat = self.beats.get(iid)
            block = beat.load.block_size if beat is not None and beat.load is not None else 16
            for _, blocks, at in mine:
                if at > fresh:
                    requests += 1
                    tokens += blocks * block
        requests += len(self.placing) + 1  # with this one
        tokens += sum(self.placing.values())
        factor = adm.high_priority_factor if priority > 0 else 1.0
        high = " for high priority" if priority > 0 else ""
        if priority > 0 and factor > 1:  # room for high priority even where normal may not wait at all
            room, capacity = max(room * factor, room + serving), max(capacity * factor, capacity + kv)
        if requests - free_slots > room:
            raise Overloaded(f"the cluster is overloaded: {requests - free_slots} requests would wait on its {serving} "
                             f"instance(s) (admission.max_queued_requests: {room} in all{high})", "queued_requests")
        if tokens - free_tokens > capacity:
            raise Overloaded(f"the cluster is overloaded: {tokens - free_tokens} prompt tokens would wait on its "
                             f"{serving} instance(s) (admission.max_queued_tokens: {capacity} in all{high})",
                             "queued_tokens")

    def _choose_here(self, stream: Stream) -> str | None:
        """The dispatch policy over our view (daemons/proxy/view.py): the instances' streamed loads plus our
        own dispatches they do not show yet; the manager's snapshot adds flags, a new instance's credit and
        ordered migrations. A request that failed somewhere avoids those instances (rare: built afresh)."""
        self._turn += 1
        priority = stream.submit.priority
        if not stream.exclude:
            return self.view.choose(self.alive, self.dispatch_policy, priority, self._turn, self.tie_start())
        now = time.monotonic()
        states = [self.view.state_of(v, v.load, now) for v in self.alive() if v.instance_id not in stream.exclude]
        return policy.dispatch(self.dispatch_policy, states, self._turn, self.cfg.scheduling.high_priority_headroom,
                               priority, start=self.tie_start())

    def tie_start(self) -> float:
        """Where our ties start among the instances: the proxies' starts are evenly spaced by their ranks, and
        all move on together every TIE_TURN_S (wall clock), so that over time no instance is always the first
        tie; seldom enough that a burst almost never straddles a turn (its proxies would start anew)."""
        return (time.time() // TIE_TURN_S * 0.618034 + self.rank / max(self.proxies, 1)) % 1.0

    def _tell_manager(self, msg: wire.Message) -> None:
        if not runtime.send_now(self.manager, wire.encode(msg)):
            log.debug("manager unreachable; it will not count a %s", type(msg).__name__)

    def _tell_manager_soon(self, msg: wire.Message) -> None:
        """Tell the manager at the end of this loop turn: the request itself goes out first, and the turn's
        messages go together. Every ZeroMQ send that finds the I/O thread asleep wakes it (tens of us on a
        loaded or virtual machine); sends in a row mostly find it awake."""
        if not self._soon:
            asyncio.get_running_loop().call_soon(self._flush_soon)
        self._soon.append(msg)

    def _flush_soon(self) -> None:
        soon, self._soon = self._soon, []
        for msg in soon:
            self._tell_manager(msg)

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

    async def submit(self, submit: wire.Submit) -> Stream:
        """Dispatch and send a request; the returned stream yields its tokens. Raises NoInstance."""
        stream = Stream(submit.request_id, submit, self.pc.request_timeout_s)
        self.streams[submit.request_id] = stream
        try:
            await self._dispatch(stream)
        except BaseException:
            self.streams.pop(submit.request_id, None)
            raise
        return stream

    async def _dispatch(self, stream: Stream) -> None:
        """Place the request (again) under a new epoch; a placement after tokens were streamed continues
        from them (re-prefill)."""
        instance_id, address = await self._place(stream)
        if stream.done:  # ended (client gone, deadline) while we chose
            return
        stream.instance_id, stream.address = instance_id, address
        stream.tried.append(instance_id)
        stream.sent_at = stream.progress_at = time.monotonic()
        stream.epoch += 1
        stream.owner_from = stream.next_index
        stream.early.clear()  # a gap's tokens came from the copy we left: the new one sends them again
        submit = msgspec.structs.replace(stream.submit, epoch=stream.epoch, output_token_ids=list(stream.token_ids))
        beat = self.beats.get(instance_id)
        self.view.sent_to(instance_id, beat.load if beat is not None else None,
                          len(submit.prompt_token_ids) + len(submit.output_token_ids))
        if not self._send_instance(address, submit):
            self._instance_failed(stream, f"the request path to instance {instance_id} is full", cause="full")

    def _instance_failed(self, stream: Stream, message: str, retryable: bool = True, status: int = 503,
                         cause: str = "failed") -> None:
        """The stream's owner failed it, died, stalled or went unhealthy: place it elsewhere, or fail it."""
        if stream.done:
            return
        if retryable and stream.next_index == 0 and len(stream.tried) - stream.given_back < self.pc.max_dispatch_attempts:
            log.warning("request %s: %s; sending it elsewhere", stream.request_id, message)
            M_RETRIES.inc()
        elif retryable and stream.next_index > 0 and stream.failovers < self.pc.max_failovers:
            stream.failovers += 1
            M_FAILOVERS.labels(cause).inc()
            log.warning("request %s: %s; continuing it elsewhere from token %d (failover %d of %d)", stream.request_id,
                        message, stream.next_index, stream.failovers, self.pc.max_failovers)
        else:
            if stream.next_index:
                message += f" after {stream.next_index} tokens (proxy.max_failovers = {self.pc.max_failovers})"
            stream.fail(message, status)
            return
        self._fence_owner(stream)
        if stream.instance_id and stream.instance_id not in stream.exclude:
            stream.exclude.append(stream.instance_id)
        stream.instance_id = stream.address = ""
        self._spawn(self._redispatch(stream, message))

    def _fence_owner(self, stream: Stream) -> None:
        """The copy we leave may still be running (a stalled or unhealthy instance): abort it by epoch."""
        if stream.address:
            self._fence(stream, stream.instance_id, stream.epoch, stream.address)

    def _fence(self, stream: Stream, instance_id: str, epoch: int, address: str = "") -> None:
        key = (instance_id, epoch)
        if key in stream.fenced:
            return
        stream.fenced.add(key)
        address = address or self.addresses.get(instance_id, "")
        if address:
            self._send_instance(address, wire.Abort(stream.request_id, epoch))

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
            self._send_instance(stream.address, wire.Abort(stream.request_id, stream.epoch))
        stream.done = True

    # ------------------------------------------------------------------ liveness

    async def _watch(self) -> None:
        """Each heartbeat: tell the instances we are here; fail over streams whose instance is silent,
        unhealthy or stalled; end requests past their deadline."""
        period = min(self.cfg.manager.heartbeat_interval_s, self.pc.instance_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            alive = wire.ProxyAlive(self.token_address)
            for address in list(self.instances):
                self._send_instance(address, alive)
            self.check_streams(time.monotonic())

    def check_streams(self, now: float) -> None:
        stall = self.pc.stall_timeout_s
        for stream in list(self.streams.values()):
            if stream.done:
                continue
            if stream.deadline and now > stream.deadline:
                M_TIMEOUTS.inc()
                self._fence_owner(stream)
                stream.fail(f"the request did not finish within proxy.request_timeout_s "
                            f"({self.pc.request_timeout_s:g}s)", 504)
                continue
            iid = stream.instance_id
            if not iid:  # being placed
                continue
            beat = self.beats.get(iid)
            if self._dead(iid, stream.sent_at):
                if self.links.state(stream.address) == DOWN:
                    self._instance_failed(stream, f"lost the connection to instance {iid} (its process is gone, or "
                                          f"it answered no keepalive for {self.pc.instance_timeout_s:g}s)", cause="dead")
                else:
                    self._instance_failed(stream, f"instance {iid} has not been heard from for over "
                                          f"{self.pc.instance_timeout_s:g}s (its connection never came up)",
                                          cause="silent")
            elif beat is not None and not beat.healthy:
                self._instance_failed(stream, f"instance {iid} is unhealthy (its engine makes no progress)",
                                      cause="unhealthy")
            elif stall and (stream.next_index or stream.early) and now - stream.progress_at > stall:
                self._instance_failed(stream, f"no token for {now - stream.progress_at:.1f}s on instance {iid}"
                                      f"{' (a token is missing)' if stream.early else ''}", cause="stalled")

    # ------------------------------------------------------------------ token path

    async def _recv_tokens(self) -> None:
        streams = self.streams
        async for frames in runtime.receive(self.pull):
            for frame in frames:
                msg = wire.decode(frame)
                if isinstance(msg, wire.TokenBatch):
                    iid = msg.instance_id
                    self.heard[iid] = time.monotonic()
                    for out in msg.outputs:
                        stream = streams.get(out.request_id)
                        if stream is None:
                            self._orphan(iid, out)
                            continue
                        if stream.owns(iid, out):
                            stream.feed(out)
                        elif not stream.done:
                            M_FENCED.inc()
                            self._fence(stream, iid, out.epoch)
                elif isinstance(msg, wire.Heartbeat):
                    self.heard[msg.instance_id] = self.beat_at[msg.instance_id] = time.monotonic()
                    self.view.heard(msg, self.beats.get(msg.instance_id))
                    self.beats[msg.instance_id] = msg
                    self.addresses[msg.instance_id] = msg.request_address
                    if self._changed:
                        self._wake_waiting()
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
            stream.instance_id, stream.address = msg.instance_id, msg.request_address
            stream.epoch, stream.owner_from = msg.epoch, msg.from_index
            stream.sent_at = time.monotonic()
            if msg.instance_id not in stream.tried:
                stream.tried.append(msg.instance_id)
        elif msg.epoch < stream.epoch or msg.instance_id != stream.instance_id:
            M_FENCED.inc()
            log.warning("request %s: instance %s claims epoch %d, but %s owns epoch %d; aborting that copy",
                        stream.request_id, msg.instance_id, msg.epoch, stream.instance_id, stream.epoch)
            self._fence(stream, msg.instance_id, msg.epoch, msg.request_address)
