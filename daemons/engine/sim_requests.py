"""The sim engine's requests, its waiting queue, its request table and its free list of blocks
(daemons/engine/sim.py)."""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Iterable, Iterator

from daemons.engine.base import EngineRequest
from daemons.engine.sim_cache import SimPrefixCache
from daemons.engine.sim_values import unit
from daemons.wire import RequestLoad


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SimRequest:
    __slots__ = ("rid", "prompt_len", "sampling", "priority", "arrival_time", "generated", "blocks",
                 "preempted", "seed", "stop_ids", "max_total", "tokens", "hashes", "adapter", "session", "retain_s",
                 "queued_cached")

    def __init__(self, request: EngineRequest, max_model_len: int):
        self.rid = request.request_id
        self.prompt_len = len(request.prompt_token_ids)
        self.sampling = request.sampling
        self.priority = request.priority
        self.arrival_time = request.arrival_time
        # A failover continues where another instance stopped: like a preempted request, it re-prefills the
        # prompt and what it generated (the sim's tokens depend on the request id and index alone).
        self.generated = len(request.output_token_ids)
        self.blocks: list[int] = []  # block table: append-only while running, emptied on preemption
        self.preempted = False
        self.seed = unit(hashlib.blake2b(self.rid.encode(), digest_size=8).digest())
        self.stop_ids = frozenset(request.sampling.stop_token_ids)
        # The most tokens it can ever hold: it finishes on max_tokens or at the context limit.
        self.max_total = min(self.prompt_len + request.sampling.max_tokens, max_model_len)
        # With sim.prefix_caching: its prompt and generated token ids, and the chain hashes of their full
        # blocks as far as computed (daemons/engine/sim_cache.py); None without.
        self.tokens: list[int] | None = None
        self.hashes: list[bytes] = []
        self.adapter = (request.adapter, request.adapter_path)  # its LoRA adapter: travels with a migration
        self.session = request.session  # its conversation: its blocks are retained when it ends (tier.py)
        self.retain_s = request.retain_s
        self.queued_cached = 0  # of the tokens it will prefill, those cached when it was queued (WaitingQueue)


def request_rows(running: Iterable[SimRequest], suspended: Iterable[SimRequest], waiting: Iterable[SimRequest]):
    """The engine's request rows (``Engine.requests``): running, migrating out, waiting."""
    def row(r: SimRequest, state: str) -> RequestLoad:
        return RequestLoad(request_id=r.rid, state=state, blocks=len(r.blocks), prompt_tokens=r.prompt_len,
                           output_tokens=r.generated, priority=r.priority, max_tokens=r.max_total - r.prompt_len)

    out = [row(r, "running") for r in running]
    out += [row(r, "migrating") for r in suspended]
    out += [row(r, "preempted" if r.preempted else "waiting") for r in waiting]
    return out


class WaitingQueue:
    """Waiting requests: higher priority first, FCFS within a priority. One deque per priority that has
    waiting requests, so every verb but ``remove`` is O(1) while there are only a few priorities."""

    __slots__ = ("_classes", "_order", "_len", "tokens", "_cache")

    def __init__(self, cache=None):
        """``cache``: the engine's prefix cache (sim_cache.SimPrefixCache; None: none), which says, once as a request
        is queued, how much of what it will prefill is cached (in the engine or the host tier): ``tokens`` counts
        only the rest (what admission and the SLO's prediction weigh as queued work)."""
        self._classes: dict[int, deque[SimRequest]] = {}
        self._order: list[int] = []  # priorities of the non-empty classes, highest first
        self._len = 0
        self.tokens = 0  # the tokens they will prefill (prompt and, if preempted, what they generated), less cached
        self._cache = cache

    def _queued(self, req: SimRequest) -> int:
        """(As ``req`` is queued) the tokens it will prefill, less those cached now (looked up once)."""
        tokens = req.prompt_len + req.generated
        cache = self._cache
        req.queued_cached = sum(cache.cached(req, tokens)) if cache is not None and req.tokens is not None else 0
        return tokens - req.queued_cached

    @staticmethod
    def _owed(req: SimRequest) -> int:
        return req.prompt_len + req.generated - req.queued_cached

    def _class(self, priority: int) -> deque[SimRequest]:
        q = self._classes.get(priority)
        if q is None:
            q = self._classes[priority] = deque()
            self._order.append(priority)
            self._order.sort(reverse=True)
        return q

    def _drop_if_empty(self, priority: int) -> None:
        if not self._classes[priority]:
            del self._classes[priority]
            self._order.remove(priority)

    def append(self, req: SimRequest) -> None:
        """A new arrival: behind every waiting request of its priority."""
        self._class(req.priority).append(req)
        self._len += 1
        self.tokens += self._queued(req)

    def appendleft(self, req: SimRequest) -> None:
        """A preempted request: it arrived before every waiting request of its priority."""
        self._class(req.priority).appendleft(req)
        self._len += 1
        self.tokens += self._queued(req)

    def head(self) -> SimRequest:
        return self._classes[self._order[0]][0]

    def popleft(self) -> SimRequest:
        priority = self._order[0]
        req = self._classes[priority].popleft()
        self._drop_if_empty(priority)
        self._len -= 1
        self.tokens -= self._owed(req)
        return req

    def remove(self, req: SimRequest) -> None:
        self._classes[req.priority].remove(req)  # O(its class), but aborts are rare next to steps
        self._drop_if_empty(req.priority)
        self._len -= 1
        self.tokens -= self._owed(req)

    def clear(self) -> None:
        self._classes.clear()
        self._order.clear()
        self._len = 0
        self.tokens = 0

    def __len__(self) -> int:
        return self._len

    def count_above(self, priority: int) -> int:
        """Waiting requests of a priority above ``priority``."""
        return sum(len(self._classes[p]) for p in self._order if p > priority)

    def tokens_above(self, priority: int) -> int:
        """The tokens those will prefill."""
        return sum(self._owed(r) for p in self._order if p > priority for r in self._classes[p])

    def __iter__(self) -> Iterator[SimRequest]:
        for priority in self._order:
            yield from self._classes[priority]


