"""daemons/engine/vllm_cache.py on vLLM's own event and cache-map types, with a stand-in block pool: what an
instance publishes of vLLM's prefix cache (the engine itself runs in tests/e2e/test_vllm_engine.py)."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm")
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id  # noqa: E402

from daemons import prefix  # noqa: E402
from daemons.engine.vllm_cache import VllmPrefixCache  # noqa: E402


class Pool:
    def __init__(self):
        self.cached_block_hash_to_block = SimpleNamespace(_cache={})
        self.queued: list = []

    def take_events(self):
        out, self.queued = self.queued, []
        return out

    def hold(self, h: bytes) -> None:
        self.cached_block_hash_to_block._cache[make_block_hash_with_group_id(h, 0)] = object()

    def drop(self, h: bytes) -> None:
        del self.cached_block_hash_to_block._cache[make_block_hash_with_group_id(h, 0)]


def _h(n: int) -> bytes:
    return hashlib.sha256(str(n).encode()).digest()


def stored(*hs) -> BlockStored:
    return BlockStored(block_hashes=list(hs), parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                       medium=None, lora_name=None)


def test_events_become_keys_and_a_copy_evicted_while_another_holds_the_content_is_no_removal():
    pool = Pool()
    sched = SimpleNamespace(kv_cache_manager=SimpleNamespace(), kv_event_publisher=None)
    cache = VllmPrefixCache(sched, pool)
    assert sched.kv_event_publisher is cache and sched.kv_cache_manager.log_stats is True
    a, b = _h(1), _h(2)
    pool.hold(a)
    pool.hold(b)
    cache.publish(SimpleNamespace(events=[stored(a, b)]))
    assert cache.events() == [(True, prefix.key(a)), (True, prefix.key(b))]
    # Two blocks held a's content; one was evicted (vLLM says removed), the other still holds it.
    pool.queued = [BlockRemoved(block_hashes=[a], medium=None), BlockRemoved(block_hashes=[b], medium=None)]
    pool.drop(b)
    assert cache.events() == [(False, prefix.key(b))]
    assert sorted(cache.snapshot()) == [prefix.key(a)]
    # vLLM's int hashes (its default for events) are our keys as they are.
    c = _h(3)
    pool.hold(c)
    cache.publish(SimpleNamespace(events=[stored(int.from_bytes(c, "big") & (2 ** 64 - 1))]))
    assert cache.events() == [(True, prefix.key(c))]
    # A reset removes everything reported held, stored in the same batch included.
    d = _h(4)
    pool.cached_block_hash_to_block._cache.clear()
    cache.publish(SimpleNamespace(events=[stored(d), AllBlocksCleared()]))
    out = cache.events()
    assert out[0] == (True, prefix.key(d))
    assert {k for s, k in out[1:] if not s} == {prefix.key(a), prefix.key(c), prefix.key(d)}
