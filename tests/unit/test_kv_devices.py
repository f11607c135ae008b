"""KV copies on the device the KV lives on: gather -> staging -> Gloo -> staging -> scatter, on the CPU here and
on a CUDA GPU where there is one (scripts/gpu-check.sh runs this module on a GPU node).

On a GPU the blocks are gathered into a device buffer, copied to pinned host memory on the transfer's own
CUDA stream and sent from there; the receiver does the reverse (``Staging``). The KV views come from
tests/support/kvviews.py, which builds every layout vLLM allocates from its stride order without importing
vLLM (a GPU node's Python need not hold the vLLM we pin); the first test checks those views against vLLM's own
allocator where vLLM imports. The transfers are real Gloo pairs over a real TCPStore on 127.0.0.1.
"""

from __future__ import annotations

import pytest
import torch

from daemons.kv.layout import MAX_RUNS, KvBlocks
from tests.support.gloo import loopback_pair
from tests.support.kvviews import ORDERS, layout_views

LAYERS, BLOCKS, HEADS, TOKENS, CHANNELS = 3, 24, 2, 16, 16
NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def test_the_views_have_the_strides_vllms_allocator_gives():
    vllm_kv = pytest.importorskip("vllm.v1.kv_cache_interface")
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    assert {x.name: x.value for x in KVCacheLayout} == ORDERS
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    spec = vllm_kv.FullAttentionSpec(block_size=TOKENS, num_kv_heads=HEADS, head_size=CHANNELS // 2,
                                     dtype=torch.bfloat16)
    for layout in KVCacheLayout:
        vc = VllmConfig()
        vc.cache_config.kv_cache_layout = layout.name
        cfg = get_kv_cache_config_from_groups(vc, [vllm_kv.KVCacheGroupSpec(names, spec)],
                                              BLOCKS * LAYERS * spec.page_size_bytes)
        theirs = allocate_kv_cache(cfg, torch.device("cpu"), layout)
        ours = layout_views(layout.name, LAYERS, BLOCKS, HEADS, TOKENS, CHANNELS)
        for n, mine in zip(names, ours):
            assert (tuple(mine.shape), mine.stride(), mine.storage_offset()) == \
                (tuple(theirs[n].shape), theirs[n].stride(), theirs[n].storage_offset()), (layout.name, n)


