"""Fair sharing of a saturated cluster between API keys (tenants): a virtual-token-counter queue.

Every tenant has a counter of the tokens it was served, divided by its weight (``weight`` in the keys file).
While the cluster has room, requests pass at once, in arrival order. Once it has none, they wait here, one
queue per tenant, and the next to go is always the head of the tenant whose counter is lowest: a tenant that
sends ten times as much as another gets no more than its share while both wait, and a light tenant's request
goes ahead of a heavy tenant's backlog. A request is charged its prompt plus ``max_tokens`` when it leaves,
and what it did not generate is given back when it ends (counters follow the service actually given).

A tenant whose queue was empty starts at no less than the lowest counter of those waiting less ``burst``
tokens: a light tenant's short burst goes ahead of a heavy tenant's backlog, but no tenant can save up more
credit than that by staying idle and then take the cluster for itself (between equal counters the tenant
with fewer requests in flight goes first). While both wait, service alternates by counter: the shares hold
to within ``burst`` tokens. A tenant holding less than its weighted share of the requests in flight of
the active tenants (heard from within ``ACTIVE_S``) may use all of the room; the others must leave
``reserve`` of every instance's batch slots and KV cache free, so that a light tenant's next request starts
at once instead of waiting for a slot: its time to first token stays what it is on an idle cluster. With one tenant active,
nothing waits here and nothing is reserved (the queue is only a gate between tenants).

Pure bookkeeping over an injected clock: daemons/proxy/cluster/fairgate.py asks ``head`` and ``under_share`` and
decides whether the cluster has room; tests/unit/test_tenants.py drives it alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

ACTIVE_S = 30.0  # a tenant not heard from for this long no longer counts as active


@dataclass
class Waiter:
    tenant: str
    request_id: str
    cost: float  # tokens charged when it leaves: prompt + max_tokens
    weight: float
    seq: int
    gone: bool = False  # left the queue (released or withdrawn)
    handle: object = None  # the caller's: what it needs to wake and place the request


@dataclass
class _Tenant:
    counter: float = 0.0
    queue: deque = field(default_factory=deque)
    seen: float = float("-inf")  # when its last request arrived
    in_flight: int = 0  # released and not ended


class FairQueue:
    def __init__(self, now: Callable[[], float], burst: float = 0.0):
        self.now = now
        self.burst = burst
        self.tenants: dict[str, _Tenant] = {}
        self._seq = 0
        self.waiting = 0  # requests queued here, all tenants
        self._weights: dict[str, float] = {}  # the weight each tenant last came with

    def _tenant(self, name: str) -> _Tenant:
        t = self.tenants.get(name)
        if t is None:
            t = self.tenants[name] = _Tenant(counter=self._floor() - self.burst)
        return t

    def _floor(self) -> float:
        """The lowest counter among the tenants that wait (0 when none does)."""
        backlogged = [t.counter for t in self.tenants.values() if t.queue]
        return min(backlogged) if backlogged else 0.0

    def seen(self, tenant: str, weight: float = 1.0) -> None:
        """A request of ``tenant`` arrived (it counts as active for ACTIVE_S)."""
        self._tenant(tenant).seen = self.now()
        self._weights[tenant] = weight

    def active(self) -> list[str]:
        cut = self.now() - ACTIVE_S
        return [name for name, t in self.tenants.items() if t.seen >= cut or t.queue or t.in_flight]

    def contended(self) -> bool:
        """Whether more than one tenant is active: only then does anything wait or get reserved."""
        cut = self.now() - ACTIVE_S
        n = 0
        for t in self.tenants.values():
            if t.seen >= cut or t.queue or t.in_flight:
                n += 1
                if n > 1:
                    return True
        return False

    def join(self, tenant: str, request_id: str, cost: float, weight: float) -> Waiter:
        t = self._tenant(tenant)
        if not t.queue:  # back from idle: no more credit than ``burst`` saved while away
            t.counter = max(t.counter, self._floor() - self.burst)
        self._seq += 1
        w = Waiter(tenant, request_id, cost, weight, self._seq)
        t.queue.append(w)
        self.waiting += 1
        return w

    def head(self) -> Waiter | None:
        """The next request to go: the oldest of the tenant with the lowest counter; between equal counters
        (a tenant back from idle starts level with the others), the one with fewer requests in flight for
        its weight, then the oldest."""
        best = best_key = None
        for t in self.tenants.values():
            if t.queue:
                w = t.queue[0]
                key = (t.counter, t.in_flight / w.weight, w.seq)
                if best is None or key < best_key:
                    best, best_key = w, key
        return best

    def under_share(self, tenant: str, weight: float) -> bool:
        """Whether ``tenant`` holds less than its weighted share of the requests in flight of the active
        tenants (it may use the reserve: a light tenant's requests start at once)."""
        mine = self._tenant(tenant)
        names = set(self.active()) | {tenant}
        total = sum(self.tenants[n].in_flight for n in names)
        weights = sum(self._weights.get(n, 1.0) for n in names)
        return total == 0 or mine.in_flight / self._weights.get(tenant, weight) < total / weights

    def release(self, w: Waiter) -> None:
        """``w`` leaves the queue to be dispatched: its tenant is charged its cost."""
        self._remove(w)
        t = self._tenant(w.tenant)
        t.counter += w.cost / w.weight
        t.in_flight += 1

    def charge(self, tenant: str, cost: float, weight: float) -> None:
        """A request that passed without waiting (the cluster had room): charged all the same."""
        t = self._tenant(tenant)
        t.counter = max(t.counter, self._floor() - self.burst) + cost / weight
        t.in_flight += 1

    def withdraw(self, w: Waiter) -> None:
        """``w`` leaves without being dispatched (its client went away, its deadline passed)."""
        self._remove(w)

    def ended(self, tenant: str, unused: float, weight: float) -> None:
        """A released request ended; ``unused``: the tokens it was charged and did not generate."""
        t = self.tenants.get(tenant)
        if t is None:
            return
        t.in_flight = max(t.in_flight - 1, 0)
        t.counter -= max(unused, 0.0) / weight

    def _remove(self, w: Waiter) -> None:
        if w.gone:
            return
        w.gone = True
        q = self.tenants[w.tenant].queue
        try:
            q.remove(w)
        except ValueError:
            return
        self.waiting -= 1

    def queued(self, tenant: str) -> int:
        t = self.tenants.get(tenant)
        return len(t.queue) if t is not None else 0

    def backlogged(self) -> int:
        return sum(1 for t in self.tenants.values() if t.queue)

    def forget_idle(self) -> None:
        """Drop tenants neither active nor waiting (a keys file that changed leaves none behind for ever)."""
        cut = self.now() - ACTIVE_S
        for name in [n for n, t in self.tenants.items() if t.seen < cut and not t.queue and not t.in_flight]:
            del self.tenants[name]
            self._weights.pop(name, None)
