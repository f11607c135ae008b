"""The fair gate: the fair queue between API keys (daemons/proxy/cluster/fairness.py) in front of dispatch.

A request of a key goes on at once while the cluster has room for it and nothing waits here; otherwise it
waits in the fair queue until it is the head (its key served least) and the cluster has room. Requests wait
here, not in the instances' queues, even while one key alone is active: a key that comes later then finds
no backlog of another's ahead of it on the instances. Room: some
instance that takes requests has a free batch slot and the KV cache for the prompt, counting its waiting
requests and our own dispatches its reports do not show yet; a key that holds its share of the requests in
flight or more must leave
``proxy.fair_reserve`` of the instance's slots and KV free. A failover or a redispatch does not queue again.
"""

from __future__ import annotations

import asyncio
import math

from daemons import policy, wire
from daemons.clock import Clock
from daemons.proxy.cluster.admission import Placing
from daemons.proxy.cluster.fairness import FairQueue
from daemons.proxy.cluster.known import KnownInstances
from daemons.proxy.cluster.stream import Stream
from daemons.proxy.cluster.telemetry import M_TENANT_QUEUED, M_TENANT_TOKENS, M_TENANT_WAITED
from daemons.proxy.cluster.view import DispatchView

POLL_S = 1.0  # a waiter looks at its stream's deadline at least this often


class FairGate:
    """Owns the fair queue between API keys (None: proxy.fair_queuing off) and whether a request let go is
    not dispatched yet. Receives the clock, proxy.fair_reserve, what we know of the instances (their
    heartbeats), the dispatch view (our dispatches they do not show yet) and the requests placing here."""

    def __init__(self, fair: FairQueue | None, clock: Clock, reserve: float, known: KnownInstances,
                 view: DispatchView, placing: Placing):
        self.fair = fair
        self.clock = clock
        self.reserve = reserve
        self.known = known
        self.view = view
        self.placing = placing
        self._releasing = False  # a request left the queue and is not dispatched yet: release no other meanwhile

    def queues(self, tenant: str, priority: int) -> bool:
        """Whether a request of ``tenant`` waits its turn here (high priority and requests without a key do not)."""
        return bool(tenant) and self.fair is not None and priority <= 0

    def waiting(self) -> bool:
        return self.fair is not None and bool(self.fair.waiting)

    def forget_idle(self) -> None:
        if self.fair is not None:
            self.fair.forget_idle()

    async def take_turn(self, stream: Stream, tenant: str, weight: float) -> bool:
        """Return when ``stream`` may be dispatched (True: the caller dispatches it, then calls
        ``turn_taken``), or has ended while it waited (False)."""
        fq = self.fair
        fq.seen(tenant, weight)
        sub = stream.submit
        cost = len(sub.prompt_token_ids) + sub.sampling.max_tokens
        stream.tenant, stream.weight = tenant, weight
        if not fq.waiting and not self._releasing and self._room_for(sub, tenant, weight):
            fq.charge(tenant, cost, weight)
            self._releasing = True
            return True
        w = fq.join(tenant, stream.request_id, cost, weight)
        w.handle = (asyncio.get_running_loop().create_future(), sub)
        M_TENANT_WAITED.labels(tenant).inc()
        M_TENANT_QUEUED.set(fq.waiting)
        self.placing.add(stream.request_id, len(sub.prompt_token_ids), sub.sampling.max_tokens)
        released = w.handle[0]
        taken = False
        try:
            self.pump()
            while not stream.done and not released.done():
                await asyncio.wait((released,), timeout=POLL_S)
            taken = released.done()  # (let go as its deadline passed: the caller skips the dispatch)
            if not taken:
                stream.tenant = ""  # never charged: nothing to give back
            return taken
        finally:
            if released.done() and not taken:
                self.turn_taken()  # cancelled once let go (its client left): the next may go
            fq.withdraw(w)
            M_TENANT_QUEUED.set(fq.waiting)
            self.placing.discard(stream.request_id)

    def turn_taken(self) -> None:
        """The request let go last is dispatched (or failed): the next may go."""
        self._releasing = False
        self.pump()

    def pump(self) -> None:
        """Let the head of the fair queue go if the cluster has room for it (one at a time: the room counts
        our dispatches, and the one let go is dispatched when its task runs). Called whenever room may have
        come: a heartbeat, a snapshot, a connection change, a dispatch done, and on the proxy's watch."""
        fq = self.fair
        if fq is None or self._releasing or not fq.waiting:
            return
        w = fq.head()
        future, sub = w.handle
        if self._room_for(sub, w.tenant, w.weight):
            fq.release(w)
            self._releasing = True
            future.set_result(None)

    def turn_ended(self, stream: Stream) -> None:
        """A stream that took its turn ended: give back what it was charged and did not generate."""
        if not stream.tenant or self.fair is None:
            return
        generated = len(stream.token_ids)
        M_TENANT_TOKENS.labels(stream.tenant).inc(len(stream.submit.prompt_token_ids) + generated)
        self.fair.ended(stream.tenant, stream.submit.sampling.max_tokens - generated, stream.weight)
        stream.tenant = ""

    def _room_for(self, sub: wire.Submit, tenant: str, weight: float) -> bool:
        """Room for ``sub`` of ``tenant``: the reserve left free unless it holds less than its share of the
        requests in flight (a key alone keeps it free too: the next key to come starts at once)."""
        return self._has_room(sub, self.fair.under_share(tenant, weight))

    def _has_room(self, sub: wire.Submit, under_share: bool) -> bool:
        """Whether some instance that takes requests could start ``sub`` now (see the module's text); with no
        such instance, True: placement decides (it waits for one, or says none lives)."""
        reserve = 0.0 if under_share else self.reserve
        now = self.clock.monotonic()
        serving = False
        for iid, beat in self.known.serving():
            load = beat.load
            serving = True
            pending_requests, pending_blocks = self.view.pending(iid, now)
            slots = load.batch_size - load.running - load.waiting - pending_requests
            blocks = (load.blocks_total - load.blocks_used - pending_blocks
                      - policy.blocks_for(load.waiting_tokens, load.block_size))
            need = policy.blocks_for(len(sub.prompt_token_ids) + 1, load.block_size)
            if (slots - 1 >= math.ceil(reserve * load.batch_size)
                    and blocks - need >= math.ceil(reserve * load.blocks_total)):
                return True
        return not serving

    def under_share(self, tenant: str) -> bool:
        """Whether ``tenant`` holds less than its share of the fair queue (admission lets it in past the
        cluster's bounds: a heavy key's backlog must not lock a light key out)."""
        fq = self.fair
        if fq is None or not tenant or not fq.contended():
            return False
        return fq.queued(tenant) * max(fq.backlogged(), 1) < fq.waiting
