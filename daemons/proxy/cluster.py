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

import zmq
import zmq.asyncio

from daemons import metrics, prefix, runtime, security, wire
from daemons.clock import Clock
from daemons.links import LinkWatch
from daemons.proxy.admission import AdmissionMixin
from daemons.proxy.dispatch import DispatchMixin
from daemons.proxy.fairgate import FairGateMixin
from daemons.proxy.fairness import FairQueue
from daemons.proxy.failover import FailoverMixin
from daemons.proxy.managerlink import ManagerLinkMixin
from daemons.proxy.stream import NoInstance, Overloaded, Stream
from daemons.proxy.telemetry import M_LINKS_HEALED, M_REJECTED, REJECT_REASONS
from daemons.proxy.tokens import TokenPathMixin
from daemons.proxy.view import DispatchView
from daemons.throttle import Throttle

log = logging.getLogger("llumnix.proxy")

__all__ = ["M_REJECTED", "REJECT_REASONS", "ClusterClient", "NoInstance", "Overloaded", "Stream"]


class ClusterClient(ManagerLinkMixin, DispatchMixin, FairGateMixin, AdmissionMixin, FailoverMixin, TokenPathMixin):
    """The proxy's side of the cluster: the state below, and a mixin per concern in the file named for it
    (managerlink, dispatch, fairgate, admission, failover, tokens)."""

    def __init__(self, cfg, ctx: zmq.asyncio.Context | None = None, clock: Clock | None = None):
        """``ctx``: the ZeroMQ context its sockets are made in (default: its own). ``clock``: the time its
        liveness, dispatch and stream checks read (default: the monotonic clock; tests/support passes the
        virtual loop's)."""
        self.clock = clock or Clock()
        metrics.bind("proxy", cfg.model.name)
        self.cfg = cfg
        self.pc = cfg.proxy
        self.ctx = ctx if ctx is not None else zmq.asyncio.Context()
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
        self.tracer = None  # daemons/tracing.py Tracer, set by the proxy when tracing is on
        self._queries: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._turn = 0
        self.rank, self.proxies = 0, 1  # our place among the proxies the manager hears from (see tie_start)
        self.view = DispatchView(cfg.manager.pending_dispatch_ttl_s, cfg.scheduling.high_priority_headroom,
                                 self.clock.monotonic)
        # Which instance caches which prompt blocks, from their CacheEvents (daemons/prefix.py): learnt again
        # from the instances themselves after a restart, within a heartbeat.
        self.cache_index = prefix.Follower(self._ask_cache, self.clock.monotonic, cfg.manager.heartbeat_interval_s)
        self._tasks: list[asyncio.Task] = []
        self._soon: list[wire.Message] = []  # for the manager at the end of this loop turn (_tell_manager_soon)
        self.essential: list[asyncio.Task] = []  # if one of these ends, the proxy exits (it would be deaf)
        self.adm = cfg.admission
        self.links = LinkWatch(self.pc.instance_timeout_s, self._link_changed,  # by request address
                               lambda _: M_LINKS_HEALED.inc())
        self._changed: list[asyncio.Future] = []  # dispatches waiting for an instance to take them
        self.placing: dict[str, int] = {}  # request id -> prompt tokens, while it waits for an instance
        self.owner_keys: dict[str, str] = {}  # instance id -> "role:name" of its CURVE key (tokens.py _from_owner)
        self._forged_logged = Throttle(60.0)
        self._sent_counts: dict[str, object] = {}  # instance id -> (time, Submits sent) at its heartbeats (check_taken)
        # Between API keys (daemons/proxy/fairgate.py); submits without a key never wait there.
        self.fair = FairQueue(self.clock.monotonic, self.pc.fair_burst_tokens) if self.pc.fair_queuing else None

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
