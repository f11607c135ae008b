"""Prefix-cache block hashes (daemons/prefix.py) are vLLM's, and the cluster's prefix index says what a
brute-force search over every instance's reported blocks says."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from daemons import prefix, wire


def test_block_hashes_are_vllms_own(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as kvu

    kvu.init_none_hash(sha256)
    rnd = random.Random(3)
    tokens = [rnd.randrange(0, 150_000) for _ in range(16 * 5 + 7)]
    want, parent = [], None
    for b in range(5):
        parent = kvu.hash_block_tokens(sha256, parent, tokens[b * 16:(b + 1) * 16])
        want.append(bytes(parent))
    assert prefix.block_hashes(tokens, 16) == want  # full blocks only: the 7 tokens after them have none
    assert prefix.block_hashes(tokens, 16, limit=2) == want[:2]
    # Chained: the same block after a different prefix is a different block.
    assert prefix.block_hashes(tokens[16:32], 16) != [want[1]]
    # The seed is PYTHONHASHSEED when that is set, as in vLLM.
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    kvu.init_none_hash(sha256)
    assert prefix.none_hash() == bytes(kvu.NONE_HASH) != prefix.none_hash(prefix.DEFAULT_SEED)
    with pytest.raises(ValueError):
        prefix.block_hashes(tokens, 0)


def test_an_adapters_block_hashes_are_vllms_own(monkeypatch):
    """A LoRA request's blocks are hashed with vLLM's LoRA extra keys: the proxy's index finds the blocks an
    instance cached for that adapter, never the base model's or another adapter's."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    from types import SimpleNamespace

    from vllm.lora.request import LoRARequest
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as kvu

    kvu.init_none_hash(sha256)
    tokens = list(range(100, 164))
    extra = tuple(kvu._gen_lora_extra_hash_keys(SimpleNamespace(lora_request=LoRARequest("sql", 3, "/m/sql"))))
    assert extra == prefix.adapter_keys("sql", "/m/sql")
    want, parent = [], None
    for b in range(4):
        parent = kvu.hash_block_tokens(sha256, parent, tokens[b * 16:(b + 1) * 16], extra)
        want.append(bytes(parent))
    assert prefix.block_hashes(tokens, 16, extra_keys=prefix.adapter_keys("sql", "/m/sql")) == want
    assert prefix.block_hashes(tokens, 16) != want


def _brute(held: dict[str, set[int]], request: list[int]) -> dict[str, int]:
    out = {}
    for i, blocks in held.items():
        n = 0
        while n < len(request) and request[n] in blocks:
            n += 1
        out[i] = n
    return out


