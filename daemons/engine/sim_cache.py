"""The sim engine's prefix cache (``sim.prefix_caching``): which content its KV blocks hold, as vLLM's prefix
cache knows it, so that a request whose leading blocks are cached skips their prefill time.

Like vLLM's: a full block's content is named by its chain hash (daemons/prefix.py, vLLM's own scheme over
the prompt and the tokens generated so far); the blocks of a request that finished, was preempted or
migrated out keep their content while they sit in the free list, and lose it when they are taken for new
content (the free list is least-recently-freed first, so that is vLLM's LRU eviction); a running request's
blocks hold their content too. Unlike vLLM: a hit saves compute only, the request still takes blocks of
its own (the sim's KV values are functions of the request id, so two requests cannot share a block), which
makes the sim's memory use under caching an upper bound of vLLM's.

``events()`` gives what was stored and removed since the last call, in order, as (stored?, block key): what
an instance publishes for the cluster's prefix index.

With a host tier (daemons/engine/tier.py, keys only): content a free block loses when it is taken goes to the
tier; a request's leading blocks past the cache's hit that the tier holds are hits too, each costing the step
that admits it ``sim.restore_ms_per_block`` (``restoring``). With retention, the free list takes retained
blocks last (``SimBlocks``).
"""

from __future__ import annotations

import time

import torch

from daemons import prefix
from daemons.config import KvTierConfig, SimConfig
from daemons.engine.base import EngineError
from daemons.engine.tier import HostTier, Retention, retained_held, tier_blocks

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


def build_cache(sim: SimConfig, kv_tier: KvTierConfig | None = None, clock=None) -> SimPrefixCache | None:
    """The sim engine's prefix cache (None: sim.prefix_caching off), with its host tier (``kv_tier.host_mb``, in
    blocks of the sim's KV shape) and retention (deadlines on ``clock``: the simulator's virtual time) if
    ``kv_tier`` asks for them."""
    if not sim.prefix_caching:
        return None
    cfg = kv_tier or KvTierConfig(host_mb=0, retain_s=0.0)
    nbytes = 2 * sim.block_size * sim.kv_heads * sim.head_dim * _ITEMSIZE[sim.kv_dtype] * sim.kv_layers
    capacity = tier_blocks(cfg.host_mb, nbytes, sim.num_blocks)
    limit = int(cfg.retain_share * (sim.num_blocks + capacity))
    retention = (Retention(cfg.retain_s, cfg.max_retain_s, limit, clock or time.monotonic)
                 if cfg.retain_s > 0 and limit else None)
    tier = HostTier(capacity, nbytes, retention, store=False, restore_ms=sim.restore_ms_per_block) if capacity else None
    return SimPrefixCache(sim.block_size, tier, retention, nbytes)


def need_cache(cache: SimPrefixCache | None) -> SimPrefixCache:
    if cache is None:
        raise EngineError("the sim engine keeps no prefix cache (sim.prefix_caching is off): no blocks to move")
    return cache


