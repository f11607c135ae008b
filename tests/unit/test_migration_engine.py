"""The engine migration verbs on the sim engine, and the block copies they rest on.

Two SimEngines in one process stand for source and destination; the copy goes through KvBlocks the way
the transfer thread does it (gather into a staging buffer, scatter out of it), without Gloo.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from daemons.config import ModelConfig, SimConfig
from daemons.engine.base import EngineError, EngineRequest, KvBlocks
from daemons.engine.sim import SimEngine, kv_value, sim_token_id
from daemons.wire import SamplingParams

BS = 4


def sim(**kw) -> SimEngine:
    cfg = dict(block_size=BS, num_blocks=64, watermark=0.0, time_scale=0.0, eos_rate=0.0, vocab_size=1000, kv_dtype="float32")
    cfg.update(kw)
    return SimEngine(SimConfig(**cfg), ModelConfig(max_model_len=512))


def req(rid: str, prompt: int = 10, max_tokens: int = 30, priority: int = 0) -> EngineRequest:
    return EngineRequest(rid, [7] * prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), priority=priority)


def copy(src: SimEngine, dst: SimEngine, src_ids: list[int], dst_ids: list[int], tail: int = 0) -> int:
    """Copy blocks; ``tail`` > 0: of the last one only its first ``tail`` token slots (the last stage's
    partial block). Returns the bytes moved."""
    kb = src.kv_blocks()
    whole = len(src_ids) - (1 if tail and src_ids else 0)
    buf = torch.empty(max(1, len(src_ids)) * kb.block_nbytes, dtype=torch.uint8)
    kb.gather(src_ids[:whole], buf)
    dst.kv_blocks().scatter(dst_ids[:whole], buf)
    moved = whole * kb.block_nbytes
    if whole < len(src_ids):
        moved += kb.gather_tail(src_ids[-1], tail, buf)
        dst.kv_blocks().scatter_tail(dst_ids[-1], tail, buf)
    return moved


def migrate(src: SimEngine, dst: SimEngine, rid: str, steps_between: int = 1, out: list | None = None) -> int:
    """Pre-copy the full blocks, let the source step, then suspend, copy the rest, commit. Returns the
    output index the destination continues at."""
    view = src.migration_view(rid)
    full = view.computed_tokens // BS
    dst_ids = dst.reserve(src.migrating_request(rid), view.computed_tokens)
    copy(src, dst, view.block_ids[:full], dst_ids[:full])
    for _ in range(steps_between):  # decoding goes on during pre-copy
        res = src.step().outputs
        if out is not None:
            out += res
    view = src.migration_view(rid)
    if view is None:  # it finished or was preempted while pre-copying: the real source aborts here too
        raise EngineError(f"{rid} is no longer running on the source")
    state = src.suspend(rid)
    res = src.step().outputs
    assert all(o.request_id != rid for o in res)  # a suspended request does not step
    if out is not None:
        out += res
    try:
        dst_ids = dst.reserve(src.migrating_request(rid), view.computed_tokens)
    except EngineError:
        src.resume(rid)
        raise
    upto = math.ceil(view.computed_tokens / BS)
    copy(src, dst, view.block_ids[full:upto], dst_ids[full:upto], view.computed_tokens % BS)  # as the last stage
    dst.commit(rid, state)
    src.drop_migrated(rid)
    return state.emitted


def drain(e: SimEngine, out: list) -> None:
    while e.has_work():
        out += e.step().outputs


def check_kv(e: SimEngine, rid: str, tokens: int) -> None:
    """Every written position holds the sim's value for (request, position, layer)."""
    table = e.block_table(rid)
    for layer, cache in enumerate(e.kv_caches):
        for pos in range(tokens):
            k, v = kv_value(rid, pos, layer)
            got = cache[table[pos // BS], :, pos % BS]
            assert got[0].flatten()[0].item() == pytest.approx(k) and got[1].flatten()[0].item() == pytest.approx(v)


def test_last_stage_moves_only_the_written_slots_of_the_partial_block():
    """A destination block that held another request's KV keeps it past the written slots; the request
    overwrites them as it grows there, token by token, and its KV and outputs are those of an unmoved one."""
    a, b = sim(), sim()
    b.add_request(req("old", prompt=40, max_tokens=1))  # leaves its KV in b's free blocks
    drain(b, [])
    a.add_request(req("r", prompt=9, max_tokens=20))
    out = a.step().outputs  # 9 + 1 = 10 tokens: 2 full blocks and 2 slots of the third
    view = a.migration_view("r")
    assert view.computed_tokens == 10
    ids = b.reserve(a.migrating_request("r"), 10)
    stale = b.kv_caches[0][ids[2]].clone()
    state = a.suspend("r")
    kb = a.kv_blocks()
    moved = copy(a, b, view.block_ids[:3], ids, tail=2)
    assert moved == 2 * kb.block_nbytes + kb.tail_nbytes(2) and kb.tail_nbytes(2) * BS == 2 * kb.block_nbytes
    assert torch.equal(b.kv_caches[0][ids[2], :, 2:], stale[:, 2:])  # nothing written past the tail
    b.commit("r", state)
    a.drop_migrated("r")
    check_kv(b, "r", 10)
    for _ in range(4):  # through the rest of the partial block and into the next
        out += b.step().outputs
    check_kv(b, "r", 14)
    drain(b, out)
    assert [o.token_id for o in out] == [sim_token_id("r", i, 1000) for i in range(20)]


@pytest.mark.parametrize("at", [1, 2, 15, 29])
def test_migrated_request_continues_where_it_was(at):
    a, b = sim(), sim()
    a.add_request(req("r", max_tokens=30))
    a.add_request(req("other", max_tokens=30))  # a neighbour keeps running on the source
    out = []
    while len([o for o in out if o.request_id == "r"]) < at:
        out += a.step().outputs
    resumed = migrate(a, b, "r", steps_between=0 if at == 29 else 1, out=out)
    mine = [o for o in out if o.request_id == "r"]
    assert resumed == len(mine)
    check_kv(b, "r", 10 + len(mine))
    drain(b, mine)
    drain(a, out)
    assert [o.index for o in mine] == list(range(30))
    assert [o.token_id for o in mine] == [sim_token_id("r", i, 1000) for i in range(30)]
    assert mine[-1].finish_reason == "length" and all(o.finish_reason is None for o in mine[:-1])
    assert len([o for o in out if o.request_id == "other"]) == 30
    assert a.load().blocks_used == 0 and b.load().blocks_used == 0


def test_back_and_forth_three_times():
    a, b = sim(), sim()
    a.add_request(req("r", prompt=13, max_tokens=40))
    out = []
    engines = [a, b]
    for hop in range(3):
        src, dst = engines[hop % 2], engines[(hop + 1) % 2]
        for _ in range(5):
            out += src.step().outputs
        migrate(src, dst, "r", out=out)
    drain(b, out)
    assert [o.index for o in out] == list(range(40))
    assert [o.token_id for o in out] == [sim_token_id("r", i, 1000) for i in range(40)]
    assert a.load().blocks_used == b.load().blocks_used == 0


def test_priority_travels_and_only_running_high_requests_count():
    a, b = sim(), sim()
    a.add_request(req("h", max_tokens=30, priority=1))
    b.add_request(req("first", max_tokens=30))
    out = []
    out += a.step().outputs
    b.step()
    assert a.migrating_request("h").priority == 1
    assert a.load().high_priority == 1
    view = a.migration_view("h")
    ids = b.reserve(a.migrating_request("h"), view.computed_tokens)
    assert b.load().high_priority == 0  # reserved: not running yet
    a.suspend("h")
    assert a.load().high_priority == 0  # suspended: not running
    a.resume("h")
    assert a.load().high_priority == 1
    state = a.suspend("h")
    copy(a, b, view.block_ids, ids)
    b.add_request(req("later", max_tokens=30))
    b.step()  # "later" is admitted
    b.commit("h", state)
    a.drop_migrated("h")
    # Committed now: after every request admitted before, with its priority; it counts on b, not on a.
    assert [(r.request_id, r.priority) for r in b.requests()] == [("first", 0), ("later", 0), ("h", 1)]
    assert (a.load().high_priority, b.load().high_priority) == (0, 1)
    drain(b, out)
    assert [o.index for o in out if o.request_id == "h"] == list(range(30))
    assert b.load().high_priority == 0 and b.load().blocks_used == 0


def test_reserve_refuses_without_room_and_release_returns_blocks():
    a, b = sim(), sim(num_blocks=8, watermark=0.25)
    a.add_request(req("r", prompt=30))
    a.step()
    with pytest.raises(EngineError, match="no room"):
        b.reserve(a.migrating_request("r"), 31)  # 8 blocks, 2 kept by the watermark: 6 usable < 8
    assert b.load().blocks_used == 0
    ids = b.reserve(a.migrating_request("r"), 20)
    assert len(ids) == 5 and b.load().blocks_used == 5
    assert b.release("r") and not b.release("r")
    assert b.load().blocks_used == 0


def test_reservation_grows_and_keeps_its_first_blocks():
    a, b = sim(), sim()
    a.add_request(req("r"))
    a.step()
    first = b.reserve(a.migrating_request("r"), 9)
    grown = b.reserve(a.migrating_request("r"), 17)
    assert grown[:len(first)] == first and len(grown) == 5
    assert b.release("r") and b.load().blocks_used == 0


def test_suspend_resume_and_abort_while_suspended():
    e = sim()
    e.add_request(req("r", max_tokens=10))
    out = []
    out += e.step().outputs
    e.suspend("r")
    assert not e.has_work() and e.migration_view("r") is None
    assert [r.state for r in e.requests()] == ["migrating"]
    blocks = e.load().blocks_used
    assert blocks > 0  # kept while suspended
    e.resume("r")
    drain(e, out)
    assert [o.index for o in out] == list(range(10))
    e.add_request(req("s"))
    e.step()
    e.suspend("s")
    assert e.abort_request("s") and e.load().blocks_used == 0


def test_view_is_none_for_waiting_or_unknown_requests():
    e = sim()
    e.add_request(req("r"))
    assert e.migration_view("r") is None  # waiting: nothing computed, nothing to move
    assert e.migration_view("nope") is None
    with pytest.raises(KeyError):
        e.suspend("nope")


def test_request_id_in_use_is_refused():
    a, b = sim(), sim()
    a.add_request(req("r"))
    a.step()
    b.add_request(req("r"))
    with pytest.raises(EngineError, match="already in use"):
        b.reserve(a.migrating_request("r"), 11)


def test_kv_blocks_roundtrip_and_spec():
    x = [torch.randn(10, 2, 4, 3) for _ in range(3)]
    y = [torch.zeros(10, 2, 4, 3) for _ in range(3)]
    kx, ky = KvBlocks(x, "t"), KvBlocks(y, "t")
    assert kx.spec == ky.spec and kx.block_nbytes == 3 * 2 * 4 * 3 * 4
    buf = torch.empty(4 * kx.block_nbytes, dtype=torch.uint8)
    kx.gather([7, 1, 3, 9], buf)
    ky.scatter([0, 2, 4, 6], buf)
    for a, b in zip(x, y):
        assert torch.equal(b[[0, 2, 4, 6]], a[[7, 1, 3, 9]])
    with pytest.raises(ValueError, match="staging buffer"):
        kx.gather([1, 2, 3, 4, 5], buf)
    assert KvBlocks([torch.zeros(10, 2, 4, 3, dtype=torch.float16)], "t").spec != kx.spec


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["step", "add", "migrate", "abort"]), st.integers(0, 5),
                          st.sampled_from([0, 0, 1])), max_size=40))