ops = st.lists(st.tuples(st.sampled_from(["stored", "removed", "cleared", "replace"]),
                         st.sampled_from(["i0", "i1", "i2"]),
                         st.lists(st.integers(0, 12), max_size=8)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(ops, st.lists(st.integers(0, 12), max_size=10))
def test_match_is_what_a_search_of_every_instances_blocks_says(operations, request):
    index, held = prefix.PrefixIndex(), {}
    for op, iid, blocks in operations:
        getattr(index, op)(iid) if op == "cleared" else getattr(index, op)(iid, blocks)
        if op == "stored":
            held.setdefault(iid, set()).update(blocks)
        elif op == "removed":
            if iid in held:
                held[iid] -= set(blocks)
        elif op == "cleared":
            held.pop(iid, None)
        else:
            held[iid] = set(blocks)
    assert index.match(request) == _brute(held, request)
    assert len(index) == len(set().union(*held.values())) if held else len(index) == 0
    for iid, blocks in held.items():
        assert index.blocks(iid) == len(blocks)
    # Only the instances asked about, unknown ones included (they hold nothing).
    assert index.match(request, ["i1", "i9"]) == {"i1": _brute(held, request).get("i1", 0), "i9": 0}


def test_an_instance_past_its_bound_is_not_believed_beyond_it():
    index = prefix.PrefixIndex(max_blocks_per_instance=4)
    index.stored("i0", range(10))
    assert index.blocks("i0") == 4 and index.ignored == 6 and len(index) == 4
    index.cleared("i0")
    assert len(index) == 0 and index.instances() == []


def test_a_shared_system_prompt_matches_where_it_is_cached():
    system = list(range(1000, 1000 + 64))
    a = prefix.keys(prefix.block_hashes(system + [1, 2, 3] * 20, 16))
    b = prefix.keys(prefix.block_hashes(system + [4, 5, 6] * 20, 16))
    assert a[:4] == b[:4] and a[4] != b[4]  # the 4 blocks of the system prompt are the same blocks
    index = prefix.PrefixIndex()
    index.stored("i0", a)
    index.stored("i1", a[:2])
    assert index.match(b) == {"i0": 4, "i1": 2}


def test_a_follower_asks_for_the_whole_cache_when_it_misses_a_batch_or_meets_a_new_incarnation():
    asked, now = [], [0.0]
    f = prefix.Follower(asked.append, lambda: now[0], resync_s=1.0)
    pub = prefix.Publisher("i0", epoch=5)
    pub.add([(True, 1), (True, 2), (True, 3), (False, 3)])
    first = pub.take()
    assert (first.seq, sorted(first.stored), first.removed) == (1, [1, 2], [3])
    f.on_beat("i0", pub.epoch, 0)  # a proxy that just started hears a heartbeat before any batch
    assert asked == ["i0"]
    f.on_events(pub.full([1, 2]))  # the answer: everything, up to batch 1 ...
    f.on_events(first)  # ... and batch 1 itself, sent before it: already included, changes nothing
    assert f.index.match([1, 2]) == {"i0": 2} and f.state["i0"] == [5, 1]
    pub.add([(True, 4)])
    pub.take()  # batch 2 is lost on the way
    pub.add([(False, 1)])
    f.on_events(pub.take())  # batch 3: applied, but the follower knows it missed one and asks again
    assert f.gaps == 1 and f.index.match([2]) == {"i0": 1} and f.index.match([1]) == {"i0": 0}
    assert asked == ["i0"]  # not yet: at most once a resync_s
    now[0] = 1.5
    f.on_beat("i0", pub.epoch, pub.seq)
    assert asked == ["i0", "i0"]
    f.on_events(pub.full([2, 4]))
    assert f.state["i0"] == [5, 3] and f.index.blocks("i0") == 2
    f.on_beat("i0", pub.epoch, pub.seq)  # in step: nothing to ask
    assert len(asked) == 2
    # The instance restarted: a new epoch's first batch replaces what the old one held.
    new = prefix.Publisher("i0", epoch=6)
    new.add([(True, 9)])
    f.on_events(new.take())
    assert f.index.blocks("i0") == 1 and f.index.match([9]) == {"i0": 1}
    # An instance that publishes nothing (epoch 0 in its heartbeats) holds nothing in the index.
    f.on_beat("i0", 0, 0)
    assert f.index.instances() == [] and "i0" not in f.state


def test_host_tier_blocks_follow_and_continue_engine_hits():
    """A follower keeps an instance's host-tier blocks apart from its engine's: match_tiers gives the engine's
    leading blocks and how far the engine and the tier together reach; a full batch and a new incarnation
    replace both."""
    asked = []
    f = prefix.Follower(asked.append, lambda: 0.0, resync_s=1.0)
    pub = prefix.Publisher("i0", epoch=3)
    pub.add([(True, 1), (True, 2), (True, 3, prefix.HOST), (True, 4, prefix.HOST), (False, 4, prefix.HOST)])
    f.on_events(pub.take())
    assert f.index.blocks("i0") == 2 and f.host.blocks("i0") == 1
    assert f.match_tiers([1, 2, 3, 4]) == {"i0": (2, 3)}
    assert f.index.match([1, 2, 3]) == {"i0": 2}  # the engine-only view is unchanged
    other = prefix.Publisher("i1", epoch=1)
    other.add([(True, 1, prefix.HOST), (True, 2, prefix.HOST)])
    f.on_events(other.take())
    assert f.match_tiers([1, 2, 3]) == {"i0": (2, 3), "i1": (0, 2)}
    assert f.match_tiers([9, 1]) == {}
    f.on_events(pub.full([1], host=[2]))
    assert f.match_tiers([1, 2, 3]) == {"i0": (1, 2), "i1": (0, 2)}
    f.on_events(prefix.Publisher("i0", epoch=4).take() or wire.CacheEvents("i0", 4, 1, stored=[7]))
    assert f.host.blocks("i0") == 0 and f.index.blocks("i0") == 1
    f.forget("i1")
    assert f.match_tiers([1, 2]) == {}


def test_match_tiers_lists_the_holders_in_id_order():
    """Dispatch breaks ties between equal holders by the order it meets them: in id order, so the same view gives
    the same choice in every process (the order of a set of ids changes with the interpreter's hash seed)."""
    engine, host = prefix.PrefixIndex(), prefix.PrefixIndex()
    ids = [f"i{k}" for k in (7, 3, 12, 0, 5, 9, 1)]
    for iid in ids:
        engine.stored(iid, [1, 2])
    assert list(prefix.match_tiers(engine, host, [1, 2])) == sorted(ids)
