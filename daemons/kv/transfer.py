"""KV bytes between instances: Gloo (torch.distributed) pair groups, formed on demand.

There is no world: every (source, destination) pair gets its own two-member ``ProcessGroupGloo`` the first
time it migrates, named by a random key the source picks. Its rendezvous (each end's Gloo address) travels
over the authenticated ZeroMQ channel between the two instances (``RelayStore``: a store of two, each end
holding a copy, whose writes go to the other end as ``wire.KvRendezvous``), so there is no rendezvous port
for a host without a cluster key to read or write. A tensor-parallel engine's ranks, which are processes
of their own, still meet at the source's ``TCPStore`` (``serve_store``; it listens on every interface).
Gloo's own connections use ``migration.kv_host``; Gloo itself neither authenticates nor encrypts (see
"Several hosts" in docs/operations.md for the firewall rule this needs). New instances join at any time
and a dead peer breaks only its own pairs. Each pair runs its Gloo work on its
own thread, so the engine keeps stepping and one slow peer does not hold up another.

A stage's blocks travel in chunks of ``chunk_blocks`` fused blocks (all layers of n blocks in one buffer).
Two staging buffers per pair make it a pipeline: the sender gathers chunk i+1 while chunk i is on the wire,
the receiver scatters chunk i while chunk i+1 arrives. Both ends post their operations in the order the
control messages (ZeroMQ, in order on one connection) put them in, so no tags are needed.

A transfer with ``tail_tokens`` sends its last block as only that many token slots (the written part of a
request's partial last block), as one message after the full blocks' chunks.

A chunk whose blocks are one run of consecutive ids in a CPU KV tensor (fused and rows paths) needs no
staging at that end: Gloo sends from, or receives into, the KV tensor itself (``KvBlocks.direct``), framed
as the staged chunk is (one message per layer on the rows path), so either end decides for itself.

A transfer with ``one_message`` stages every chunk and sends it as one message, whatever the path: on the
rows path a chunk otherwise travels as one message per layer, and each message costs Gloo a round of its
own, which for the few blocks of a last stage costs more than the staging copy (32 layers: 6 ms against
2 ms for one 2 MiB block on 2 loaded cores). Both ends pass the same flag (the last stage's).

A send may be paced two ways: a hard cap in bytes per second, and a duty (daemons/pacing.py), the share of
time the copy may run, which the migration lowers while the engine's steps slow down. A send with a duty
below 1 runs one chunk at a time (gather, send, wait), then rests.

A pair's thread runs off the engine's cores where the process has more than one (``transfer_cores``).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from daemons.kv.layout import KvBlocks, Staging
from daemons.migration.transport import TransferError
from daemons.pacing import rest_s

__all__ = ["DEST_RANK", "SOURCE_RANK", "KvTransfer", "Pair", "RelayStore", "TransferError", "transfer_cores"]

log = logging.getLogger("llumnix.kvtransfer")

SOURCE_RANK, DEST_RANK = 0, 1
# Taken at import, before an engine may replace it (vLLM's CPU worker makes torch.set_num_threads a no-op).
_set_num_threads = torch.set_num_threads


_pinned: set[int] = set()  # native ids of the pair threads pinned so far (not the engine's)


def transfer_cores(allowed: set[int], bound: list[set[int]]) -> set[int] | None:
    """The cores a pair thread runs on, given the process's ``allowed`` cores and the affinities of its
    other threads (``bound``): a thread pinned to fewer cores than allowed is the engine's (vLLM's CPU
    worker binds its OpenMP threads, vllm.cpu_bind), and the copy takes the other cores. None (leave the
    thread where the kernel puts it): one core, an engine bound nowhere (nobind, the default: the kernel
    balances both threads over the cores better than a fixed core would; on 2 cores shared by two
    instances no choice keeps a copy off every engine), or an engine bound to every core."""
    if len(allowed) < 2:
        return None
    engine = set().union(*[b for b in bound if b < allowed])
    if not engine:
        return None
    return (allowed - engine) or None


def _pin_off_engine() -> None:
    tid = threading.get_native_id()
    try:
        allowed = os.sched_getaffinity(0)
        bound = []
        for name in os.listdir("/proc/self/task"):
            if name.isdigit() and int(name) != tid and int(name) not in _pinned:
                try:
                    bound.append(os.sched_getaffinity(int(name)))
                except OSError:  # the thread ended meanwhile
                    pass
        cores = transfer_cores(allowed.union(*bound), bound)
        if cores is not None:
            os.sched_setaffinity(tid, cores)
            _pinned.add(tid)
    except (OSError, AttributeError) as exc:  # no /proc, or no sched_*affinity (not Linux)
        log.debug("KV transfer thread left unpinned: %s", exc)


def _init_thread() -> None:
    """Copies are memory-bound: one thread moves them as fast, and leaves the other cores to the engine."""
    _set_num_threads(1)
    _pin_off_engine()


RELAY_MAX_VALUE = 4096  # bytes: a Gloo address is ~200
RELAY_MAX_KEYS = 8  # per pair: Gloo writes one key per rank


class RelayStore(dist.Store):
    """The rendezvous store of one pair, held at both ends: ``set`` keeps the value and hands it to ``send``
    (which puts it on the ZeroMQ channel to the peer), ``deliver`` keeps what the peer sent; ``get`` and
    ``wait`` block (on the pair's thread) until the key is here. Only keys under the pair's key are taken."""

    def __init__(self, prefix: str, timeout_s: float):
        super().__init__()
        self.prefix = prefix + "/"
        self.timeout_s = timeout_s
        self._values: dict[str, bytes] = {}
        self._cv = threading.Condition()
        self._send: Callable[[str, bytes], None] | None = None
        self._outbox: list[tuple[str, bytes]] = []  # set before ``attach``

    def attach(self, send: Callable[[str, bytes], None]) -> None:
        """From now on writes go to the peer through ``send`` (thread-safe; called on the pair's thread)."""
        with self._cv:
            self._send, out, self._outbox = send, self._outbox, []
        for key, value in out:
            send(key, value)

    def deliver(self, key: str, value: bytes) -> bool:
        """A value the peer wrote; False (dropped) for a key outside this pair or one too large."""
        if not key.startswith(self.prefix) or len(value) > RELAY_MAX_VALUE:
            return False
        with self._cv:
            if key not in self._values and len(self._values) >= RELAY_MAX_KEYS:
                return False
            self._values[key] = bytes(value)
            self._cv.notify_all()
        return True

    def set(self, key, value) -> None:  # noqa: A003 - dist.Store's name
        value = value.encode() if isinstance(value, str) else bytes(value)
        with self._cv:
            self._values[key] = value
            self._cv.notify_all()
            send = self._send
            if send is None:
                self._outbox.append((key, value))
        if send is not None:
            send(key, value)

    def _wait(self, keys, timeout) -> None:
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else self.timeout_s
        with self._cv:
            if not self._cv.wait_for(lambda: all(k in self._values for k in keys), seconds if seconds > 0 else self.timeout_s):
                missing = [k for k in keys if k not in self._values]
                raise RuntimeError(f"KV pair rendezvous: the peer's {missing} did not come in time")

    def get(self, key) -> bytes:
        self._wait([key], None)
        with self._cv:
            return self._values[key]

    def wait(self, keys, timeout=None) -> None:
        self._wait(list(keys), timeout)

    def check(self, keys) -> bool:
        with self._cv:
            return all(k in self._values for k in keys)

    def add(self, key, value) -> int:
        raise RuntimeError("KV pair rendezvous: add is not relayed")  # Gloo's pairs use set, wait and get


class Pair:
    """One Gloo group with one peer: a worker thread and a double buffer."""

    def __init__(self, key: str, host: str, rank: int, store, timeout_s: float):
        """``store`` is a Store, or a function that makes one (connecting may take up to the timeout, so
        it happens on the pair's thread, never on the caller's event loop)."""
        self.key = key
        self.peer_address = ""  # a source pair's destination (its request address) when it was made
        self.relay = store if isinstance(store, RelayStore) else None  # its writes go to the peer once attached
        self.rank = rank
        self.peer = 1 - rank
        self.timeout = timedelta(seconds=timeout_s)
        self.broken = False
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"kv-{key[-8:]}", initializer=_init_thread)
        self._buffers: Staging | None = None
        self.two_hop: bool | None = None  # None: stage through the device when the KV is not on the CPU
        self._pg: dist.ProcessGroup | None = None
        self._pool.submit(self._connect, host, store)

    def _connect(self, host: str, store) -> None:
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        opts._timeout = self.timeout
        began = time.perf_counter()
        try:
            if callable(store):
                store = store()
            self._pg = dist.ProcessGroupGloo(dist.PrefixStore(self.key, store), self.rank, 2, opts)
            log.debug("KV pair %s formed in %.1f ms", self.key, (time.perf_counter() - began) * 1e3)
        except (RuntimeError, ValueError) as exc:  # the peer never came, or its address does not route
            self.broken = True
            log.warning("KV pair %s could not form: %s", self.key, exc)

    def _staging(self, kv: KvBlocks, nbytes: int) -> Staging:
        st = self._buffers
        if st is None or st.kv is not kv or st.nbytes < nbytes:
            st = self._buffers = Staging(kv, nbytes, two_hop=self.two_hop)
        return st

    def _ready(self) -> dist.ProcessGroup:
        if self.broken or self._pg is None:
            raise TransferError(f"KV pair {self.key} is not connected")
        return self._pg

    def _wait(self, work) -> None:
        work.wait(self.timeout)

    def send(self, kv: KvBlocks, block_ids: list[int], chunk_blocks: int, limit_bytes_s: float = 0.0,
             tail_tokens: int = 0, duty: Callable[[], float] | None = None, one_message: bool = False) -> Future:
        """Gather and send ``block_ids`` in chunks; the future resolves to the bytes sent. ``tail_tokens``:
        of the last block send only its first this many token slots (0: all of it). ``duty``: read before
        each chunk, the share of time the copy may run (1: as fast as it goes). ``one_message``: each chunk
        staged and sent as one message (the receiver must say the same)."""
        return self._pool.submit(self._send, kv, list(block_ids), chunk_blocks, limit_bytes_s, tail_tokens, duty,
                                 one_message)

    def recv(self, kv: KvBlocks, block_ids: list[int], chunk_blocks: int, tail_tokens: int = 0,
             one_message: bool = False) -> Future:
        """Receive into ``block_ids`` (the same count, ``tail_tokens`` and ``one_message`` the peer sends, in
        order); resolves to the bytes received."""
        return self._pool.submit(self._recv, kv, list(block_ids), chunk_blocks, tail_tokens, one_message)

    def _chunks(self, block_ids: list[int], chunk_blocks: int) -> list[list[int]]:
        return [block_ids[i:i + chunk_blocks] for i in range(0, len(block_ids), chunk_blocks)]

    def _gloo(self, fn, *args) -> int:
        """Run a transfer; Gloo reports a dead peer or a timeout as RuntimeError from any call."""
        try:
            return fn(*args)
        except RuntimeError as exc:
            self.broken = True
            # Gloo's messages start with its source location and end with advice for its own developers.
            text = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).splitlines()[0]).split(". This is typically")[0]
            raise TransferError(text[:300]) from None

    def _send(self, kv: KvBlocks, block_ids: list[int], chunk_blocks: int, limit_bytes_s: float,
              tail_tokens: int, duty: Callable[[], float] | None, one_message: bool) -> int:
        return self._gloo(self._send_chunks, kv, block_ids, chunk_blocks, limit_bytes_s, tail_tokens, duty,
                          one_message)

    def _recv(self, kv: KvBlocks, block_ids: list[int], chunk_blocks: int, tail_tokens: int,
              one_message: bool) -> int:
        return self._gloo(self._recv_chunks, kv, block_ids, chunk_blocks, tail_tokens, one_message)

    @staticmethod
    def _split(block_ids: list[int], tail_tokens: int) -> tuple[list[int], int | None]:
        """(the blocks that go whole, the partial one or None)."""
        if tail_tokens and block_ids:
            return block_ids[:-1], block_ids[-1]
        return block_ids, None

    @staticmethod
    def _frames(kv: KvBlocks, buf, n: int, one_message: bool) -> list:
        return [buf[:n * kv.block_nbytes]] if one_message else kv.frames(buf, n)

    def _pieces(self, kv: KvBlocks, st: Staging, block_ids: list[int], chunk_blocks: int, tail_tokens: int,
                one_message: bool) -> tuple[list[tuple[list[int], list | None]], int | None]:
        """How the blocks travel, alike on both ends: the chunks of whole blocks, each with its tensors when it is
        one run of blocks on the CPU (it goes straight out of or into the KV tensor; None: through staging), and
        the partial last block (None: none)."""
        whole, tail = self._split(block_ids, tail_tokens)
        return [(chunk, None if st.two_hop or one_message else kv.direct(chunk))
                for chunk in self._chunks(whole, chunk_blocks)], tail

    def _send_parts(self, kv: KvBlocks, st: Staging, block_ids: list[int], chunk_blocks: int, tail_tokens: int,
                    one_message: bool = False):
        """Per chunk, a function of its staging slot that returns the tensors to send, in order."""
        chunks, tail = self._pieces(kv, st, block_ids, chunk_blocks, tail_tokens, one_message)
        parts = [(lambda b, d=direct: d) if direct is not None else
                 (lambda b, c=chunk: (st.load(b, c), self._frames(kv, st.host(b), len(c), one_message))[1])
                 for chunk, direct in chunks]
        if tail is not None:
            parts.append(lambda b: [st.host(b)[:st.load_tail(b, tail, tail_tokens)]])
        return parts

    def _recv_parts(self, kv: KvBlocks, st: Staging, block_ids: list[int], chunk_blocks: int, tail_tokens: int,
                    one_message: bool = False):
        """Per chunk, (the tensors to receive into from staging slot b, what writes slot b out then)."""
        chunks, tail = self._pieces(kv, st, block_ids, chunk_blocks, tail_tokens, one_message)
        parts = [(lambda b, d=direct: d, lambda b: 0) if direct is not None else
                 (lambda b, c=chunk: self._frames(kv, st.host(b), len(c), one_message), lambda b, c=chunk: st.store(b, c))
                 for chunk, direct in chunks]
        if tail is not None:
            parts.append((lambda b: [st.host(b)[:kv.tail_nbytes(tail_tokens)]],
                          lambda b: st.store_tail(b, tail, tail_tokens)))
        return parts

    def _send_chunks(self, kv: KvBlocks, block_ids: list[int], chunk_blocks: int, limit_bytes_s: float,
                     tail_tokens: int, duty: Callable[[], float] | None = None, one_message: bool = False) -> int:
        pg = self._ready()
        st = self._staging(kv, chunk_blocks * kv.block_nbytes)
        parts = self._send_parts(kv, st, block_ids, chunk_blocks, tail_tokens, one_message)
        inflight: list = [[], []]  # the sends of the last two chunks, by staging slot
        start, sent = time.perf_counter(), 0
        for i, part in enumerate(parts):
            b = i % 2
            share = duty() if duty is not None else 1.0
            began = time.perf_counter()
            for work in inflight[b]:
                self._wait(work)  # that slot is free again
            frames = part(b)
            inflight[b] = [pg.send([f], self.peer, 0) for f in frames]
            sent += sum(f.numel() for f in frames)
            if share < 1.0:  # paced by duty: this chunk's whole cost, then a rest in proportion
                for work in inflight[b]:
                    self._wait(work)
                inflight[b] = []
                time.sleep(rest_s(time.perf_counter() - began, share))
            if limit_bytes_s > 0:  # pace to the cap: sleep until this many bytes are due
                ahead = sent / limit_bytes_s - (time.perf_counter() - start)
                if ahead > 0:
                    time.sleep(ahead)
        for works in inflight:
            for work in works:
                self._wait(work)
        return sent

    def _recv_chunks(self, kv: KvBlocks, block_ids: list[int], chunk_blocks: int, tail_tokens: int,
                     one_message: bool = False) -> int:
        pg = self._ready()
        st = self._staging(kv, chunk_blocks * kv.block_nbytes)
        parts = self._recv_parts(kv, st, block_ids, chunk_blocks, tail_tokens, one_message)

        def post(i: int) -> tuple[list, int]:
            frames = parts[i][0](i % 2)
            return [pg.recv([f], self.peer, 0) for f in frames], sum(f.numel() for f in frames)

        pending = [post(i) for i in range(min(2, len(parts)))]
        got = 0
        for i, (_, store) in enumerate(parts):
            works, nbytes = pending[i % 2]
            for work in works:
                self._wait(work)
            store(i % 2)
            got += nbytes
            if i + 2 < len(parts):
                pending[i % 2] = post(i + 2)
        return got

    def close(self) -> None:
        self.broken = True
        self._pool.shutdown(wait=False, cancel_futures=True)


