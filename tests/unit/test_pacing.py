"""Pre-copy pacing (daemons/pacing.py) over plain numbers, the copy's rests on a real Gloo pair, and where
the pair's thread runs (daemons/kv/transfer.py transfer_cores)."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemons import pacing
from daemons.pacing import MIN_DUTY, Baseline, DutyPacer, rest_s


def test_baseline_is_the_median_of_quiet_steps_once_there_are_enough():
    b = Baseline(size=8)
    for s in (0.010, 0.011, 0.5):  # a prefill among decode steps does not move a median
        b.add(s)
    assert b.value() is None  # too few to judge
    b.add(0.012)
    assert b.value() == pytest.approx(0.0115)
    for _ in range(8):
        b.add(0.020)  # the window moves: old steps leave it
    assert b.value() == pytest.approx(0.020)


def test_steps_over_the_target_halve_the_duty_down_to_its_floor_and_steps_within_raise_it():
    p = DutyPacer(0.03, start=0.5)
    assert p.step(0.0120, None) == 0.5  # no baseline yet: nothing to judge by
    assert p.step(0.0120, 0.010) == 0.25  # 20% slower
    assert p.step(0.0120, 0.010) == 0.125
    for _ in range(20):
        p.step(0.0120, 0.010)
    assert p.duty == MIN_DUTY and p.over == p.steps == 22
    for _ in range(3):  # the median of the last steps decides: one fast step among slow ones is noise
        p.step(0.0101, 0.010)
    assert p.duty == pytest.approx(MIN_DUTY + 2 * pacing.INCREASE)
    for _ in range(100):
        p.step(0.0101, 0.010)
    assert p.duty == 1.0


@settings(max_examples=200, deadline=None)
@given(st.floats(0.0, 0.5), st.lists(st.floats(0.001, 0.2), max_size=40), st.floats(0.001, 0.2))
def test_duty_stays_in_bounds_and_slower_steps_never_give_more_duty(target, steps, base):
    fast, slow = DutyPacer(target), DutyPacer(target)
    for s in steps:
        fast.step(s, base)
        slow.step(s * 1.5, base)
        assert MIN_DUTY <= slow.duty <= fast.duty <= 1.0


@given(st.floats(1e-4, 1.0), st.floats(MIN_DUTY, 1.0))
def test_a_rest_makes_the_busy_time_its_duty_of_the_whole(busy, duty):
    assert busy / (busy + rest_s(busy, duty)) == pytest.approx(duty)
    assert rest_s(busy, 1.0) == 0.0


def test_the_transfer_thread_runs_off_the_engines_cores():
    from daemons.kv.transfer import transfer_cores

    assert transfer_cores({0}, [{0}]) is None  # one core: nowhere else to go
    assert transfer_cores({0, 1, 2, 3}, [{0, 1, 2, 3}, {0, 1, 2, 3}]) is None  # engine unbound: the kernel balances
    assert transfer_cores({0, 1, 2, 3}, [{0}, {1}, {0, 1, 2, 3}]) == {2, 3}  # OpenMP threads bound to 0 and 1
    assert transfer_cores({0, 1}, [{0}, {1}]) is None  # the engine has every core: stay unpinned


@pytest.fixture(scope="module")
def gloo_pair():
    torch = pytest.importorskip("torch")
    from tests.support.gloo import loopback_pair

    src, dst = loopback_pair("pacing/test")
    yield torch, src, dst
    src.close()
    dst.close()


@pytest.mark.parametrize("duty", [1.0, 0.25])
def test_a_send_with_a_duty_rests_after_each_chunk_in_proportion(gloo_pair, monkeypatch, duty):
    torch, src, dst = gloo_pair
    from daemons.kv import transfer as kvtransfer
    from daemons.kv.layout import KvBlocks

    a = torch.randint(0, 1000, (16, 2, 4, 8), dtype=torch.int16)
    b = torch.zeros_like(a)
    ka, kb = KvBlocks([a], "t"), KvBlocks([b], "t")
    ids_a, ids_b = [9, 2, 11, 5, 0, 7], [1, 3, 4, 12, 14, 6]
    rests: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(kvtransfer.time, "sleep", lambda s: (rests.append(s), real_sleep(s)))
    reads = []
    recv = dst.recv(kb, ids_b, 2)
    sent = src.send(ka, ids_a, 2, duty=lambda: reads.append(duty) or duty).result(30)
    assert recv.result(30) == sent == 6 * ka.block_nbytes
    assert torch.equal(b[ids_b], a[ids_a])
    assert len(reads) == 3  # read before every chunk
    if duty < 1:
        assert len(rests) == 3 and all(r > 0 for r in rests)
    else:
        assert rests == []  # at full duty the double buffer runs as before, no rests


@pytest.mark.parametrize("ids", [[3, 4, 5, 6, 7], [9, 2, 11, 5, 0]], ids=["one-run", "scattered"])
def test_one_message_chunks_round_trip_on_the_rows_path(gloo_pair, monkeypatch, ids):
    """The last stage's framing: each chunk one message, staged at both ends, even where a run of blocks
    could go straight out of the per-layer KV tensors (one message per layer)."""
    torch, src, dst = gloo_pair
    from daemons.kv.layout import KvBlocks
    from daemons.kv.transfer import Pair

    a = [torch.randint(0, 1000, (16, 2, 4, 8), dtype=torch.int16) for _ in range(3)]  # a tensor per layer: rows
    b = [torch.zeros_like(t) for t in a]
    ka, kb = KvBlocks(a, "t"), KvBlocks(b, "t")
    assert ka.path == "rows" and ka.direct([3, 4, 5]) is not None
    framed = []
    real = Pair._frames
    monkeypatch.setattr(Pair, "_frames", staticmethod(lambda kv, buf, n, one: framed.append(real(kv, buf, n, one))
                                                      or framed[-1]))
    dst_ids = [10, 11, 12, 13, 14]
    recv = dst.recv(kb, dst_ids, 2, one_message=True)
    sent = src.send(ka, ids, 2, one_message=True).result(30)
    assert recv.result(30) == sent == 5 * ka.block_nbytes
    assert all(torch.equal(y[dst_ids], x[ids]) for x, y in zip(a, b))
    assert len(framed) == 6 and all(len(f) == 1 for f in framed)  # 3 chunks at each end, one message each