class SimRequestTable:
    """Every request the engine holds, by id (waiting, running, suspended), and of those the running ones in
    admission order with their count per priority. Change the running set only via ``run`` / ``unrun``."""

    def __init__(self):
        self.by_id: dict[str, SimRequest] = {}
        self.running: dict[str, SimRequest] = {}  # insertion order = admission order
        self.per_priority: dict[int, int] = {}  # running requests by priority (no zero counts)

    def run(self, req: SimRequest) -> None:
        self.running[req.rid] = req
        self.per_priority[req.priority] = self.per_priority.get(req.priority, 0) + 1

    def unrun(self, req: SimRequest) -> None:
        del self.running[req.rid]
        left = self.per_priority[req.priority] - 1
        if left:
            self.per_priority[req.priority] = left
        else:
            del self.per_priority[req.priority]

    def context_tokens(self) -> int:
        """Tokens (prompt and generated) the running requests hold."""
        return sum(r.prompt_len + r.generated for r in self.running.values())

    def clear(self) -> None:
        self.by_id.clear()
        self.running.clear()
        self.per_priority.clear()


class SimBlocks:
    """The free list of KV blocks (a block taken leaves it, a request's blocks come back on release), with
    the prefix cache (if any) told which blocks lose their content and which keep it while free."""

    def __init__(self, num_blocks: int, watermark_blocks: float, cache: SimPrefixCache | None):
        self.num_blocks = num_blocks
        self.watermark = watermark_blocks  # blocks admission and migration leave free
        self.cache = cache
        self._free: deque[int] = deque(range(num_blocks))

    def __len__(self) -> int:
        """Free blocks."""
        return len(self._free)

    def fits(self, need: int) -> bool:
        """Whether taking ``need`` blocks keeps the watermark."""
        return len(self._free) - need >= self.watermark

    def _defer_retained(self, n: int) -> None:
        """Move the retained blocks among the next ``n`` others at the head of the free list to its tail (if
        only retained ones are left, the oldest go first)."""
        retention = self.cache.retention if self.cache is not None else None
        if retention is None or retention.expire() < 0 or not len(retention):
            return
        free, plain, moved = self._free, [], []
        while len(plain) < n and free:
            b = free.popleft()
            (moved if self.cache.retained(b) else plain).append(b)
        free.extendleft(reversed(plain))
        free.extend(moved)

    def take(self, n: int) -> list[int]:
        """Blocks whose content is about to be overwritten (the cache forgets what they held)."""
        self._defer_retained(n)
        taken = [self._free.popleft() for _ in range(n)]
        if self.cache is not None:
            for block in taken:
                self.cache.taken(block)
        return taken

    def take_for_prefill(self, n: int) -> list[int]:
        """Blocks for an admitted request; the cache learns of them from ``SimPrefixCache.prefilled``."""
        self._defer_retained(n)
        return [self._free.popleft() for _ in range(n)]

    def release(self, req: SimRequest, ended: bool = False) -> None:
        """``ended``: it finished (its session's blocks are retained)."""
        if self.cache is not None:
            self.cache.keep_content(req)
            if ended and req.session:
                self.cache.turn_ended(req)
        self._free.extend(req.blocks)
        req.blocks = []

    def reset(self) -> None:
        self._free = deque(range(self.num_blocks))
        if self.cache is not None:
            self.cache.clear()
