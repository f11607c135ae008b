"""Per-key limits (``requests_per_minute``, ``tokens_per_minute``, ``max_concurrent_requests`` in the API keys
file, daemons/proxy/front/apikeys.py): a request past one is refused with 429 and a Retry-After that says when it
would pass.

- requests per minute: a token bucket of that many requests, refilled evenly over a minute;
- tokens per minute: likewise in tokens; a request is charged its prompt plus ``max_tokens`` (times ``n``) when
  it is admitted, and needs the bucket to hold that much (or, for a request larger than the whole bucket, a
  full bucket); what it did not generate is given back when it ends, and a request that got no answer is
  given back whole;
- concurrent requests: requests of the key in flight on this proxy.

The limits are read from the key at every request, so a reloaded keys file applies at once. The clock is
injected (tests drive it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from daemons.proxy.front.apikeys import Principal
from daemons.proxy.api.protocol import ApiError
from daemons.proxy.cluster.telemetry import M_TENANT_REJECTED


class TenantLimited(Exception):
    def __init__(self, message: str, reason: str, retry_after_s: float):
        super().__init__(message)
        self.reason = reason
        self.retry_after = max(1, math.ceil(retry_after_s))


class _Bucket:
    __slots__ = ("level", "at", "capacity")

    def __init__(self, capacity: float, now: float):
        self.level, self.at, self.capacity = float(capacity), now, float(capacity)

    def refill(self, capacity: float, now: float) -> None:
        if capacity != self.capacity:  # the limit changed: keep what was used, on the new scale
            self.level = min(self.level + capacity - self.capacity, capacity)
            self.capacity = capacity
        self.level = min(self.level + (now - self.at) * capacity / 60.0, capacity)
        self.at = now

    def wait_for(self, amount: float) -> float:
        """Seconds until the bucket holds ``amount`` (0 if it does)."""
        return max(amount - self.level, 0.0) * 60.0 / self.capacity


@dataclass
class Ticket:
    """One admitted request of a key: released once, when it ends."""

    name: str
    tokens: int = 0  # charged to the tokens-per-minute bucket
    released: bool = False


class _State:
    __slots__ = ("requests", "tokens", "in_flight")

    def __init__(self):
        self.requests: _Bucket | None = None
        self.tokens: _Bucket | None = None
        self.in_flight = 0


class Tenants:
    def __init__(self, now: Callable[[], float]):
        """``now``: the proxy's clock (daemons.clock.Clock ``monotonic``)."""
        self.now = now
        self._state: dict[str, _State] = {}

    def in_flight(self, name: str) -> int:
        st = self._state.get(name)
        return st.in_flight if st is not None else 0

    def enter(self, p: Principal) -> Ticket:
        """A request of key ``p`` arrives; raises TenantLimited past its concurrency or requests-per-minute limit."""
        st = self._state.get(p.name)
        if st is None:
            st = self._state[p.name] = _State()
        now = self.now()
        if p.max_concurrent_requests and st.in_flight >= p.max_concurrent_requests:
            raise TenantLimited(f"Rate limit reached for key '{p.name}': {st.in_flight} requests in flight "
                                f"(max_concurrent_requests: {p.max_concurrent_requests}); retry when one ends.",
                                "concurrent_requests", 1)
        if p.requests_per_minute:
            b = st.requests
            if b is None:
                b = st.requests = _Bucket(p.requests_per_minute, now)
            b.refill(p.requests_per_minute, now)
            if b.level < 1.0:
                raise TenantLimited(f"Rate limit reached for key '{p.name}' on requests per minute: limit "
                                    f"{p.requests_per_minute}.", "requests_per_minute", b.wait_for(1.0))
            b.level -= 1.0
        else:
            st.requests = None
        st.in_flight += 1
        return Ticket(p.name)

    def charge(self, p: Principal, ticket: Ticket, tokens: int) -> None:
        """The admitted request will take up to ``tokens``; raises TenantLimited past tokens per minute (the
        ticket is then released)."""
        if not p.tokens_per_minute:
            return
        st = self._state[p.name]
        now = self.now()
        b = st.tokens
        if b is None:
            b = st.tokens = _Bucket(p.tokens_per_minute, now)
        b.refill(p.tokens_per_minute, now)
        need = min(tokens, b.capacity)
        if b.level < need:
            self.release(ticket, 0)
            raise TenantLimited(f"Rate limit reached for key '{p.name}' on tokens per minute: limit "
                                f"{p.tokens_per_minute}, requested {tokens} (prompt plus max_tokens), "
                                f"available {max(int(b.level), 0)}.", "tokens_per_minute", b.wait_for(need))
        b.level -= tokens
        ticket.tokens = tokens

    def release(self, ticket: Ticket, used_tokens: int) -> None:
        """The request ended having used ``used_tokens`` of what it was charged; idempotent."""
        if ticket.released:
            return
        ticket.released = True
        st = self._state.get(ticket.name)
        if st is None:
            return
        st.in_flight = max(st.in_flight - 1, 0)
        if st.tokens is not None and ticket.tokens:
            st.tokens.level = min(st.tokens.level + max(ticket.tokens - used_tokens, 0), st.tokens.capacity)

    def forget(self, names: set[str]) -> None:
        """Drop the state of keys no longer in the file that have nothing in flight."""
        for name in [n for n, st in self._state.items() if n not in names and not st.in_flight]:
            del self._state[name]


class TenantLimits:
    """A request's way through its key's limits, as API errors (429 with Retry-After). Owns the keys' state
    (``tenants``, above)."""

    def __init__(self, tenants: Tenants):
        self.tenants = tenants

    def enter(self, principal) -> Ticket:
        """The key's own limits (above): 429 with Retry-After past one."""
        try:
            return self.tenants.enter(principal)
        except TenantLimited as exc:
            raise self._limited(principal, exc) from None

    @staticmethod
    def _limited(principal, exc: TenantLimited) -> ApiError:
        M_TENANT_REJECTED.labels(principal.name, exc.reason).inc()
        err = ApiError(429, str(exc), type_="rate_limit_exceeded", code=exc.reason)
        err.headers = {"Retry-After": str(exc.retry_after)}
        return err

    def charge(self, job, tokens: int) -> None:
        if job.ticket is not None:
            try:
                self.tenants.charge(job.principal, job.ticket, tokens)
            except TenantLimited as exc:
                raise self._limited(job.principal, exc) from None

    def release(self, job) -> None:
        """The request's key has it no longer in flight; tokens it was charged and did not use go back (a
        request that was never answered used none)."""
        if job is not None and job.ticket is not None:
            used = job.prompt_tokens + job.completion_tokens if job.first_at is not None else 0
            self.tenants.release(job.ticket, used)