def test_no_block_leaks_under_random_migrations(ops):
    """Whatever interleaving of steps, arrivals (normal and high priority), migrations and aborts: blocks
    return to zero at the end, no block is owned twice on either engine, a request keeps its priority
    wherever it goes, and each engine counts exactly its running high-priority requests."""
    engines = [sim(num_blocks=24, max_num_seqs=4), sim(num_blocks=24, max_num_seqs=4)]
    n = 0
    priorities: dict[str, int] = {}
    for op, k, priority in ops:
        e = engines[k % 2]
        if op == "step":
            e.step()
        elif op == "add":
            try:
                e.add_request(req(f"r{n}", prompt=1 + 3 * k, max_tokens=5 + 4 * k, priority=priority))
                priorities[f"r{n}"] = priority
            except EngineError:
                pass
            n += 1
        elif op == "migrate":
            running = [r.request_id for r in e.requests() if r.state == "running"]
            if running:
                rid = running[k % len(running)]
                try:
                    migrate(e, engines[(k + 1) % 2], rid, steps_between=k % 2)
                except (EngineError, AttributeError):  # no room there, or it finished while pre-copying
                    engines[(k + 1) % 2].release(rid)
        else:
            rows = e.requests()
            if rows:
                e.abort_request(rows[k % len(rows)].request_id)
        for x in engines:
            rows = x.requests()
            owned = [b for r in rows for b in x.block_table(r.request_id)]
            assert len(owned) == len(set(owned)) == x.load().blocks_used
            assert all(r.priority == priorities[r.request_id] for r in rows)
            assert x.load().high_priority == sum(r.state == "running" and r.priority > 0 for r in rows)
    for e in engines:
        drain(e, [])
        assert e.load().blocks_used == 0