class KvTransfer:
    """This instance's end of KV transfer (a daemons/migration/transport.py ``KvTransport``): a rendezvous
    store for the pairs it starts, and its pairs."""

    def __init__(self, host: str, port: int, timeout_s: float):
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self.store = None  # the TCPStore of a tensor-parallel engine's ranks (serve_store), else none
        self.address = ""  # its host:port ("": the pairs meet over ZeroMQ, RelayStore)
        self.pairs: dict[str, Pair] = {}
        self._lock = threading.Lock()
        self._early: dict[str, RelayStore] = {}  # the stores of pairs not made yet that their peer wrote to

    def serve_store(self) -> str:
        """Listen with a TCPStore where a tensor-parallel engine's ranks (processes of their own, which the
        ZeroMQ channel does not reach) meet their peers'; returns its host:port. TCPStore listens on every
        interface whatever ``host`` says (its libuv server takes no bound socket, and the older server that
        does stalled migrations here), and anyone who reaches it can list and write its keys: a firewall
        rule keeps its port (migration.kv_port) to the GPU nodes."""
        if self.store is None:
            self.store = dist.TCPStore(self.host, self.port, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=self.timeout_s), use_libuv=True)
            self.address = f"{self.host}:{self.store.port}"
        return self.address

    def relayed(self, pair_key: str, key: str, value: bytes) -> None:
        """A rendezvous value from the peer of pair ``pair_key`` (wire.KvRendezvous). One for a pair not
        made yet (the source's first write can arrive before the stage that names the pair) is kept for it,
        a few pairs at most."""
        with self._lock:
            pair = self.pairs.get(pair_key) or next(
                (p for p in self.pairs.values() if p.key == pair_key), None)
            store = pair.relay if pair is not None else self._early.get(pair_key)
            if pair is None and store is None:  # the store the pair will take (dest_pair)
                if len(self._early) >= 16:
                    self._early.pop(next(iter(self._early)))
                store = self._early[pair_key] = RelayStore(pair_key, self.timeout_s)
        if store is None or not store.deliver(key, value):
            log.warning("KV pair %s: dropped a rendezvous value for %r from its peer", pair_key, key)

    def source_pair(self, me: str, peer: str, peer_address: str = "") -> Pair:
        """The pair this instance uses to send to ``peer`` (formed on first use; the peer joins with its key).
        ``peer_address``: where the peer is now; a pair made while it was elsewhere (a restarted instance that
        kept its id) ends at a process that is gone, and a new pair is made."""
        with self._lock:
            pair = self.pairs.get(peer)
            if pair is not None and peer_address and pair.peer_address and pair.peer_address != peer_address:
                pair.broken = True
            if pair is None or pair.broken:
                if pair is not None:
                    pair.close()
                # The key names the pair in the store and is its one-time password: it travels only in
                # MigrateStart/MigStage (authenticated ZeroMQ), and a pair's Gloo addresses are found under it.
                key = f"{me}>{peer}/{secrets.token_hex(16)}"
                pair = self.pairs[peer] = Pair(key, self.host, SOURCE_RANK, RelayStore(key, self.timeout_s),
                                               self.timeout_s)
                pair.peer_address = peer_address
            return pair

    def dest_pair(self, key: str, store_address: str) -> Pair:
        """The pair a source named ``key`` at ``store_address`` (joined on first use)."""
        with self._lock:
            pair = self.pairs.get(key)
            if pair is None or pair.broken:
                # A new key from the same source replaces its older pairs (it reconnected after a failure).
                family = key.rsplit("/", 1)[0] + "/"
                for old in [k for k in self.pairs if k.startswith(family)]:
                    self.pairs.pop(old).close()
                if store_address:  # a source that still names a TCPStore
                    host, _, port = store_address.rpartition(":")
                    if not host or not port.isdigit():
                        raise TransferError(f"bad KV store address {store_address!r} (expected HOST:PORT)")

                    def connect() -> dist.Store:
                        return dist.TCPStore(host, int(port), is_master=False,
                                             timeout=timedelta(seconds=self.timeout_s), use_libuv=True)

                    store = connect
                else:
                    store = self._early.pop(key, None) or RelayStore(key, self.timeout_s)
                pair = self.pairs[key] = Pair(key, self.host, DEST_RANK, store, self.timeout_s)
            return pair

    def forget(self, name: str) -> None:
        with self._lock:
            pair = self.pairs.pop(name, None)
            self._early.pop(name, None)
        if pair is not None:
            pair.close()

    def close(self) -> None:
        with self._lock:
            pairs, self.pairs = list(self.pairs.values()), {}
        for pair in pairs:
            pair.close()