class SimPrefixCache:
    def __init__(self, block_size: int, tier: HostTier | None = None, retention: Retention | None = None,
                 block_nbytes: int = 0):
        self.block_size = block_size
        self.block_nbytes = block_nbytes  # a block's bytes in the sim's KV shape (what an export would move)
        self._block_of: dict[int, int] = {}  # block key -> the physical block holding that content
        self._key_of: dict[int, int] = {}  # physical block -> the key of its content
        self._hash_of: dict[int, bytes] = {}  # block key -> its hash (the tier and retention go by hash)
        self._log: list[tuple[bool, int]] = []  # (stored?, key) since the last events()
        self.query_tokens = 0  # prompt tokens looked up at admission
        self.hit_tokens = 0  # of those, found cached (prefill skipped)
        self.by_source = {"engine": 0, "host": 0, "pulled": 0, "recomputed": 0}  # prompt tokens of new requests
        self.tier = tier
        self.retention = retention
        self._retained = (0, -1, 0.0)  # (retained blocks held, the retention's version then, when)

    def __len__(self) -> int:
        return len(self._block_of)

    def keys_of(self, tokens: list[int], hashes: list[bytes], adapter: tuple[str, str] = ("", "")) -> list[bytes]:
        """``hashes`` (the chain hashes of ``tokens``' first full blocks, as far as known) extended to every
        full block of ``tokens``."""
        full = len(tokens) // self.block_size
        if len(hashes) < full:
            hashes.extend(prefix.block_hashes(tokens[len(hashes) * self.block_size:full * self.block_size],
                                              self.block_size, parent=hashes[-1] if hashes else None,
                                              extra_keys=prefix.adapter_keys(*adapter)))  # a LoRA's: its own blocks
        return hashes

    def hits(self, hashes: list[bytes], tokens: int) -> int:
        """Tokens of a request about to be prefilled (``tokens`` of them, ``hashes`` its full blocks') whose
        KV is cached: whole leading blocks, and never its last token (vLLM recomputes that one to sample)."""
        return sum(self.lookup(hashes, tokens))

    def lookup(self, hashes: list[bytes], tokens: int) -> tuple[int, int]:
        """Of those tokens, (in the cache, in the tier past the cache's hit): whole leading blocks, never the
        last token."""
        n = 0
        for h in hashes:
            if prefix.key(h) not in self._block_of:
                break
            n += 1
        host = self.tier.leading(hashes[n:]) if self.tier is not None else 0
        engine = min(n * self.block_size, tokens - 1)
        return engine, min((n + host) * self.block_size, tokens - 1) - engine

    def retained(self, block: int) -> bool:
        """Whether a free block's content is retained for a session."""
        k = self._key_of.get(block)
        return k is not None and self.retention is not None and self._hash_of.get(k) in self.retention

    def load_fields(self) -> dict:
        """The tier's and retention's fields of the engine's load (wire.InstanceLoad)."""
        tier = self.tier
        out = {"retained_blocks": self.retained_held()} if self.retention is not None else {}
        if tier is not None:
            out.update(tier_blocks=len(tier), tier_capacity=tier.capacity, restore_ms_per_block=tier.restore_ms_per_block)
        return out

    def export(self, hashes: list[bytes]) -> tuple[int, torch.Tensor]:
        """The leading blocks of ``hashes`` held here or in the tier: the sim's KV values are functions of the
        request, so the payload is zeros of the blocks' size (what a pull would move)."""
        n = sum(self.lookup(hashes, (len(hashes) + 1) * self.block_size)) // self.block_size
        return n, torch.zeros(n * self.block_nbytes, dtype=torch.uint8)

    def import_keys(self, hashes: list[bytes]) -> int:
        """Blocks of another instance into the tier (their keys: see ``export``); how many were new there."""
        if self.tier is None:
            raise EngineError("this instance has no host KV tier (kv_tier.host_mb = 0): nothing to import into")
        return sum(1 for h in hashes if self.tier.put(h, imported=True) is not None)

    def retained_held(self) -> int:
        """Retained blocks held in the cache or the tier (tier.py ``retained_held``)."""
        if self.retention is None:
            return 0
        tier = self.tier
        self._retained = retained_held(self.retention, lambda h: prefix.key(h) in self._block_of
                                       or (tier is not None and h in tier), self._retained)
        return self._retained[0]

    def leading(self, block_keys: list[int]) -> int:
        """How many of these block keys, from the first, the cache holds (what an oracle dispatcher reads)."""
        n = 0
        for k in block_keys:
            if k not in self._block_of:
                break
            n += 1
        return n

    def count(self, tokens: int, hit: int, host: int = 0) -> None:
        """A request was admitted: ``tokens`` looked up, ``hit`` of them found (once per admission, however
        often the queue's head was looked at before it fitted), ``host`` of those in the tier."""
        self.query_tokens += tokens
        self.hit_tokens += hit
        self.by_source["engine"] += hit - host
        self.by_source["host"] += host
        self.by_source["recomputed"] += tokens - hit

    def filled(self, blocks: list[int], hashes: list[bytes]) -> None:
        """The request's blocks now hold the content of its full blocks (``hashes``, in table order)."""
        for block, h in zip(blocks, hashes):
            k = prefix.key(h)
            old = self._key_of.get(block)
            if old == k:
                continue
            if old is not None:
                self._forget(block, old)
            if k not in self._block_of:
                self._log.append((True, k))
            self._block_of[k] = block
            self._key_of[block] = k
            self._hash_of[k] = h

    def taken(self, block: int) -> None:
        """A free block is taken for new content: what it held is gone."""
        k = self._key_of.get(block)
        if k is not None:
            self._forget(block, k)

    def _forget(self, block: int, k: int) -> None:
        del self._key_of[block]
        if self._block_of.get(k) == block:
            del self._block_of[k]
            self._log.append((False, k))
            h = self._hash_of.pop(k)
            if self.tier is not None:
                self.tier.put(h)  # its content goes to the host tier (keys only)

    def clear(self) -> None:
        self._log.extend((False, k) for k in self._block_of)
        self._block_of.clear()
        self._key_of.clear()
        self._hash_of.clear()
        if self.tier is not None:
            self.tier.clear()

    def events(self) -> list[tuple]:
        """(stored?, key) of every change since the last call, in order; then (stored?, key, HOST) of the tier's."""
        out, self._log = self._log, []
        return out + self.tier.events() if self.tier is not None else out

    def snapshot(self) -> list[int]:
        """Every key held now."""
        return list(self._block_of)

    # ---------------------------------------------------------------- what the sim engine's requests do

    def uncached(self, req, tokens: int) -> int:
        """Of the ``tokens`` a waiting request (sim_requests.SimRequest) would prefill, those not cached."""
        return tokens - sum(self.cached(req, tokens))

    def cached(self, req, tokens: int) -> tuple[int, int]:
        """Of those tokens, (in the cache, in the tier past the cache's hit)."""
        if req.tokens is None:
            return 0, 0
        return self.lookup(self.keys_of(req.tokens, req.hashes, req.adapter), tokens)

    def restore(self, req, engine_tokens: int, host_tokens: int, ms_per_block: float) -> float:
        """An admitted request's ``host_tokens``, past its ``engine_tokens`` hit, come from the tier, at
        ``ms_per_block`` each: the tier's copies become the most recently used; returns the seconds it adds."""
        n = -(-host_tokens // self.block_size)
        if not n or self.tier is None:
            return 0.0
        first = engine_tokens // self.block_size
        for h in req.hashes[first:first + n]:
            self.tier.row(h)
        pulled = min(self.tier.take_imported(req.hashes[first:first + n]) * self.block_size, host_tokens)
        if pulled and not req.preempted:  # (counted as host tokens at admission: they came from another instance)
            self.by_source["host"] -= pulled
            self.by_source["pulled"] += pulled
        seconds = n * ms_per_block / 1000.0
        self.tier.restored(n, seconds)
        return seconds

    def turn_ended(self, req) -> None:
        """A request of a session finished: its blocks are retained (daemons/engine/tier.py)."""
        if self.retention is not None and req.session and req.tokens is not None:
            self.retention.turn_ended(req.session, self.keys_of(req.tokens, req.hashes, req.adapter), req.retain_s)

    def prefilled(self, req) -> None:
        """An admitted request took its blocks: what they held is gone, its full blocks' content is there now
        (computed, or hit, in this step)."""
        for block in req.blocks:
            self.taken(block)
        if req.tokens is not None:
            self.filled(req.blocks, req.hashes)

    def keep_content(self, req) -> None:
        """A request lets its blocks go: what it computed stays in them, free, until they are taken (the free
        list is least recently freed first: vLLM's LRU eviction)."""
        if req.tokens is not None and req.blocks:
            computed = min(len(req.tokens), req.prompt_len + req.generated, len(req.blocks) * self.block_size)
            self.filled(req.blocks, self.keys_of(req.tokens[:computed], req.hashes, req.adapter))
