"""The stage arithmetic of a live migration (daemons/stages.py), which the source and the simulator share,
and the keep set of an order (daemons/instance.keep_for)."""

from __future__ import annotations

from daemons import stages, wire
from daemons.instance import keep_for

BS = 16
LAST_MAX = 2  # migration.last_stage_max_blocks
MAX_STAGES = 4


def test_pre_copy_sends_full_blocks_only_and_reserves_headroom_for_the_last_stage():
    p = stages.plan(computed_tokens=100, sent_blocks=0, last=False, block_size=BS, last_stage_max_blocks=LAST_MAX)
    assert (p.first_block, p.upto, p.n_blocks) == (0, 6, 6)  # 6 full blocks of 16; the 7th is still written
    assert p.tokens == 100 + (LAST_MAX + 2) * BS and p.tail_tokens == 0
    later = stages.plan(140, p.upto, False, BS, LAST_MAX)
    assert (later.first_block, later.upto) == (6, 8)  # only what filled since


def test_the_reservation_stays_within_the_requests_own_limit():
    p = stages.plan(100, 0, False, BS, LAST_MAX, max_total=110)
    assert p.tokens == 110
    assert stages.plan(100, 0, False, BS, LAST_MAX, max_total=90).tokens == 100  # never below what is written


def test_the_last_stage_sends_the_rest_and_of_the_partial_block_only_its_written_slots_where_known():
    p = stages.plan(100, 6, True, BS, LAST_MAX)
    assert (p.first_block, p.upto, p.tokens, p.tail_tokens) == (6, 7, 100, 0)  # vLLM: the partial block whole
    slots = stages.plan(100, 6, True, BS, LAST_MAX, token_slots=True)
    assert slots.tail_tokens == 100 - 6 * BS
    assert stages.plan(96, 6, True, BS, LAST_MAX, token_slots=True).n_blocks == 0  # nothing left to send


def test_the_last_stage_comes_when_few_blocks_are_left_after_enough_stages_or_without_pre_copy():
    assert not stages.is_last(100, 0, 0, BS, LAST_MAX, MAX_STAGES)  # 7 blocks to go
    assert stages.is_last(100, 5, 1, BS, LAST_MAX, MAX_STAGES)  # 2 left
    assert stages.is_last(1000, 5, MAX_STAGES, BS, LAST_MAX, MAX_STAGES)  # the request outruns the copy
    assert stages.is_last(1000, 0, 0, BS, LAST_MAX, MAX_STAGES, blocking=True)


def test_a_balancing_order_keeps_what_arrived_within_its_cooldown_and_a_drain_keeps_only_migrating():
    balance = wire.MigrateStart(1, "i1", "tcp://x:4", reason="balance", cooldown_s=10.0)
    drain = wire.MigrateStart(1, "i1", "tcp://x:4", reason="drain", drain=True, cooldown_s=10.0)
    operator = wire.MigrateStart(1, "i1", "tcp://x:4", count=1)
    arrivals = {"new": 95.0, "old": 80.0}
    assert keep_for(balance, {"moving"}, arrivals, now=100.0) == {"moving", "new"}
    assert keep_for(drain, {"moving"}, arrivals, now=100.0) == {"moving"}
    assert keep_for(operator, set(), arrivals, now=100.0) == set()
