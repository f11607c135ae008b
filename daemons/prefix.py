"""Prefix-cache block hashes and the cluster's index of which instance caches which leading blocks.

Block hashes are vLLM's (its default ``prefix_caching_hash_algo = "sha256"``): a full block's hash is
SHA-256 of the pickle of ``(parent block's hash, the block's token ids as a tuple, extra keys)``, the first
block's parent being ``NONE_HASH`` = SHA-256 of the pickled seed (``PYTHONHASHSEED`` when set, else
``"vllm-none-hash"``). Only full blocks have hashes. So the proxy computes, from the token ids it already
has, the very hashes a vLLM instance files its cached blocks under, and the sim engine uses the same scheme
(tests/unit/test_prefix_index.py checks ours against vLLM's own functions).

The index keeps, per instance, the 64-bit keys (the first 8 bytes of those hashes) of the blocks it reported
cached, and per key the instances holding it. ``match`` walks a request's keys in order and says, for every
instance, how many leading blocks it holds: a chain hash names the whole prefix up to its block, so a
block counts only when every block before it counted. A false hit of a 64-bit key (about 1 in 2^64 per
pair) can only misplace a request, never change its output: the engine checks its own cache.

Memory: one dict entry per distinct cached block key plus one set entry per (key, instance): about
200 bytes per block cached on one instance, ~100 more for each further instance that caches it too.
``max_blocks_per_instance`` bounds an instance's share (its reports beyond that are ignored; an honest
instance reports at most its number of KV blocks).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Iterable, Sequence

DEFAULT_SEED = "vllm-none-hash"


def _sha256(value) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash(seed: str | None = None) -> bytes:
    """The parent hash of a prompt's first block (vLLM's NONE_HASH with the sha256 algorithm)."""
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED", DEFAULT_SEED)
    return _sha256(seed)


def block_hashes(token_ids: Sequence[int], block_size: int, parent: bytes | None = None,
                 extra_keys: tuple | None = None, limit: int | None = None) -> list[bytes]:
    """The hashes of the full blocks of ``token_ids`` (at most ``limit`` of them), each chained on the one
    before; ``parent``: the hash of the block before the first (default: NONE_HASH)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    parent = none_hash() if parent is None else parent
    n = len(token_ids) // block_size
    if limit is not None:
        n = min(n, limit)
    out = []
    for b in range(n):
        parent = _sha256((parent, tuple(token_ids[b * block_size:(b + 1) * block_size]), extra_keys))
        out.append(parent)
    return out


def key(block_hash: bytes) -> int:
    """The index's key of a block hash: its first 8 bytes."""
    return int.from_bytes(block_hash[:8], "little")


def keys(hashes: Iterable[bytes]) -> list[int]:
    return [int.from_bytes(h[:8], "little") for h in hashes]


class PrefixIndex:
    """Which instance holds which cached blocks, from the instances' own reports (stored, removed, cleared,
    or a whole snapshot); ``match`` gives each instance's cached leading blocks of a request."""

    def __init__(self, max_blocks_per_instance: int = 1 << 22):
        self.max_blocks = max_blocks_per_instance
        self._holders: dict[int, set[str]] = {}  # block key -> instances that hold it
        self._held: dict[str, set[int]] = {}  # instance -> its block keys
        self.ignored = 0  # keys an instance reported past max_blocks_per_instance

    def __len__(self) -> int:
        """Distinct blocks known cached somewhere."""
        return len(self._holders)

    def blocks(self, instance_id: str) -> int:
        return len(self._held.get(instance_id, ()))

    def instances(self) -> list[str]:
        return sorted(self._held)

    def stored(self, instance_id: str, block_keys: Iterable[int]) -> None:
        held = self._held.setdefault(instance_id, set())
        for k in block_keys:
            if k in held:
                continue
            if len(held) >= self.max_blocks:
                self.ignored += 1
                continue
            held.add(k)
            holders = self._holders.get(k)
            if holders is None:
                self._holders[k] = {instance_id}
            else:
                holders.add(instance_id)

    def removed(self, instance_id: str, block_keys: Iterable[int]) -> None:
        held = self._held.get(instance_id)
        if not held:
            return
        for k in block_keys:
            if k in held:
                held.discard(k)
                self._drop(k, instance_id)

    def cleared(self, instance_id: str) -> None:
        """The instance's cache is empty (it restarted, reset its cache, or is gone): forget all it held."""
        held = self._held.pop(instance_id, None)
        for k in held or ():
            self._drop(k, instance_id)

    def replace(self, instance_id: str, block_keys: Iterable[int]) -> None:
        """A whole snapshot of what the instance holds (a restarted proxy or manager learning it again)."""
        self.cleared(instance_id)
        self.stored(instance_id, block_keys)

    def _drop(self, k: int, instance_id: str) -> None:
        holders = self._holders.get(k)
        if holders is not None:
            holders.discard(instance_id)
            if not holders:
                del self._holders[k]

    def match(self, block_keys: Sequence[int], among: Iterable[str] | None = None) -> dict[str, int]:
        """For each instance (of ``among``, default all known), how many of the leading ``block_keys`` it
        holds, stopping at its first miss. Work: the request's blocks times the instances still matching."""
        out = {i: 0 for i in (self._held if among is None else among)}
        alive = set(out)
        for depth, k in enumerate(block_keys):
            holders = self._holders.get(k)
            if not holders:
                break
            alive &= holders
            if not alive:
                break
            for i in alive:
                out[i] = depth + 1
        return out
