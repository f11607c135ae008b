"""KV transfer in memory, for instances that run in one process (tests/support/cluster.py): one more
implementation of daemons/migration/transport.py's ``KvTransport`` (a pair's ``send`` and ``recv`` return
futures of the bytes moved), with the blocks copied by the engines' own ``KvBlocks`` gather and scatter instead
of Gloo. A pair matches its sends and receives in the order they were
posted, as a Gloo pair does; a transfer whose peer never posts its half never completes (the migration's own
timeouts end it, as with a silent peer), unless the pair is closed at either end: then its transfers not yet
completed fail, as a Gloo pair's do when its peer's connection goes."""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from concurrent.futures import Future

import torch

from daemons.kv.layout import KvBlocks
from daemons.migration.transport import TransferError


class Hub:
    """The pairs of every instance in the process, by key."""

    def __init__(self, bytes_per_s: float = 0.0) -> None:
        """``bytes_per_s``: how fast a matched transfer completes, in virtual time (0: at once), as a copy over
        a slow link would."""
        self.bytes_per_s = bytes_per_s
        self.sends: dict[str, deque] = {}
        self.recvs: dict[str, deque] = {}
        self.open: dict[str, list[Future]] = {}  # by key: the futures of transfers not completed yet
        self._ids = itertools.count(1)
        self.moved_bytes = 0

    def transport(self, name: str) -> MemoryKv:
        return MemoryKv(self, name)

    def post(self, key: str, side: str, item) -> None:
        self.open[key] = [f for f in self.open.get(key, ()) if not f.done()] + [item[-1]]
        (self.sends if side == "send" else self.recvs).setdefault(key, deque()).append(item)
        sends, recvs = self.sends.get(key), self.recvs.get(key)
        while sends and recvs:
            self._match(sends.popleft(), recvs.popleft())

    def _match(self, sent, into) -> None:
        (data, tail, n_whole, tail_tokens, done_send), (kv, block_ids, want_tail, done_recv) = sent, into
        whole, last = (block_ids[:-1], block_ids[-1]) if want_tail else (block_ids, None)
        if len(whole) != n_whole or want_tail != tail_tokens:
            err = RuntimeError(f"a pair's send ({n_whole} blocks, tail {tail_tokens}) met a receive of "
                               f"{len(whole)} blocks, tail {want_tail}")
            done_send.set_exception(err)
            done_recv.set_exception(err)
            return
        if whole:
            kv.scatter(whole, data)
        if last is not None:
            kv.scatter_tail(last, want_tail, tail)
        nbytes = data.numel() + (tail.numel() if tail is not None else 0)
        self.moved_bytes += nbytes

        def done() -> None:
            for fut in (done_send, done_recv):
                if not fut.done():
                    fut.set_result(nbytes)

        if self.bytes_per_s > 0:
            asyncio.get_running_loop().call_later(nbytes / self.bytes_per_s, done)
        else:
            done()

    def drop(self, key: str) -> None:
        self.sends.pop(key, None)
        self.recvs.pop(key, None)
        for fut in self.open.pop(key, []):
            if not fut.done():
                fut.set_exception(TransferError(f"KV pair {key} was closed"))


class MemoryPair:
    def __init__(self, hub: Hub, key: str) -> None:
        self.hub = hub
        self.key = key
        self.broken = False
        self.relay = None  # no rendezvous: the hub matches the two ends by key

    def send(self, kv: KvBlocks, block_ids: list[int], chunk_blocks: int, limit_bytes_s: float = 0.0,
             tail_tokens: int = 0, duty=None, one_message: bool = False) -> Future:
        whole, last = (block_ids[:-1], block_ids[-1]) if tail_tokens else (list(block_ids), None)
        data = torch.empty(len(whole) * kv.block_nbytes, dtype=torch.uint8)
        if whole:
            kv.gather(whole, data)
        tail = None
        if last is not None:
            tail = torch.empty(kv.tail_nbytes(tail_tokens), dtype=torch.uint8)
            kv.gather_tail(last, tail_tokens, tail)
        fut: Future = Future()
        self.hub.post(self.key, "send", (data, tail, len(whole), tail_tokens, fut))
        return fut

    def recv(self, kv: KvBlocks, block_ids: list[int], chunk_blocks: int, tail_tokens: int = 0,
             one_message: bool = False) -> Future:
        fut: Future = Future()
        self.hub.post(self.key, "recv", (kv, list(block_ids), tail_tokens, fut))
        return fut

    def close(self) -> None:
        self.hub.drop(self.key)


class MemoryKv:
    """One instance's end: the pairs it started as a source (by peer) and joined as a destination (by key)."""

    def __init__(self, hub: Hub, name: str) -> None:
        self.hub = hub
        self.address = f"memory:{name}"
        self.pairs: dict[str, MemoryPair] = {}

    def source_pair(self, me: str, peer: str, peer_address: str = "") -> MemoryPair:
        pair = self.pairs.get(peer)
        if pair is None:
            pair = self.pairs[peer] = MemoryPair(self.hub, f"{me}>{peer}/{next(self.hub._ids)}")
        return pair

    def dest_pair(self, key: str, store_address: str) -> MemoryPair:
        pair = self.pairs.get(key)
        if pair is None:
            pair = self.pairs[key] = MemoryPair(self.hub, key)
        return pair

    def relayed(self, pair_key: str, key: str, value: bytes) -> None:
        """No rendezvous values travel between in-memory pairs."""

    def forget(self, name: str) -> None:
        pair = self.pairs.pop(name, None)
        if pair is not None:
            pair.close()

    def close(self) -> None:
        for pair in self.pairs.values():
            pair.close()
        self.pairs.clear()
