"""A tensor-parallel engine's KV transfer without vLLM: the llumlet's ``TpTransfer`` over two ranks per
instance, each rank a ``RankKv`` with its own KV shard and its own real Gloo pair, served by its own control
thread on a real ZeroMQ ipc socket (daemons/kv/rankctl.py ``RankServer``, as in a worker process, minus the
process).

What it shows: every rank moves its own shard; a paced pre-copy's duty reaches the ranks while they copy and
is what their copy threads read; the last stage's one-message framing is told to both ends alike; a transfer
ends while the engine's step loop (here: nothing) is never asked; a rank's failure fails the pair; a
malformed control message is dropped and the rank goes on.

``LLUMNIX_KV_TEST_DEVICE=cuda`` puts every shard on the GPU (scripts/gpu-check.sh does, on a GPU node).
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from concurrent.futures import Future

import pytest
import torch

from daemons.kv.layout import KvBlocks
from daemons.ipcdirs import endpoint_dir
from daemons.kv.rankctl import RankLinks, RankServer
from daemons.kv.ranks import RankKv, TpTransfer
from daemons.migration.transport import TransferError
from daemons.kv.transfer import KvTransfer

RANKS = 2
BLOCKS = 12
DEVICE = os.environ.get("LLUMNIX_KV_TEST_DEVICE", "cpu")


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


class Rank(RankKv):
    """A rank that remembers the duties it was told (``poll``'s second argument: the control thread's ``duty``)."""

    def __init__(self, *args, told: list):
        super().__init__(*args)
        self.told = told

    def poll(self, ops, duties=None):
        if duties:
            self.told.append(dict(duties))
        return super().poll(ops, duties)


class Instance:
    """One TP instance's llumlet side (``TpTransfer``) and its ranks, each served on its control thread."""

    def __init__(self, name: str, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.name = name
        self.ranks = []
        self.told: list[dict] = []
        self.directory = endpoint_dir()
        self.servers = []
        for r in range(RANKS):
            caches = [torch.randn(BLOCKS, 2, 4, 8, generator=gen).to(DEVICE) for _ in range(3)]  # 3 layers, rank r's heads
            rank = Rank(KvBlocks(caches, "test/tp", "test", RANKS), r, told=self.told)
            rank.duties = ReadsDuty()
            self.ranks.append(rank)
            self.servers.append(RankServer(lambda rank=rank: rank, self.directory, r))
        self.kv = KvTransfer("127.0.0.1", 0, 20)
        self.tp = TpTransfer(self.kv, RankLinks([s.endpoint for s in self.servers], self.directory))

    def close(self) -> None:
        for rank in self.ranks:
            rank.forget("")
        self.tp.close()
        for server in self.servers:
            server.close()


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
    # The ranks were started with the engine's first duty and told the newer ones while they copied; each chunk
    # read the latest a rank had been told (never a default), and the duty the ranks read went down with it.
    handed = [0.9] + [p[next(iter(p))] for p in src.told]
    assert len(handed) >= 2, src.polls
    for rank in src.ranks:
        assert len(rank.duties.read) == len(send_ids), rank.duties.read
        assert set(rank.duties.read) <= set(handed), (rank.duties.read, handed)
        assert rank.duties.read == sorted(rank.duties.read, reverse=True)
        assert rank.duties.read[1] < rank.duties.read[0]  # a poll told the copy a lower duty between chunks
        assert not rank.duties and not rank.ops  # an ended transfer keeps no duty and no future
    assert not dst.told  # a receive has no duty


def test_an_unpaced_stage_and_a_one_message_last_stage_move_the_same_bytes(pair_of_instances):
    src, dst = pair_of_instances

    async def both():
        out = []
        for send_ids, recv_ids, one in (([1, 2, 3, 4], [5, 6, 7, 8], False), ([9, 10], [11, 0], True)):
            out.append((send_ids, recv_ids, await move(src, dst, send_ids, recv_ids, 2, one_message=one)))
        return out

    for send_ids, recv_ids, (sent, got) in asyncio.run(both()):
        assert sent == got == RANKS * len(send_ids) * src.ranks[0].kv.block_nbytes
        for r in range(RANKS):
            for a, b in zip(shard(src, r, send_ids), shard(dst, r, recv_ids)):
                assert torch.equal(a, b)
    assert all(not rank.duties.read for rank in src.ranks)  # unpaced: no duty read


def test_a_rank_that_fails_fails_the_pair_and_a_malformed_control_message_is_dropped(pair_of_instances, caplog):
    src, dst = pair_of_instances

    async def run():
        # A malformed frame and an unknown call: logged and dropped; the rank still answers the next call.
        raw = src.tp.links.links[0].sock
        await raw.send(b"\xc1 not msgpack")
        await raw.send(__import__("msgspec").msgpack.encode([1, "exec", []]))
        assert await src.tp.links.links[0].call("wait", 12345, timeout_s=10) == ["error", "rank 0 has no transfer 12345"]
        # Each rank's transfer fails on its pair's thread (as a Gloo error would): the pair fails, naming both.
        for rank in src.ranks:
            def start(op, *args, rank=rank):
                fut = Future()
                rank.ops[op] = fut
                threading.Timer(0.05, fut.set_exception, (RuntimeError(f"peer reset on rank {rank.rank}"),)).start()
            rank.start = start
        out = src.tp.source_pair("i0", "i1")
        with pytest.raises(TransferError) as failed:
            await out.send(None, [1, 2], 1)
        # A rank that refuses to start fails the pair at once.
        src.ranks[0].start = lambda *args: (_ for _ in ()).throw(ValueError("no such pair"))
        out2 = src.tp.source_pair("i0", "i1")
        with pytest.raises(TransferError) as refused:
            await out2.send(None, [1, 2], 1)
        return out, out2, failed.value, refused.value

    out, out2, failed, refused = asyncio.run(run())
    assert "peer reset on rank 0" in str(failed) and "peer reset on rank 1" in str(failed), failed
    assert out.broken and out2 is not out and out2.broken  # the next move took a fresh pair
    assert "rank 0: ValueError: no such pair" in str(refused), refused
    assert "dropped a malformed KV control message" in caplog.text


def test_endpoint_directories_that_killed_instances_left_are_swept_and_live_ones_kept(tmp_path):
    import os
    import time

    from daemons.ipcdirs import PREFIX, STALE_S, sweep_stale

    live = tmp_path / f"{PREFIX}live"
    dead = tmp_path / f"{PREFIX}dead"
    young = tmp_path / f"{PREFIX}young"
    for d in (live, dead, young):
        d.mkdir(mode=0o700)
    server = RankServer(lambda: None, str(live), 0)  # a rank still listening
    with socket.socket(socket.AF_UNIX) as s:  # as a worker killed with SIGKILL: the file stays, no one listens
        s.bind(str(dead / "rank0"))
    old = time.time() - STALE_S - 1
    for d in (live, dead):
        os.utime(d, (old, old))
    assert sweep_stale(str(tmp_path)) == [str(dead)]
    assert live.exists() and young.exists() and not dead.exists()
    server.close()
