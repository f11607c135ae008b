"""A tensor-parallel engine's KV transfer without vLLM: the llumlet's ``TpTransfer`` over two ranks per
instance, each rank a ``RankKv`` with its own KV shard and its own real Gloo pair, and ``collective_rpc``
standing in as a call on every rank in turn (what vLLM's executor does between steps, minus the processes).

What it shows: every rank moves its own shard; a paced pre-copy's duty reaches the ranks with each poll and
is what their copy threads read; the last stage's one-message framing is told to both ends alike.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from daemons.kvlayout import KvBlocks
from daemons.kvranks import RankKv, TpTransfer
from daemons.kvtransfer import KvTransfer

RANKS = 2
BLOCKS = 12


class ReadsDuty(dict):
    """A rank's duties, remembering every value its copy thread read. Its second read waits until a poll has
    told the rank a duty other than the first read's (so the test does not depend on how fast the copy runs)."""

    def __init__(self):
        super().__init__()
        self.read: list[float] = []
        self.changed = threading.Condition()

    def __setitem__(self, key, value):
        with self.changed:
            super().__setitem__(key, value)
            self.changed.notify_all()

    def get(self, key, default=None):
        with self.changed:
            if len(self.read) == 1:
                told = self.changed.wait_for(lambda: super(ReadsDuty, self).get(key, default) != self.read[0], 20)
                assert told, "no poll told the rank a new duty"
            value = super().get(key, default)
        self.read.append(value)
        return value


class Instance:
    """One TP instance's llumlet side (``TpTransfer``) and its ranks, in this process."""

    def __init__(self, name: str, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.name = name
        self.ranks = []
        for r in range(RANKS):
            caches = [torch.randn(BLOCKS, 2, 4, 8, generator=gen) for _ in range(3)]  # 3 layers, rank r's heads
            rank = RankKv(KvBlocks(caches, "test/tp", "test", RANKS), r)
            rank.duties = ReadsDuty()
            self.ranks.append(rank)
        self.polls: list[dict | None] = []
        self.kv = KvTransfer("127.0.0.1", 0, 20)
        self.tp = TpTransfer(self.kv, self.rpc, self.boundary, RANKS)

    def rpc(self, method: str, *args) -> list:
        name = method.removeprefix("llumnix_kv_")
        if name == "poll":
            self.polls.append(args[1] if len(args) > 1 else None)
        return [getattr(rank, name)(*args) for rank in self.ranks]

    @staticmethod
    async def boundary(fn):
        await asyncio.sleep(0)  # a step boundary: the call runs between steps
        return fn()

    def close(self) -> None:
        for rank in self.ranks:
            rank.forget("")
        self.tp.close()


@pytest.fixture
def pair_of_instances():
    src, dst = Instance("i0", 0), Instance("i1", 1)
    yield src, dst
    src.close()
    dst.close()


def shard(inst: Instance, rank: int, blocks: list[int]) -> list[torch.Tensor]:
    return [c[blocks].clone() for c in inst.ranks[rank].kv.caches]


async def move(src: Instance, dst: Instance, send_ids, recv_ids, chunk_blocks, **how):
    out = src.tp.source_pair("i0", "i1")
    inn = dst.tp.dest_pair(out.key, src.tp.address)
    duty = how.pop("duty", None)
    sent, got = await asyncio.gather(out.send(None, send_ids, chunk_blocks, duty=duty, **how),
                                     inn.recv(None, recv_ids, chunk_blocks, **how))
    return sent, got


def test_every_rank_moves_its_own_shard_and_a_paced_copy_reads_the_duty_the_engine_hands_it(pair_of_instances):
    src, dst = pair_of_instances
    send_ids, recv_ids = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 0]
    duties = iter([round(0.9 - 0.05 * k, 2) for k in range(17)])  # 0.9 down to 0.1
    current, seen = [next(duties)], [0]

    def duty():
        """The pacer's duty as the engine's steps move it: lower once a rank has read the one it was told.
        (Lowering it at every poll, a fixed list of duties could run out before a copy thread slow to start
        read its first chunk: its second read would then wait for a change that never comes.)"""
        reads = sum(len(rank.duties.read) for rank in src.ranks)
        if reads > seen[0]:
            seen[0] = reads
            current[0] = next(duties, current[0])
        return current[0]

    sent, got = asyncio.run(move(src, dst, send_ids, recv_ids, 1, duty=duty))
    per_block = src.ranks[0].kv.block_nbytes
    assert sent == got == RANKS * len(send_ids) * per_block
    for r in range(RANKS):
        for a, b in zip(shard(src, r, send_ids), shard(dst, r, recv_ids)):
            assert torch.equal(a, b)  # rank r's shard landed on rank r
    assert not torch.equal(shard(src, 0, send_ids)[0], shard(src, 1, send_ids)[0])  # the ranks' shards differ
    # The ranks were started with the engine's first duty and told the newer ones with its polls; each chunk
    # read the latest a rank had been told (never a default), and the duty the ranks read went down with it.
    handed = [0.9] + [p[next(iter(p))] for p in src.polls if p]
    assert len(handed) >= 2, src.polls
    for rank in src.ranks:
        assert len(rank.duties.read) == len(send_ids), rank.duties.read
        assert set(rank.duties.read) <= set(handed), (rank.duties.read, handed)
        assert rank.duties.read == sorted(rank.duties.read, reverse=True)
        assert rank.duties.read[1] < rank.duties.read[0]  # a poll told the copy a lower duty between chunks
        assert not rank.duties and not rank.ops  # an ended transfer keeps no duty and no future
    assert all(p is None for p in dst.polls)  # a receive has no duty


def test_an_unpaced_stage_and_a_one_message_last_stage_move_the_same_bytes(pair_of_instances):
    src, dst = pair_of_instances
    for send_ids, recv_ids, one in (([1, 2, 3, 4], [5, 6, 7, 8], False), ([9, 10], [11, 0], True)):
        sent, got = asyncio.run(move(src, dst, send_ids, recv_ids, 2, one_message=one))
        assert sent == got == RANKS * len(send_ids) * src.ranks[0].kv.block_nbytes
        for r in range(RANKS):
            for a, b in zip(shard(src, r, send_ids), shard(dst, r, recv_ids)):
                assert torch.equal(a, b)
        assert all(not rank.duties.read for rank in src.ranks)  # unpaced: no duty read

