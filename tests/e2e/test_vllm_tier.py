"""The host KV tier and session retention on a real vLLM engine (daemons/engine/vllm_internals_tier.py), tiny
random-weight LLaMA, a KV cache of 31 blocks: blocks evicted from vLLM's prefix cache are copied to the tier
and restored when a prompt comes back, with the same greedy tokens as when computed (and different ones when the
tier's bytes are spoiled: the restored KV is what the model reads); the tier stays within its size and its
events replay to what it holds; export and import carry a prefix from one engine to another's tier; a
session's blocks outlive other blocks in vLLM's free queue until their deadline, never counted as used.

vLLM runs in this process, one engine at a time (as tests/e2e/test_vllm_engine.py)."""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")
vllm = pytest.importorskip("vllm")

from daemons import prefix  # noqa: E402
from daemons.config import KvTierConfig, ModelConfig, VllmConfig  # noqa: E402
from daemons.engine.base import EngineError, EngineRequest  # noqa: E402
from daemons.engine.vllm_backend import VllmEngine  # noqa: E402
from daemons.engine.vllm_internals import apply_workarounds  # noqa: E402
from daemons.wire import SamplingParams  # noqa: E402
from llumnixctl.lab.model import write_tiny_model  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

BS = 32
A = [1] + [(i * 7) % 500 + 3 for i in range(299)]  # 9 full blocks (and the last token's)
OTHERS = [[1] + [(i * 13 + k * 101) % 500 + 3 for i in range(299)] for k in range(4)]


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    apply_workarounds()
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@contextmanager
def engine(model_dir, host_mb: int = 8, retain_s: float = 0.0, clock=None, caching: bool = True):
    e = VllmEngine(ModelConfig(path=str(model_dir), max_model_len=512),
                   VllmConfig(block_size=BS, kv_cache_bytes=1 << 20, max_num_seqs=4, enable_prefix_caching=caching),
                   kv_tier=KvTierConfig(host_mb=host_mb, retain_s=retain_s), clock=clock or Clock())
    try:
        yield e
    finally:
        e.shutdown()


def gen(e: VllmEngine, rid: str, prompt: list[int], n: int = 8, session: str = "") -> list[int]:
    e.add_request(EngineRequest(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                                session=session))
    out = []
    while e.has_work():
        out += [t.token_id for t in e.step().outputs if t.request_id == rid]
        if e.tier is not None:
            assert len(e.tier) <= e.tier.capacity
    return out


def engine_holds(e: VllmEngine, prompt: list[int]) -> int:
    return len(e._tiers.engine_leading(prefix.block_hashes(prompt, BS)))


def test_evicted_blocks_are_restored_with_the_same_tokens_and_the_tier_stays_within_its_size(model_dir):
    with engine(model_dir, host_mb=1) as e:  # 32 KiB blocks: 32 of them
        assert e.tier.capacity == (1 << 20) // e.kv_blocks().block_nbytes == 32
        held: set[int] = set()

        def serve(rid: str, prompt: list[int]) -> list[int]:
            out = gen(e, rid, prompt)
            for ev in e.cache_events():
                if len(ev) == 3:
                    assert ev[2] == prefix.HOST
                    (held.add if ev[0] else held.discard)(ev[1])
            return out

        want = serve("a1", A)
        for k, p in enumerate(OTHERS):
            serve(f"o{k}", p)
        assert engine_holds(e, A) == 0 and e.tier.leading(prefix.block_hashes(A, BS)) == 9
        assert serve("a2", A) == want  # from the tier
        assert e.tier.restored_blocks == 9 and e.tier.restored_bytes == 9 * e.kv_blocks().block_nbytes
        assert e.cache.by_source == {"engine": 0, "host": 9 * BS, "pulled": 0, "recomputed": 6 * 300 - 9 * BS}
        assert e.load().restore_ms_per_block == e.tier.restore_ms_per_block > 0
        print(f"restore: {e.tier.restore_ms_per_block:.3f} ms per block of {e.kv_blocks().block_nbytes} bytes")
        for k in range(2):
            for j, p in enumerate(OTHERS):
                serve(f"p{k}-{j}", p[:1] + [k] + p[2:])
        assert len(e.tier) == 32 and held == set(e.tier_snapshot())
        assert (e.load().tier_blocks, e.load().tier_capacity) == (32, 32)
        assert engine_holds(e, A) == 0 and e.tier.leading(prefix.block_hashes(A, BS)) == 0
        serve("a3", A)  # recomputed: into the engine, and to the tier again by the next traffic
        for j, p in enumerate(OTHERS):
            serve(f"q{j}", p)
        assert engine_holds(e, A) == 0 and e.tier.leading(prefix.block_hashes(A, BS)) == 9
        e.tier.rows.random_(0, 255)  # spoiled: a restore that used these bytes would change the tokens
        assert serve("a4", A) != want


def test_export_then_import_carries_a_prefix_into_another_engines_tier(model_dir):
    hashes = prefix.block_hashes(A, BS)
    with engine(model_dir) as src:
        want = gen(src, "a", A)
        for k, p in enumerate(OTHERS[:2]):
            gen(src, f"o{k}", p)
        n, payload = src.export_blocks(hashes)  # some from the engine, some from its tier
        assert n == 9 and payload.numel() == 9 * src.kv_blocks().block_nbytes
    with engine(model_dir) as dst:
        assert dst.import_blocks(hashes[:n], payload) == 9
        assert gen(dst, "b", A) == want
        assert dst.tier.restored_blocks == 9 and dst.cache.by_source["pulled"] == 9 * BS


def test_a_sessions_blocks_outlive_others_in_vllms_free_queue_until_their_deadline(model_dir):
    clock = Clock()
    with engine(model_dir, host_mb=0, retain_s=30.0, clock=clock) as e:
        assert e.tier is None
        with pytest.raises(EngineError, match="kv_tier.host_mb"):
            e.import_blocks(prefix.block_hashes(A, BS), torch.zeros(9 * e.kv_blocks().block_nbytes, dtype=torch.uint8))
        want = gen(e, "a1", A, session="chat")
        assert e.load().retained_blocks == 9
        for k, p in enumerate(OTHERS[:3]):  # 30 blocks through 31, 10 of them A's
            gen(e, f"o{k}", p)
        assert engine_holds(e, A) == 9
        assert e.load().blocks_used == 0  # free all along (reclaimable)
        assert gen(e, "a2", A, session="chat") == want
        clock.now = 31.0  # past its deadline: an ordinary block again
        for k, p in enumerate(OTHERS):
            gen(e, f"p{k}", p)
        assert engine_holds(e, A) == 0 and e.load().retained_blocks == 0
        # A turn that moved mid-answer keeps its session: retained where it ends, for what it asked (5 s).
        from tests.e2e.test_vllm_engine import _migrate_within, run

        moved: dict = {}
        run(e, [EngineRequest("m0", A, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), session="chat",
                              retain_s=5.0)], steps=2, out=moved, check=lambda e: None)
        assert e.migrating_request("m0").session == "chat"
        _migrate_within(e, "m0", "m1", moved, steps_between=1)
        run(e, [], out=moved, check=lambda e: None)
        assert [t.token_id for t in moved["m1"]] == want
        assert e.load().retained_blocks == (len(A) + 8 - 1) // BS  # the blocks it computed, the last token's aside
        clock.now = 36.5
        assert e.load().retained_blocks == 0
