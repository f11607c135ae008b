"""Prefix-cache block hashes and the cluster's index of which instance caches which leading blocks.

Block hashes are vLLM's (its default ``prefix_caching_hash_algo = "sha256"``): a full block's hash is
SHA-256 of the pickle of ``(parent block's hash, the block's token ids as a tuple, extra keys)``, the first
block's parent being ``NONE_HASH`` = SHA-256 of the pickled seed (``PYTHONHASHSEED`` when set, else
``"vllm-none-hash"``). Only full blocks have hashes. So the proxy computes, from the token ids it already
has, the very hashes a vLLM instance files its cached blocks under, and the sim engine uses the same scheme
(tests/unit/test_prefix_index.py checks ours against vLLM's own functions).

The index keeps, per instance, the 64-bit keys (the last 8 bytes of those hashes, as vLLM's int KV events
give them) of the blocks it reported cached, and per key the instances holding it. ``match`` walks a request's keys in order and says, for every
instance, how many leading blocks it holds: a chain hash names the whole prefix up to its block, so a
block counts only when every block before it counted. A false hit of a 64-bit key (about 1 in 2^64 per
pair) can only misplace a request, never change its output: the engine checks its own cache.

An instance with a host-memory KV tier reports that tier's blocks too (``HOST``): a follower keeps them in a
second index, and ``match_tiers`` says per instance how many leading blocks its engine holds and how many
more its engine or its tier together hold (a restore from the tier continues an engine hit).

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

from daemons import wire

DEFAULT_SEED = "vllm-none-hash"
ENGINE, HOST = 0, 1  # the tiers a block is reported in: the engine's KV cache, the instance's host-memory tier


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


def adapter_keys(adapter: str, path: str) -> tuple | None:
    """The extra keys vLLM hashes every block of a LoRA request with (its ``_gen_lora_extra_hash_keys``: the
    adapter's name and path), so that one adapter's cached blocks are never another's or the base model's."""
    return (("lora", adapter, path),) if adapter else None


def key(block_hash: bytes | int) -> int:
    """The index's key of a block hash: its last 8 bytes, big-endian, which is what vLLM's KV events carry
    as an int (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, its default); an int is taken as such a key."""
    if isinstance(block_hash, int):
        return block_hash
    return int.from_bytes(block_hash[-8:], "big")


def keys(hashes: Iterable[bytes]) -> list[int]:
    return [int.from_bytes(h[-8:], "big") for h in hashes]


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

    def entries(self) -> int:
        """(block, instance) pairs held: the index's size."""
        return sum(len(h) for h in self._held.values())

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


def match_tiers(engine: PrefixIndex, host: PrefixIndex, block_keys: Sequence[int],
                among: Iterable[str] | None = None) -> dict[str, tuple[int, int]]:
    """For each instance (of ``among``, default all known in either index) that holds the request's first block
    somewhere: (leading blocks its engine holds, leading blocks its engine and its host tier hold together), each
    stopping at its first miss. The second is at least the first; their difference is what a restore brings
    back from the tier instead of a prefill."""
    if among is None:
        among = set(engine._held) | set(host._held)
    eng = engine.match(block_keys, among)
    out: dict[str, tuple[int, int]] = {}
    alive = set(eng)
    for depth, k in enumerate(block_keys):
        holders = (engine._holders.get(k) or set()) | (host._holders.get(k) or set())
        alive &= holders
        if not alive:
            break
        for i in alive:
            out[i] = (eng.get(i, 0), depth + 1)
    return dict(sorted(out.items()))  # in id order: callers that break ties by order do so alike in every process


class Publisher:
    """An instance's side: the changes its engine's prefix cache reports (``add``), netted per key, go out as
    numbered batches (``take``); ``full`` answers a receiver that asks for everything."""

    def __init__(self, instance_id: str, epoch: int | None = None):
        self.instance_id = instance_id
        self.epoch = epoch if epoch is not None else int.from_bytes(os.urandom(8), "little") >> 1 | 1
        self.seq = 0
        self._pending: dict[int, bool] = {}  # key -> stored (True) or removed (False), the last change wins
        self._host: dict[int, bool] = {}  # the same for the host tier

    def add(self, events: Iterable[tuple]) -> None:
        """Changes as (stored?, key) for the engine's cache, or (stored?, key, tier) with ``HOST`` for the host
        tier's."""
        pending, host = self._pending, self._host
        for ev in events:
            if len(ev) == 2 or ev[2] == ENGINE:
                pending[ev[1]] = ev[0]
            else:
                host[ev[1]] = ev[0]

    def take(self):
        """The next batch (wire.CacheEvents), or None when nothing changed."""
        if not self._pending and not self._host:
            return None
        pending, self._pending = self._pending, {}
        host, self._host = self._host, {}
        self.seq += 1
        return wire.CacheEvents(self.instance_id, self.epoch, self.seq, stored=[k for k, s in pending.items() if s],
                                removed=[k for k, s in pending.items() if not s],
                                host_stored=[k for k, s in host.items() if s],
                                host_removed=[k for k, s in host.items() if not s])

    def full(self, snapshot: list[int], host: list[int] | None = None):
        """Everything the cache (and ``host``: the host tier) holds, read after every pending change was added,
        so it includes them; they still go out in the next batch, where applying them again changes nothing."""
        return wire.CacheEvents(self.instance_id, self.epoch, self.seq, stored=snapshot, full=True,
                                host_stored=list(host or ()))


class Follower:
    """A proxy's or the manager's side: the index kept from every instance's CacheEvents. A receiver that
    misses a batch, learns of a new incarnation, or starts (a restarted proxy or manager) asks the instance
    for its whole cache (``ask(instance_id)``, at most once per ``resync_s``): the instances are the source
    of truth, and the heartbeats say which batch each has sent last."""

    def __init__(self, ask, clock, resync_s: float, max_blocks_per_instance: int = 1 << 22):
        self.index = PrefixIndex(max_blocks_per_instance)
        self.host = PrefixIndex(max_blocks_per_instance)  # the instances' host-memory tiers
        self._ask, self._clock, self.resync_s = ask, clock, resync_s
        self.state: dict[str, list[int]] = {}  # instance -> [epoch, seq of the last batch applied; -1: unsynced]
        self._asked: dict[str, float] = {}
        self.syncs = 0  # whole caches asked for
        self.gaps = 0  # batches that did not follow the one before

    def on_events(self, msg) -> None:
        iid = msg.instance_id
        st = self.state.get(iid)
        if msg.full:
            self.index.replace(iid, msg.stored)
            self.host.replace(iid, msg.host_stored)
            self.state[iid] = [msg.epoch, msg.seq]
            return
        if st is not None and st[0] == msg.epoch and st[1] >= 0 and msg.seq <= st[1]:
            return  # already in what we have (a batch sent before the whole cache we took)
        in_order = st is not None and st[0] == msg.epoch and st[1] >= 0 and msg.seq == st[1] + 1
        if st is None or st[0] != msg.epoch:
            self.index.cleared(iid)  # a new incarnation: what the old one held is gone
            self.host.cleared(iid)
        self.index.removed(iid, msg.removed)
        self.index.stored(iid, msg.stored)
        if msg.host_removed or msg.host_stored:
            self.host.removed(iid, msg.host_removed)
            self.host.stored(iid, msg.host_stored)
        if in_order:
            st[1] = msg.seq
        else:
            self.gaps += 1
            self.state[iid] = [msg.epoch, -1]
            self._request(iid)

    def on_beat(self, instance_id: str, epoch: int, seq: int) -> None:
        """A heartbeat or load report: the last batch the instance sent (epoch 0: it keeps no prefix cache)."""
        st = self.state.get(instance_id)
        if not epoch:
            if st is not None:
                self.forget(instance_id)
            return
        if st is None or st[0] != epoch or st[1] < seq:
            self._request(instance_id)

    def forget(self, instance_id: str) -> None:
        self.index.cleared(instance_id)
        self.host.cleared(instance_id)
        self.state.pop(instance_id, None)
        self._asked.pop(instance_id, None)

    def match_tiers(self, block_keys: Sequence[int], among: Iterable[str] | None = None) -> dict[str, tuple[int, int]]:
        """Per instance holding the request's first block: (engine's leading blocks, engine's and host tier's
        together); see ``match_tiers``."""
        return match_tiers(self.index, self.host, block_keys, among)

    def _request(self, instance_id: str) -> None:
        now = self._clock()
        if now - self._asked.get(instance_id, -1e18) < self.resync_s:
            return
        self._asked[instance_id] = now
        self.syncs += 1
        self._ask(instance_id)
