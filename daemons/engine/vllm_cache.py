"""The vllm backend's prefix cache as the instance publishes it (``engine.cache``; daemons/prefix.py): vLLM's
own KV cache events, and its cache map for a whole snapshot.

vLLM's block pool queues an event for every full block it caches (``BlockStored``, hits of cached blocks
included) and every cached block it evicts (``BlockRemoved``), and its scheduler hands each step's events
to a publisher. The engine is built with events on and the "null" publisher, which we replace with this
object: the events wait here until the instance's report loop takes them (``events``), and what our own
verbs queue between steps (a migration's reservation) is taken from the pool directly. Block hashes are
vLLM's (sha256 chains, as daemons/prefix.py computes them); an event carries the hash as bytes or, by
default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), as the int of its last 8 bytes: our key either way.

Hit counts: vLLM's own (its PrefixCacheStats: tokens of new requests looked up, and found cached).
"""

from __future__ import annotations

import logging

from daemons import prefix

log = logging.getLogger("llumnix.instance")


class VllmPrefixCache:
    def __init__(self, scheduler, pool):
        from vllm.v1.metrics.stats import PrefixCacheStats

        self._pool = pool
        self._events: list = []
        # vLLM counts lookups only with stats on; nothing else reads or resets them here (our engine logs
        # no stats), so they add up from the start, as vLLM's own prefix-cache counters do.
        kv = scheduler.kv_cache_manager
        kv.log_stats = True
        kv.prefix_cache_stats = self._stats = PrefixCacheStats()
        self._known: set[int] = set()  # keys reported held (what AllBlocksCleared removes)
        self.by_source = {"engine": 0, "host": 0, "pulled": 0, "recomputed": 0}  # prompt tokens of new requests
        scheduler.kv_event_publisher = self  # vLLM's scheduler publishes each step's KVEventBatch to us

    # vLLM's EventPublisher interface (what its scheduler calls)
    def publish(self, batch) -> None:
        self._events.extend(batch.events)

    def shutdown(self) -> None:
        self._events = []

    def __len__(self) -> int:
        return len(self._pool.cached_block_hash_to_block._cache)

    @property
    def query_tokens(self) -> int:
        """Tokens of new requests looked up in the cache (vLLM's prefix_cache_queries)."""
        return self._stats.queries

    @property
    def hit_tokens(self) -> int:
        """Of those, found cached (vLLM's prefix_cache_hits)."""
        return self._stats.hits

    def counted(self, tokens: int, engine: int, host: int, pulled: int = 0) -> None:
        """A new request of ``tokens`` prompt tokens: ``engine`` of them found in the prefix cache, ``host``
        restored from the host tier when it was added, ``pulled`` restored from blocks another instance sent
        (the rest is prefilled)."""
        src = self.by_source
        src["engine"] += engine
        src["host"] += host
        src["pulled"] += pulled
        src["recomputed"] += tokens - engine - host - pulled

    def events(self) -> list[tuple[bool, int]]:
        """(stored?, key) of every change since the last call, in order (between steps only)."""
        taken = self._pool.take_events()
        if taken:
            self._events.extend(taken)
        out: list[tuple[bool, int]] = []
        known = self._known
        removed = False
        for ev in self._events:
            kind = type(ev).__name__
            if kind == "BlockStored":
                for h in ev.block_hashes:
                    k = prefix.key(h)
                    out.append((True, k))
                    known.add(k)
            elif kind == "BlockRemoved":
                for h in ev.block_hashes:
                    k = prefix.key(h)
                    out.append((False, k))
                    known.discard(k)
                    removed = True
            elif kind == "AllBlocksCleared":
                out.extend((False, k) for k in known)
                known.clear()
                removed = True
        self._events = []
        if removed:
            # vLLM may cache one content in several blocks (two requests prefilled it at once): the eviction of
            # one copy is no removal while another holds it. The cache map says what is held now.
            held = set(self.snapshot(remember=False))
            known.update(k for s, k in out if not s and k in held)
            out = [(s, k) for s, k in out if s or k not in held]
        return out

    def snapshot(self, remember: bool = True) -> list[int]:
        """Every block key cached now (the pool's map: running requests' full blocks and free cached ones)."""
        from vllm.v1.core.kv_cache_utils import get_block_hash

        keys = [prefix.key(get_block_hash(k)) for k in self._pool.cached_block_hash_to_block._cache]
        if remember:
            self._known = set(keys)
        return keys
