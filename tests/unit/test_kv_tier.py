"""The host KV tier and session retention (daemons/engine/tier.py) on their own and on the sim engine
(daemons/engine/sim_cache.py): the tier never holds more than its size, evicts least recently used first and
retained blocks last, retention ends at its deadline and stays within its share; on the sim, evicted blocks go to
the tier, a prompt continuing past the engine's cache is restored from it at sim.restore_ms_per_block a block
(tokens unchanged), a session's blocks outlive others' under pressure, and the instance's reports see all of it.
The same on a real vLLM engine: tests/e2e/test_vllm_tier.py."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from daemons import prefix
from daemons.config import KvTierConfig, ModelConfig, SimConfig
from daemons.engine.base import EngineError, EngineRequest
from daemons.engine.sim import SimEngine
from daemons.engine.tier import HostTier, Retention, auto_host_bytes, tier_blocks
from daemons.wire import SamplingParams
from tests.unit.test_sim_engine import BASE, check_invariants


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


# ---------------------------------------------------------------- the tier and retention alone


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.lists(st.integers(0, 20), max_size=80))
def test_the_tier_never_holds_more_than_its_size_and_evicts_the_least_recently_used(capacity, puts):
    tier = HostTier(capacity, 4)
    order: list[int] = []  # the model: least recently used first
    for i in puts:
        r = tier.put(h(i))
        if i in order:
            assert r is None  # held already: touched
            order.remove(i)
        else:
            assert r is not None
            tier.rows[r] = i  # the caller fills the row
            if len(order) == capacity:
                order.pop(0)
        order.append(i)
        assert len(tier) == len(order) <= capacity
    assert sorted(prefix.key(h(i)) for i in order) == sorted(tier.snapshot())
    for i in order:  # each row still holds what was written for its hash
        assert int(tier.rows[tier.row(h(i))][0]) == i
    held: set[int] = set()
    for stored, key, tier_of in tier.events():  # the events replay to what it holds
        assert tier_of == prefix.HOST
        (held.add if stored else held.discard)(key)
    assert held == set(tier.snapshot())


def test_retained_blocks_are_evicted_last_and_return_to_lru_at_their_deadline():
    clock = Clock()
    retention = Retention(default_s=10.0, max_s=30.0, limit=100, clock=clock)
    tier = HostTier(4, 0, retention, store=False)
    for i in range(4):
        tier.put(h(i))
    retention.turn_ended("s", [h(0), h(1)])  # the oldest two, retained
    assert len(retention) == 2 and tier.retained_blocks() == 2
    tier.put(h(4))
    tier.put(h(5))
    assert h(2) not in tier and h(3) not in tier and h(0) in tier and h(1) in tier
    tier.put(h(6))  # only retained ones left to evict besides the newer plain ones: the plain go first
    assert h(0) in tier and h(1) in tier and h(4) not in tier
    clock.now = 10.0
    assert retention.expire() == 1 and len(retention) == 0 and tier.retained_blocks() == 0
    tier.put(h(7))
    assert h(0) not in tier and h(1) in tier  # the least recently used now



def test_retention_asks_within_bounds_replaces_a_sessions_last_turn_and_keeps_to_its_share():
    clock = Clock()
    r = Retention(default_s=5.0, max_s=20.0, limit=4, clock=clock)
    assert r.ttl(0) == 5.0 and r.ttl(100) == 20.0 and r.ttl(7) == 7.0
    r.turn_ended("a", [h(1), h(2)])
    r.turn_ended("a", [h(1), h(2), h(3)])  # the next turn: its blocks now
    assert r.sessions() == 1 and len(r) == 3
    r.turn_ended("b", [h(1), h(9)], asked_s=15.0)  # a shared block counts once
    assert len(r) == 4
    r.turn_ended("c", [h(10), h(11)], asked_s=18.0)  # past the share: a (due first) loses its retention
    assert r.sessions() == 2 and h(2) not in r and h(1) in r and len(r) == 4
    clock.now = 15.0
    r.expire()
    assert r.sessions() == 1 and set(r.hashes()) == {h(10), h(11)}
    r.turn_ended("", [h(5)])  # no session: nothing retained
    assert h(5) not in r


def test_auto_size_is_four_times_the_engine_bounded_by_an_eighth_of_the_host():
    assert auto_host_bytes(1 << 20, host_bytes=1 << 40) == 4 << 20
    assert auto_host_bytes(1 << 30, host_bytes=8 << 30) == 1 << 30
    assert tier_blocks(-1, 1024, 100) == auto_host_bytes(100 * 1024) // 1024
    assert tier_blocks(0, 1024, 100) == 0 and tier_blocks(3, 1024, 100) == 3 * 1024


# ---------------------------------------------------------------- the sim engine

TIMED = dict(BASE, prefill_ms_per_token=1.0, prefill_ms=0.0, decode_ms=0.0, decode_ms_per_seq=0.0,
             decode_ms_per_token=0.0, block_size=4, num_blocks=24, watermark=0.0, prefix_caching=True,
             restore_ms_per_block=0.5)


def engine(host_mb: int = 1, retain_s: float = 0.0, clock=None, **kw) -> SimEngine:
    return SimEngine(SimConfig(**{**TIMED, **kw}), ModelConfig(max_model_len=1024),
                     kv_tier=KvTierConfig(host_mb=host_mb, retain_s=retain_s), clock=clock)


def request(rid: str, prompt: list[int], max_tokens: int = 2, session: str = "") -> EngineRequest:
    return EngineRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), session=session)


def run(e: SimEngine, r: EngineRequest) -> tuple[list[int], float]:
    e.add_request(r)
    ids, first = [], None
    while e.has_work():
        res = e.step()
        first = res.model_time_s if first is None else first
        ids += [o.token_id for o in res.outputs if o.request_id == r.request_id]
        check_invariants(e)
        if e.tier is not None:
            assert len(e.tier) <= e.tier.capacity
    return ids, first


A = list(range(1000, 1040))  # 10 blocks of 4


def others(k: int) -> list[int]:
    return list(range(2000 + 100 * k, 2040 + 100 * k))


def test_evicted_blocks_go_to_the_tier_and_come_back_at_their_restore_cost():
    e, plain = engine(), engine(host_mb=0)
    for x in (e, plain):
        run(x, request("a1", A))
        for k in range(3):  # 30 blocks of other prompts through 24: A's blocks are evicted
            run(x, request(f"o{k}", others(k)))
    assert e.cache.leading(prefix.keys(prefix.block_hashes(A, 4))) == 0
    ids, t = run(e, request("a2", A))
    ref, t_ref = run(plain, request("a2", A))
    assert ids == ref
    assert t_ref == 40 / 1000  # recomputed
    assert t == (1 + 10 * 0.5) / 1000  # 9 whole blocks and the last token's: 10 restored, 1 token computed
    assert e.cache.by_source == {"engine": 0, "host": 39, "pulled": 0, "recomputed": 4 * 40 + 1}
    load = e.load()
    assert load.tier_capacity == e.tier.capacity == (1 << 20) // e.cache.block_nbytes
    assert 0 < load.tier_blocks == len(e.tier) and load.restore_ms_per_block == 0.5
    assert e.tier.restored_blocks == 10 and e.tier.restored_bytes == 10 * e.cache.block_nbytes


def test_a_small_tier_stays_within_its_size_and_reports_what_it_holds():
    e = engine(host_mb=1, num_blocks=16, kv_layers=1, kv_heads=64, head_dim=85)  # 170 KiB blocks: 6 in 1 MiB
    assert e.tier.capacity == 6
    engine_held: set[int] = set()
    host_held: set[int] = set()
    for k in range(8):
        run(e, request(f"o{k}", others(k)))
        for ev in e.cache_events():
            (host_held if len(ev) == 3 else engine_held).__getattribute__("add" if ev[0] else "discard")(ev[1])
        assert len(e.tier) <= 6
    assert host_held == set(e.tier_snapshot()) and engine_held == set(e.cache_snapshot())
    assert len(host_held) == 6


def test_export_and_import_move_a_prefix_into_another_instances_tier():
    src, dst = engine(), engine()
    run(src, request("a", A))
    hashes = prefix.block_hashes(A, 4)
    n, payload = src.export_blocks(hashes)
    assert n == 10 and payload.dtype == torch.uint8 and payload.numel() == 10 * src.cache.block_nbytes
    assert dst.import_blocks(hashes[:n], payload) == 10 and dst.import_blocks(hashes[:n], payload) == 0
    assert {prefix.key(x) for x in hashes} == set(dst.tier_snapshot())
    ids, t = run(dst, request("b", A))
    assert t == (1 + 10 * 0.5) / 1000  # restored, not recomputed
    assert dst.cache.by_source == {"engine": 0, "host": 0, "pulled": 39, "recomputed": 1}
    run(dst, request("c", A))  # and next time from its own cache
    assert dst.cache.by_source["engine"] == 39 and dst.cache.by_source["pulled"] == 39
    off = engine(host_mb=0)
    try:
        off.import_blocks(hashes, payload)
    except EngineError as exc:
        assert "kv_tier.host_mb" in str(exc)
    else:
        raise AssertionError("an instance without a tier took blocks")


def test_a_sessions_blocks_outlive_others_in_the_engine_until_their_deadline():
    clock = Clock()
    e = engine(host_mb=0, retain_s=30.0, clock=clock)
    keys = prefix.keys(prefix.block_hashes(A, 4))
    run(e, request("a1", A, session="s"))
    assert e.load().retained_blocks == 10
    for k in range(2):  # 20 blocks of other prompts through the 14 free besides A's
        run(e, request(f"o{k}", others(k)))
    assert e.cache.leading(keys) == 10  # A's blocks were taken last
    assert e.load().blocks_used == 0  # retained blocks are free (reclaimable)
    big = list(range(5000, 5000 + 4 * 23))  # a prompt needing nearly every block takes them too: never blocked
    run(e, request("big", big, max_tokens=1))
    assert e.cache.leading(keys) < 10
    run(e, request("a2", A, session="s"))
    clock.now = 31.0
    assert e.load().retained_blocks == 0
    for k in range(2, 5):
        run(e, request(f"o{k}", others(k)))
    assert e.cache.leading(keys) == 0  # past its deadline: an ordinary block


def test_retained_blocks_reach_the_tier_and_are_kept_there_first():
    clock = Clock()
    e = engine(host_mb=1, retain_s=30.0, clock=clock, num_blocks=12, kv_layers=1, kv_heads=32, head_dim=85)
    assert e.tier.capacity == 12
    run(e, request("a1", A, session="s"))
    for k in range(4):
        run(e, request(f"o{k}", others(k)))
    hashes = prefix.block_hashes(A, 4)
    # A's blocks outlived 44 blocks of other prompts through 12 in the engine and 12 in the tier
    assert all(x in e.tier or e.cache.leading([prefix.key(x)]) for x in hashes)
    assert e.tier.leading(hashes) >= 9
    assert e.load().retained_blocks == 10


def test_a_submits_session_and_retention_reach_the_engine_through_the_intake():
    from daemons import metrics, wire
    from daemons.instance.intake import Intake
    from daemons.instance.mailbox import Mailbox
    from daemons.instance.shared import Shared
    from daemons.instance.standing import Identity, Standing
    from daemons.instance.tokens import TokenPath
    from daemons.requests import RequestTable
    from tests.support import virtual
    from tests.unit.test_instance_parts import REPLY_TO, Sent

    clock = Clock()
    e = engine(host_mb=0, retain_s=30.0, clock=clock)
    links, requests = Sent(), RequestTable()
    shared = Shared(e, requests, Identity("i9"), Standing(), Mailbox(), metrics.RequestPhases(), lambda msg: None,
                    lambda: None, virtual.LoopClock(virtual.VirtualTimeLoop()))
    intake = Intake(shared, None, TokenPath(links, requests, Identity("i9")), links, lambda reply_to: None)
    intake.post(wire.Submit("a", A, wire.SamplingParams(max_tokens=2, ignore_eos=True), REPLY_TO, session="chat",
                            retain_s=5.0))
    intake.apply()
    while e.has_work():
        e.step()
    assert e.load().retained_blocks == 10
    clock.now = 5.0  # it asked for 5 s, not the default 30
    assert e.load().retained_blocks == 0


def test_a_migrated_turn_keeps_its_session_and_retention_on_the_destination():
    """A session's turn that moved mid-answer is retained where it ends, for what it asked, as if it had run there."""
    from tests.unit.test_migration_engine import migrate

    clock = Clock()
    src = engine(host_mb=0, retain_s=30.0, clock=clock, kv_layers=1)
    dst = engine(host_mb=0, retain_s=30.0, clock=clock, kv_layers=1)
    r = EngineRequest("a", list(A), SamplingParams(max_tokens=8, ignore_eos=True), session="chat", retain_s=5.0)
    src.add_request(r)
    src.step()  # prefilled: it runs
    moved = src.migrating_request("a")
    assert (moved.session, moved.retain_s) == ("chat", 5.0)
    migrate(src, dst, "a")
    while dst.has_work():
        dst.step()
    assert src.load().retained_blocks == 0
    assert dst.load().retained_blocks == 12  # 40 prompt tokens and 8 generated, in blocks of 4
    clock.now = 5.0  # it asked for 5 s, not the default 30
    assert dst.load().retained_blocks == 0
