"""KV transfer for a tensor-parallel vLLM instance: the llumlet runs one migration protocol, every rank
moves its own shard; and the factory that gives an instance its KV transport (``gloo_transport``).

The migration protocol (daemons/migration/) sees the same interface (daemons/migration/transport.py
``KvTransport``) as ``transfer.KvTransfer`` (daemons/kv/transfer.py): pairs with a key, ``send`` and ``recv`` that resolve to the
bytes moved. Here a pair stands for N Gloo pairs, one per rank, each between rank r of the source and rank r
of the destination (``RankKv``, which runs in each worker process: daemons/kv/tpworker.py), all found under the
pair's key in this instance's rendezvous store. A send or receive asks every rank to start and to say when it
ended, over each rank's control line (daemons/kv/rankctl.py), never waiting for an engine step; it resolves
when every rank has moved its blocks, and fails once one rank failed and none can still write (the migration
then aborts, and the destination releases its reservation). Commit happens after that, so a request commits
only when every rank has its blocks.

No engine module is imported here: the engine says whether its KV lives in worker processes (``kv_ranks``:
each rank's control endpoint), and the ranks' side is handed the KV blocks to move.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections import OrderedDict
from concurrent.futures import Future
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from daemons.config import MigrationConfig
from daemons.kv.layout import KvBlocks
from daemons.kv.rankctl import RankLinks, RankTimeout
from daemons.kv.transfer import DEST_RANK, SOURCE_RANK, KvTransfer, Pair
from daemons.migration.transport import KvTransport, TransferError

log = logging.getLogger("llumnix.engine.vllm.tp")

KEEP_ENDED = 256  # ended transfers whose outcome a rank still answers for

CALL_S = 10.0  # a start or a forget: the rank answers at once, unless its process waits long for a CPU
WAIT_S = 2.0  # between checks that a rank whose transfer is still going answers at all
ALIVE_S = 10.0
PACE_S = 0.005  # how often a paced send's share of time is looked at (the engine changes it once a step)


class TpPair:
    """One pair key, N ranks. ``send``/``recv`` return asyncio futures (the protocol awaits them)."""

    _ops = itertools.count(1)

    def __init__(self, owner: TpTransfer, key: str, role: str, store_address: str):
        self.owner = owner
        self.key = key
        self.role = role
        self.store_address = store_address
        self.broken = False
        self.peer_address = ""  # a source pair's destination (its request address) when it was made
        self.relay = None  # the ranks meet at the instance's TCPStore, not over the instances' channel

    def send(self, kv, block_ids: list[int], chunk_blocks: int, limit_bytes_s: float = 0.0,
             tail_tokens: int = 0, duty: Callable[[], float] | None = None, one_message: bool = False) -> asyncio.Task:
        """As ``transfer.Pair.send``. ``duty`` is read here and handed to every rank with each poll (a rank
        reads the latest it was given before each chunk)."""
        return self._task(self._run("send", list(block_ids), chunk_blocks, limit_bytes_s, tail_tokens, duty,
                                    one_message))

    def recv(self, kv, block_ids: list[int], chunk_blocks: int, tail_tokens: int = 0,
             one_message: bool = False) -> asyncio.Task:
        return self._task(self._run("recv", list(block_ids), chunk_blocks, 0.0, tail_tokens, None, one_message))

    @staticmethod
    def _task(coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        # A migration that gave up (timed out) no longer awaits it: its outcome is logged there, not here.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def _run(self, role: str, block_ids: list[int], chunk_blocks: int, limit_bytes_s: float,
                   tail_tokens: int, duty: Callable[[], float] | None, one_message: bool) -> int:
        if self.broken:
            raise TransferError(f"KV pair {self.key} is not connected")
        o = self.owner
        op = next(self._ops)
        # The cap is per instance: each rank moves 1/N of the bytes, so each gets 1/N of the rate.
        per_rank = limit_bytes_s / o.ranks if limit_bytes_s > 0 else 0.0
        waits: list[asyncio.Task] = []
        pacing = None
        try:
            first = duty() if duty is not None else None
            links = o.links.links
            started = await asyncio.gather(*(link.call(
                "start", op, role, self.key, self.store_address, o.host, block_ids, chunk_blocks, per_rank,
                o.timeout_s, tail_tokens, first, one_message, timeout_s=CALL_S) for link in links),
                return_exceptions=True)
            # A rank that refused started nothing; one that did not answer in time may have started: it is waited
            # for like the others (its answer to ``wait`` follows its start on the same line).
            failed = [str(r) for r in started if isinstance(r, BaseException)]
            waits = [asyncio.ensure_future(self._wait(link, op)) for link, r in zip(links, started)
                     if not isinstance(r, BaseException) or isinstance(r, RankTimeout)]
            if duty is not None and not failed:
                pacing = asyncio.ensure_future(self._pace(op, duty, first))
            moved = 0
            # Until every rank that may write has ended: the destination releases its reservation only then.
            for done in asyncio.as_completed(waits):
                state = await done
                if state[0] == "error":
                    failed.append(state[1])
                else:
                    moved += state[1]
            if failed:
                raise TransferError("; ".join(dict.fromkeys(failed))[:300])
            return moved
        except TransferError:
            self.broken = True
            raise
        except Exception as exc:  # a worker died or answered nonsense: the instance is going down anyway
            self.broken = True
            raise TransferError(f"tensor-parallel workers unreachable: {exc}") from None
        finally:
            if pacing is not None:
                pacing.cancel()
            for t in waits:
                t.cancel()

    @staticmethod
    async def _wait(link, op: int) -> list:
        """The rank's answer when its transfer ends; meanwhile, every ``WAIT_S``, whether the rank still answers
        at all (a worker that died never would)."""
        while True:
            try:
                return await link.call("wait", op, timeout_s=WAIT_S)
            except RankTimeout:
                await link.call("duty", {}, timeout_s=ALIVE_S)  # raises if the rank is gone

    async def _pace(self, op: int, duty: Callable[[], float], sent: float | None) -> None:
        """A paced send's share of time, handed to every rank whenever the engine's steps change it."""
        links = self.owner.links
        while True:
            await asyncio.sleep(PACE_S)
            now = duty()
            if now != sent:
                sent = now
                await links.everyone("duty", {op: now}, timeout_s=ALIVE_S)


class TpTransfer:
    """``KvTransfer``'s interface for a tensor-parallel engine; its rendezvous store is the instance's."""

    def __init__(self, kv: KvTransfer, links: RankLinks):
        self.kv = kv
        self.host = kv.host
        self.timeout_s = kv.timeout_s
        self.address = kv.serve_store()  # the ranks are processes of their own: they meet at a TCPStore
        self.links = links
        self.ranks = len(links)
        self.pairs: dict[str, TpPair] = {}

    def source_pair(self, me: str, peer: str, peer_address: str = "") -> TpPair:
        pair = self.pairs.get(peer)
        stale = pair is not None and peer_address and pair.peer_address and pair.peer_address != peer_address
        if pair is None or pair.broken or stale:
            if pair is not None:
                self.forget(peer)
            key = f"{me}>{peer}/{secrets.token_hex(16)}"
            pair = self.pairs[peer] = TpPair(self, key, "send", self.address)
            pair.peer_address = peer_address
        return pair

    def dest_pair(self, key: str, store_address: str) -> TpPair:
        pair = self.pairs.get(key)
        if pair is None or pair.broken:
            host, _, port = store_address.rpartition(":")
            if not host or not port.isdigit():
                raise TransferError(f"bad KV store address {store_address!r} (expected HOST:PORT)")
            family = key.rsplit("/", 1)[0] + "/"
            for old in [k for k in self.pairs if k.startswith(family)]:
                self.forget(old)
            pair = self.pairs[key] = TpPair(self, key, "recv", store_address)
        return pair

    def relayed(self, pair_key: str, key: str, value: bytes) -> None:
        log.warning("dropped a KV rendezvous for pair %s: this instance's pairs meet at a store", pair_key)

    def forget(self, name: str) -> None:
        pair = self.pairs.pop(name, None)
        if pair is None:
            return
        pair.broken = True
        try:
            task = asyncio.ensure_future(self.links.everyone("forget", pair.key + "/", timeout_s=CALL_S))
        except RuntimeError:  # no running loop (shutting down): the workers go with the engine
            return
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # best effort: nothing waits for it

    def close(self) -> None:
        self.pairs.clear()
        self.links.close()
        self.kv.close()


# ==================================================================== each rank (in its worker process)


class RankKv:
    """One worker's end of KV transfer: its KV blocks, its Gloo pairs, its transfers in flight."""

    def __init__(self, kv: KvBlocks, rank: int):
        self.rank = rank
        self.kv = kv  # KvBlocks over this rank's shard
        self.pairs: dict[str, object] = {}
        self.ops: dict[int, Future] = {}
        self.duties: dict[int, float] = {}  # a paced send's share of time, as the engine last said
        self.ended: OrderedDict[int, tuple] = OrderedDict()

    def pair(self, key: str, role: str, store_address: str, host: str, timeout_s: float):
        name = f"{key}/tp{self.rank}"
        pair = self.pairs.get(name)
        if pair is None or pair.broken:
            if pair is not None:
                pair.close()
            store_host, _, port = store_address.rpartition(":")

            def connect():
                return dist.TCPStore(store_host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                                     use_libuv=True)

            pair = self.pairs[name] = Pair(name, host, SOURCE_RANK if role == "send" else DEST_RANK, connect, timeout_s)
        return pair

    def start(self, op: int, role: str, key: str, store_address: str, host: str, block_ids: list[int],
              chunk_blocks: int, limit_bytes_s: float, timeout_s: float, tail_tokens: int = 0,
              duty: float | None = None, one_message: bool = False) -> None:
        """``duty``: None for an unpaced send, else its share of time until a poll says otherwise.
        ``one_message``: each chunk as one message (both ends of a pair are told the same)."""
        pair = self.pair(key, role, store_address, host, timeout_s)
        if role == "send":
            paced = None
            if duty is not None:
                self.duties[op] = duty
                paced = lambda: self.duties.get(op, 1.0)  # noqa: E731
            self.ops[op] = pair.send(self.kv, block_ids, chunk_blocks, limit_bytes_s, tail_tokens, duty=paced,
                                     one_message=one_message)
        else:
            self.ops[op] = pair.recv(self.kv, block_ids, chunk_blocks, tail_tokens, one_message=one_message)

    def poll(self, ops: list[int], duties: dict[int, float] | None = None) -> dict[int, tuple]:
        """Each op's state; an ended op's stays answerable (other ranks may still be at it, so the engine
        polls again) among the last ``KEEP_ENDED``. ``duties``: paced sends' new shares of time."""
        for op, duty in (duties or {}).items():
            if op in self.duties:
                self.duties[op] = duty
        out = {}
        for op in ops:
            fut = self.ops.get(op)
            if fut is not None and fut.done():
                del self.ops[op]
                self.duties.pop(op, None)
                exc = "its pair was closed before it ran" if fut.cancelled() else fut.exception()
                self.ended[op] = ("done", fut.result()) if exc is None else ("error", f"rank {self.rank}: {exc}")
                while len(self.ended) > KEEP_ENDED:
                    self.ended.popitem(last=False)
            if op in self.ended:
                out[op] = self.ended[op]
            elif fut is not None:
                out[op] = ("pending",)
            else:
                out[op] = ("error", f"rank {self.rank} has no transfer {op}")
        return out

    def forget(self, prefix: str) -> None:
        for name in [n for n in self.pairs if n.startswith(prefix)]:
            self.pairs.pop(name).close()



def gloo_transport(cfg: MigrationConfig, ranks: tuple[list[str], str] | None) -> KvTransport:
    """An instance's KV transport: Gloo pairs (daemons/kv/transfer.py), rank by rank where the engine's KV lives
    in tensor-parallel worker processes (``ranks``, the engine's ``kv_ranks()``: each rank's control endpoint,
    and the directory they live in; None for a KV in this process). Made before the engine's first step."""
    kv = KvTransfer(cfg.kv_host, cfg.kv_port, cfg.timeout_s)
    if ranks is None:
        return kv
    endpoints, directory = ranks
    return TpTransfer(kv, RankLinks(endpoints, directory))
