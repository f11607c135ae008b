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
"""

from __future__ import annotations

from daemons import prefix


class SimPrefixCache:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self._block_of: dict[int, int] = {}  # block key -> the physical block holding that content
        self._key_of: dict[int, int] = {}  # physical block -> the key of its content
        self._log: list[tuple[bool, int]] = []  # (stored?, key) since the last events()
        self.query_tokens = 0  # prompt tokens looked up at admission
        self.hit_tokens = 0  # of those, found cached (prefill skipped)

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
        n = 0
        for h in hashes:
            if prefix.key(h) not in self._block_of:
                break
            n += 1
        return min(n * self.block_size, tokens - 1)

    def leading(self, block_keys: list[int]) -> int:
        """How many of these block keys, from the first, the cache holds (what an oracle dispatcher reads)."""
        n = 0
        for k in block_keys:
            if k not in self._block_of:
                break
            n += 1
        return n

    def count(self, tokens: int, hit: int) -> None:
        """A request was admitted: ``tokens`` looked up, ``hit`` of them found (once per admission, however
        often the queue's head was looked at before it fitted)."""
        self.query_tokens += tokens
        self.hit_tokens += hit

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

    def clear(self) -> None:
        self._log.extend((False, k) for k in self._block_of)
        self._block_of.clear()
        self._key_of.clear()

    def events(self) -> list[tuple[bool, int]]:
        """(stored?, key) of every change since the last call, in order."""
        out, self._log = self._log, []
        return out

    def snapshot(self) -> list[int]:
        """Every key held now."""
        return list(self._block_of)

    # ---------------------------------------------------------------- what the sim engine's requests do

    def uncached(self, req, tokens: int) -> int:
        """Of the ``tokens`` a waiting request (sim_requests.SimRequest) would prefill, those not cached."""
        if req.tokens is None:
            return tokens
        return tokens - self.hits(self.keys_of(req.tokens, req.hashes, req.adapter), tokens)

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
