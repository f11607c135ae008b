"""vLLM's internals (daemons/engine/vllm_internals.py), continued: the host tier and session retention on vLLM's
block pool (daemons/engine/tier.py says what they are). Checked against the same vLLM version
(``vllm_internals.TESTED_VERSION``).

vLLM's own KV offloading does not run on its CPU platform (0.32): the ``OffloadingConnector``'s CPU spec refuses
to build its worker off CUDA and XPU (``vllm/v1/kv_offload/cpu/spec.py`` ``get_worker``: "CPU Offloading is
currently only supported on CUDA-alike and XPU GPUs"), and the ``SimpleCPUOffloadConnector``'s worker asks for
CUDA stream priorities when it registers the KV caches (``vllm/v1/simple_kv_offload/worker.py``:
``torch.cuda.Stream.priority_range``, absent from a CPU build of torch) and pins its buffers with
``cudaHostRegister``. So the tier is ours: block copies with the migration's ``KvBlocks``.

The one hook: ``BlockPool.get_new_blocks`` (the pool's only path that reuses a free block's memory; a cached free
block loses its prefix-cache entry there, ``_maybe_evict_cached_block``) is wrapped on the pool object. Before
vLLM takes ``n`` blocks from the head of its free queue (least recently freed first), the wrapper moves retained
blocks found among them to the tail (evicted after every other free block; if only retained ones are left, the
oldest go), then copies the cached blocks about to be taken into the tier (their bytes are intact: the step
that will write them has not run). No vLLM file is patched.

A restore (``restore``, when a request is added, between steps): the prompt's leading blocks past what the
prefix cache holds that the tier holds get free blocks (``get_new_blocks``, with the engine's hits pinned by
``touch`` meanwhile), their bytes, and prefix-cache entries under their hashes (``cache_full_blocks``, which
also queues vLLM's ``BlockStored`` events), then go back to the free queue (``free_blocks``) as cached blocks.
The scheduler then finds them as it finds any hit (``get_computed_blocks``).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from daemons.config import KvTierConfig
from daemons.engine.base import EngineError
from daemons.engine.tier import HostTier, Retention, retained_held, tier_blocks
from daemons.engine.vllm_internals_state import VllmState
from daemons.kv.layout import KvBlocks


def build_tiers(state: VllmState, kv: Callable[[], KvBlocks], cache, cfg: KvTierConfig | None,
                clock: Callable[[], float] = time.monotonic) -> VllmTier:
    """The tier (``kv_tier.host_mb``, in blocks of the engine's KV layout) and retention (``kv_tier.retain_s``) of
    an engine with prefix caching and its KV in this process; ``cfg`` None: neither."""
    cfg = cfg or KvTierConfig(host_mb=0, retain_s=0.0)
    total, nbytes = state.blocks_total(), kv().block_nbytes
    capacity = tier_blocks(cfg.host_mb, nbytes, total)
    limit = int(cfg.retain_share * (total + capacity))
    retention = Retention(cfg.retain_s, cfg.max_retain_s, limit, clock) if cfg.retain_s > 0 and limit else None
    tier = HostTier(capacity, nbytes, retention) if capacity else None
    return VllmTier(state, kv, cache, tier, retention)


def need_tiers(tiers: VllmTier | None) -> VllmTier:
    if tiers is None:
        raise EngineError("this instance keeps no prefix cache in this process (vllm.enable_prefix_caching is off, "
                          "or its KV is on tensor-parallel ranks): no blocks to move")
    return tiers


class VllmTier:
    """The tier and retention on one vLLM engine's pool. ``tier`` None: retention only (kv_tier.host_mb = 0);
    ``retention`` None: no retention (kv_tier.retain_s = 0)."""

    def __init__(self, state: VllmState, kv: Callable[[], KvBlocks], cache, tier: HostTier | None,
                 retention: Retention | None):
        """``cache``: the engine's prefix cache (vllm_cache.py), told where each new prompt's KV comes from."""
        from vllm.v1.core.kv_cache_utils import get_block_hash

        self._s = state
        self._kv_of = kv  # the engine's KvBlocks (built on first use)
        self._cache = cache
        self.tier = tier
        self.retention = retention
        self._hash_of = get_block_hash
        pool = state.pool
        self._pool = pool
        self._bs = state.block_size
        self._take = pool.get_new_blocks
        pool.get_new_blocks = self._get_new_blocks  # the hook (see the module docstring)
        self._retained = (0, -1, 0.0)  # (retained blocks held, the retention's version then, when)

    # ---------------------------------------------------------------- the hook

    def _get_new_blocks(self, num_blocks: int):
        if num_blocks > 0:
            if self.retention is not None and self.retention.expire() >= 0 and len(self.retention):
                self._defer_retained(num_blocks)
            if self.tier is not None:
                self._offload(num_blocks)
        return self._take(num_blocks)

    def _free_from_head(self):
        q = self._pool.free_block_queue
        b, tail = q.fake_free_list_head.next_free_block, q.fake_free_list_tail
        while b is not None and b is not tail:
            nxt = b.next_free_block
            yield b
            b = nxt

    def _key(self, block) -> bytes | None:
        return self._hash_of(block.block_hash) if block.block_hash is not None else None

    def _defer_retained(self, n: int) -> None:
        """Move the retained blocks among the next ``n`` others at the head of the free queue to its tail."""
        q, retention = self._pool.free_block_queue, self.retention
        plain, moved = 0, []
        for b in self._free_from_head():
            if plain >= n:
                break
            h = self._key(b)
            if h is not None and h in retention:
                moved.append(b)
            else:
                plain += 1
        for b in moved:
            q.remove(b)
            q.append(b)

    def _offload(self, n: int) -> None:
        """Copy the cached blocks among the next ``n`` of the free queue into the tier."""
        ids, rows = [], []
        for i, b in enumerate(self._free_from_head()):
            if i >= n:
                break
            h = self._key(b)
            if h is None:
                continue
            r = self.tier.put(h)
            if r is not None:
                ids.append(b.block_id)
                rows.append(r)
        if ids:
            self._to_rows(ids, rows)

    # ---------------------------------------------------------------- copies (tier rows: block-major)

    def _to_rows(self, block_ids: list[int], rows: list[int]) -> None:
        kv = self._kv_of()
        if kv.path != "rows" or kv.device.type != "cpu":
            self.tier.rows[torch.tensor(rows, dtype=torch.int64)] = self._gather(block_ids)
            return
        # Each layer's page of each block straight into its place in the row: one copy, and a plain one (an indexed
        # copy of strided pages, or a staging buffer and a transpose, took 3 to 7 times as long: 2 MiB blocks, 32 layers).
        words, per = self.tier.rows.view(kv.rows[0].dtype), kv.rows[0].shape[1]
        for b, r in zip(block_ids, rows):
            row = words[r]
            for layer, kv_rows in enumerate(kv.rows):
                row[layer * per:(layer + 1) * per].copy_(kv_rows[b])

    def _gather(self, block_ids: list[int]) -> torch.Tensor:
        """The engine's blocks ``block_ids`` as ``[n, block_nbytes]``, block-major (tier.py's payload layout)."""
        kv, n = self._kv_of(), len(block_ids)
        buf = torch.empty(n * kv.block_nbytes, dtype=torch.uint8, device=kv.device)  # (then to the host, if need be)
        kv.gather(block_ids, buf)
        if kv.path == "fused":  # already block-major
            return buf.view(n, kv.block_nbytes).cpu()
        return buf.view(len(kv.caches), n, kv.layer_block_nbytes).transpose(0, 1).reshape(n, kv.block_nbytes).cpu()

    def _from_rows(self, block_ids: list[int], rows: list[int]) -> None:
        """The tier's ``rows`` into the engine's blocks ``block_ids``."""
        kv = self._kv_of()
        if kv.path != "rows" or kv.device.type != "cpu":
            self._scatter(block_ids, self.tier.rows[torch.tensor(rows, dtype=torch.int64)])
            return
        words, per = self.tier.rows.view(kv.rows[0].dtype), kv.rows[0].shape[1]  # (as _to_rows)
        for b, r in zip(block_ids, rows):
            row = words[r]
            for layer, kv_rows in enumerate(kv.rows):
                kv_rows[b].copy_(row[layer * per:(layer + 1) * per])

    def _scatter(self, block_ids: list[int], rows: torch.Tensor) -> None:
        """``rows`` (``[n, block_nbytes]``, block-major) into the engine's blocks ``block_ids``."""
        kv, n = self._kv_of(), len(block_ids)
        if kv.path == "fused":
            buf = rows.reshape(-1)
        else:
            buf = rows.view(n, len(kv.caches), kv.layer_block_nbytes).transpose(0, 1).contiguous().view(-1)
        kv.scatter(block_ids, buf.to(kv.device))

    # ---------------------------------------------------------------- restore

    def engine_leading(self, hashes: list) -> list:
        """The pool's cached blocks of ``hashes``' leading run."""
        held = []
        for h in hashes:
            found = self._pool.get_cached_block(h, [0])
            if found is None:
                break
            held.append(found[0])
        return held

    def restore(self, req) -> tuple[int, int]:
        """(When ``req`` is added) Restore the leading blocks of its prompt past the prefix cache's hit that the
        tier holds, and count where its prompt's KV comes from. Returns (blocks the engine held, blocks restored)."""
        engine, host = self._restore(req)
        pulled = self.tier.take_imported(req.block_hashes[engine:engine + host]) if host else 0
        self._cache.counted(req.num_tokens, engine * self._bs, (host - pulled) * self._bs, pulled * self._bs)
        return engine, host

    def _restore(self, req) -> tuple[int, int]:
        hashes = req.block_hashes[:(req.num_tokens - 1) // self._bs]  # vLLM recomputes the last token
        held = self.engine_leading(hashes)
        i = len(held)
        tier = self.tier
        if tier is None or i == len(hashes):
            return i, 0
        pinned_free = sum(1 for b in held if b.ref_cnt == 0)
        k = min(tier.leading(hashes[i:]), self._pool.get_num_free_blocks() - pinned_free)
        if k <= 0:
            return i, 0
        start = time.perf_counter()
        self._pool.touch(held)  # the allocation below must not take them
        new = self._pool.get_new_blocks(k)
        rows = []
        for h in hashes[i:i + k]:  # the evictions that allocation made may have pushed some out of the tier
            r = tier.row(h)
            if r is None:
                break
            rows.append(r)
        use = new[:len(rows)]
        if use:
            self._from_rows([b.block_id for b in use], rows)
            self._pool.cache_full_blocks(req, held + use, i, i + len(use), self._bs, 0)
        self._pool.free_blocks(list(reversed(held + new)))  # the prompt's tail first out, as vLLM frees
        tier.restored(len(use), time.perf_counter() - start)
        return i, len(use)

    # ---------------------------------------------------------------- export / import (prefix pulls)

    def export_blocks(self, hashes: list[bytes]) -> tuple[int, torch.Tensor]:
        """The leading blocks of ``hashes`` this engine or its tier holds, as ``(n, payload)`` (tier.py)."""
        kv = self._kv_of()
        where: list[tuple[int, int]] = []  # (engine block id, -1) or (-1, tier row)
        for h in hashes:
            found = self._pool.get_cached_block(h, [0])
            if found is not None:
                where.append((found[0].block_id, -1))
                continue
            r = self.tier.row(h) if self.tier is not None else None
            if r is None:
                break
            where.append((-1, r))
        n = len(where)
        payload = torch.empty(n * kv.block_nbytes, dtype=torch.uint8)
        view = payload.view(n, kv.block_nbytes)
        from_engine = [(i, b) for i, (b, _) in enumerate(where) if b >= 0]
        if from_engine:
            view[torch.tensor([i for i, _ in from_engine])] = self._gather([b for _, b in from_engine])
        from_tier = [(i, r) for i, (_, r) in enumerate(where) if r >= 0]
        if from_tier:
            view[torch.tensor([i for i, _ in from_tier])] = self.tier.rows[torch.tensor([r for _, r in from_tier])]
        return n, payload

    def import_blocks(self, hashes: list[bytes], payload: torch.Tensor) -> int:
        """Store ``payload``'s blocks (``export_blocks``' layout, ``len(hashes)`` of them) in the tier; returns
        how many were new there."""
        if self.tier is None:
            raise EngineError("this instance has no host KV tier (kv_tier.host_mb = 0): nothing to import into")
        nbytes = self.tier.block_nbytes
        if payload.dtype != torch.uint8 or payload.numel() < len(hashes) * nbytes:
            raise EngineError(f"payload holds {payload.numel()} bytes; {len(hashes)} blocks need {len(hashes) * nbytes}")
        view = payload[:len(hashes) * nbytes].view(len(hashes), nbytes)
        stored = 0
        for i, h in enumerate(hashes):
            r = self.tier.put(h, imported=True)
            if r is not None:
                self.tier.rows[r] = view[i]
                stored += 1
        return stored

    # ---------------------------------------------------------------- retention

    def turn_ended(self, session: str, req, asked_s: float) -> None:
        if self.retention is not None and session:
            self.retention.turn_ended(session, list(req.block_hashes), asked_s)

    def load_fields(self) -> dict:
        """The tier's and retention's fields of the engine's load (wire.InstanceLoad)."""
        tier = self.tier
        out = {"retained_blocks": self.retained_blocks()} if self.retention is not None else {}
        if tier is not None:
            out.update(tier_blocks=len(tier), tier_capacity=tier.capacity, restore_ms_per_block=tier.restore_ms_per_block)
        return out

    def retained_blocks(self) -> int:
        """Retained blocks held in the engine's cache or the tier (tier.py ``retained_held``)."""
        if self.retention is None:
            return 0
        tier, pool = self.tier, self._pool
        self._retained = retained_held(self.retention, lambda h: (tier is not None and h in tier)
                                       or pool.get_cached_block(h, [0]) is not None, self._retained)
        return self._retained[0]