@pytest.fixture(scope="module")
def gloo_pair():
    src, dst = loopback_pair("devices/test")
    yield src, dst
    src.close()
    dst.close()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte for byte, on the CPU (random bytes make NaNs, which never equal themselves as floats)."""
    return torch.equal(a.contiguous().view(torch.uint8).cpu(), b.contiguous().view(torch.uint8).cpu())


RUNS = {"contiguous": ([3, 4, 5, 6, 7], [10, 11, 12, 13, 14]),
        "scattered": ([9, 2, 17, 5, 23, 0], [1, 20, 4, 8, 15, 3]),
        "many-runs": ([23, 0, 21, 2, 19, 4, 17, 6, 15, 8, 13, 10], [1, 3, 5, 7, 9, 11, 22, 14, 16, 18, 20, 12])}


# On the CPU, tests/unit/test_kv_layouts.py covers every layout and run with vLLM's own views (copied run by run):
# here one of them keeps this module's own code honest, and every layout and run copied in one batched kernel per
# chunk, which is what a GPU does (batched None: as the device chooses); on a GPU, all of them.
ROUND_TRIPS = ([("cpu", "LBHNC", "many-runs", None)]
               + [("cpu", layout, run, True) for layout in ORDERS for run in RUNS]
               + [pytest.param("cuda", layout, run, None, marks=NO_CUDA) for layout in ORDERS for run in RUNS])
TAILS = [("cpu", "BLHNC", 9, None), ("cpu", "LBNHC", 9, True)] + [
    pytest.param("cuda", layout, tokens, None, marks=NO_CUDA) for layout in ("LBHNC", "BLHNC", "LHBNC") for tokens in (1, 9)]


@pytest.mark.parametrize("device, layout, run, batched", ROUND_TRIPS)
def test_blocks_round_trip_on_their_device(gloo_pair, device, layout, run, batched):
    """Every block lands byte for byte, nothing else on the destination changes, and the bytes counted are
    the bytes moved; chunks of 2 blocks make the double buffer turn over, and the many-runs ids take the
    index_select / index_copy_ path (with its index tensor on the device)."""
    src_pair, dst_pair = gloo_pair
    src_pair.two_hop = dst_pair.two_hop = None  # what a transfer chooses: staged through the device on a GPU
    a = layout_views(layout, LAYERS, BLOCKS, HEADS, TOKENS, CHANNELS, device=device, seed=1)
    b = layout_views(layout, LAYERS, BLOCKS, HEADS, TOKENS, CHANNELS, device=device, seed=2)
    before = [t.clone() for t in b]
    ka, kb = KvBlocks(a, "test", layout, batched=batched), KvBlocks(b, "test", layout, batched=batched)
    assert ka.device.type == device
    if batched or device == "cuda":  # every layout here but the block-outermost fused ones stacks its layers
        assert (ka._stacked is None) == (ka.path == "fused")
    src_ids, dst_ids = RUNS[run]
    assert (len(KvBlocks._runs(src_ids)) > MAX_RUNS) == (run == "many-runs")
    recv = dst_pair.recv(kb, dst_ids, 2)
    sent = src_pair.send(ka, src_ids, 2).result(60)
    assert recv.result(60) == sent == len(src_ids) * ka.block_nbytes
    if device == "cuda":
        assert src_pair._buffers.two_hop and src_pair._buffers.host(0).is_pinned()
    for x, y, was in zip(a, b, before):
        assert same_bytes(x[src_ids], y[dst_ids])
        others = [i for i in range(BLOCKS) if i not in dst_ids]
        assert same_bytes(was[others], y[others])


@pytest.mark.parametrize("device, layout, tokens, batched", TAILS)
def test_a_last_stage_moves_only_the_written_slots_of_its_partial_block(gloo_pair, device, layout, tokens, batched):
    src_pair, dst_pair = gloo_pair
    src_pair.two_hop = dst_pair.two_hop = None
    a = layout_views(layout, LAYERS, BLOCKS, HEADS, TOKENS, CHANNELS, device=device, seed=3)
    b = layout_views(layout, LAYERS, BLOCKS, HEADS, TOKENS, CHANNELS, device=device, seed=4)
    before = [t.clone() for t in b]
    ka = KvBlocks(a, "test", layout, token_slots=True, batched=batched)
    kb = KvBlocks(b, "test", layout, token_slots=True, batched=batched)
    src_ids, dst_ids = [9, 2, 17, 5], [1, 20, 4, 8]
    recv = dst_pair.recv(kb, dst_ids, 2, tail_tokens=tokens)
    sent = src_pair.send(ka, src_ids, 2, tail_tokens=tokens).result(60)
    assert recv.result(60) == sent == 3 * ka.block_nbytes + ka.tail_nbytes(tokens)
    for x, y, was in zip(a, b, before):
        assert same_bytes(x[src_ids[:3]], y[dst_ids[:3]])
        assert same_bytes(x[5, :, :tokens], y[8, :, :tokens])
        assert same_bytes(was[8, :, tokens:], y[8, :, tokens:])  # the slots not written keep their bytes



@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_transfer_thread_copies_with_the_kvs_gpu_current_not_gpu_0():
    """A tensor-parallel rank's KV is on GPU r, but a thread starts with GPU 0 current: staging must make the
    KV's GPU current for its allocations and copies, or rank r opens a context on GPU 0 and takes memory there."""
    import threading

    class Spy(KvBlocks):
        seen: list[int] = []

        def gather(self, block_ids, out):
            self.seen.append(torch.cuda.current_device())
            super().gather(block_ids, out)

    kv = Spy(layout_views("LBNHC", LAYERS, BLOCKS, HEADS, TOKENS, CHANNELS, device="cuda:1"), "test", "LBNHC")
    from daemons.kv.layout import Staging

    def run():
        st = Staging(kv, 2 * kv.block_nbytes)
        st.load(0, [3, 4])
        Spy.seen.append(torch.cuda.current_device())  # outside staging: the thread's own device again

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert Spy.seen == [1, 0]
