"""Session dispatch and tier pricing (daemons/policy/sessions.py, through policy.place): plain values."""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from daemons import policy, wire
from daemons.policy import sessions, slo
from daemons.policy.usage import InstanceState

FIT = wire.LatencyFit(steps=50, prefill_ms=5.0, prefill_ms_per_token=0.5, decode_ms=10.0, decode_ms_per_seq=1.0,
                      chunk_tokens=2048, finish_rate=5.0)
PRICING = sessions.Pricing(affinity=True, bound=1.25, pull=True, kv_bytes_per_token=131072, link_gbps=10.0,
                           restore_gbps=40.0)
RULES = policy.Rules(sessions=PRICING)


def inst(iid: str, running: int = 0, waiting: int = 0, fit=FIT, **kw) -> InstanceState:
    return InstanceState(iid, 1024, blocks_used=running * 10, running=running, waiting=waiting, batch_size=64,
                         block_size=16, latency=fit, context_tokens=running * 160, **kw)


def ask(prompt: int, tiers=None, session: str = "", home: str = "", ttft_s: float = 0.0) -> policy.Ask:
    hits = {i: b for i, (_, b) in tiers.items()} if tiers else None
    return policy.Ask(prompt, slo=slo.RequestSlo(0, slo.Targets(ttft_s, 0.0), slo.Targets(ttft_s, 0.0)), hits=hits,
                      tiers=tiers, session=session, home=home)


# ------------------------------------------------------------------ pricing


def test_an_engine_hit_is_free_a_host_hit_costs_its_restore_a_miss_its_prefill():
    s = inst("a")
    miss = sessions.price(s, 1600, {}, PRICING)
    host = sessions.price(s, 1600, {"a": (0, 100)}, PRICING)
    engine = sessions.price(s, 1600, {"a": (100, 100)}, PRICING)
    assert engine.ttft_s < host.ttft_s < miss.ttft_s
    restore = 100 * PRICING.restore_ms_per_block(s) / 1000
    assert math.isclose(host.ttft_s - engine.ttft_s, restore, rel_tol=1e-9)
    assert (host.engine, host.host) == (0, 100) and (engine.engine, engine.host) == (100, 0)


def test_a_measured_restore_rate_replaces_the_default():
    s = inst("a", restore_ms_per_block=7.0)
    assert PRICING.restore_ms_per_block(s) == 7.0
    assert PRICING.restore_ms_per_block(inst("b")) == 16 * 131072 * 8 / 40e9 * 1000


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 200), st.integers(0, 200), st.floats(0.001, 1000.0), st.floats(0.001, 5.0))
def test_a_pull_is_chosen_only_when_shorter_than_the_prefill_it_saves(held, local, gbps, per_token_ms):
    p = replace(PRICING, link_gbps=gbps)
    s = inst("b", fit=replace_fit(prefill_ms_per_token=per_token_ms))
    local = min(local, held)
    tiers = {"a": (held, held), "b": (local, local)}
    n = sessions.pull_blocks(s, tiers, 4000, "a", held, p)
    beyond = min(held, 4000 // 16) - local
    cheaper = beyond > 0 and p.copy_ms(beyond, 16) < beyond * 16 * per_token_ms
    assert n == (beyond if cheaper else 0)
    assert sessions.pull_blocks(s, tiers, 4000, "a", held, replace(p, pull=False)) == 0


def test_the_reported_block_bytes_price_pulls_and_restores_over_the_fallback():
    """A small model's instance reports its blocks' bytes (wire.InstanceLoad block_nbytes): a pull the 8B fallback
    (131072 bytes a token) prices above its prefill is taken at the real size; restores are priced by it too."""
    small = 16 * 2048  # a tiny model's block of 16 tokens
    tiers = {"a": (100, 100)}
    slow = replace(PRICING, link_gbps=0.1)  # a slow link: 16 x 131072 B = 16.8 ms a block against 8 ms of prefill
    assert sessions.pull_blocks(inst("b"), tiers, 1600, "a", 100, slow) == 0
    assert sessions.pull_blocks(inst("b", block_nbytes=small), tiers, 1600, "a", 100, slow) == 100
    assert PRICING.restore_ms_per_block(inst("b", block_nbytes=small)) == small * 8 / 40e9 * 1000
    assert PRICING.copy_ms(10, 16, small) == 10 * small * 8 / 10e9 * 1000
    assert policy.state_of("x", wire.InstanceLoad(64, 0, 0, 0, 8, 16, block_nbytes=small)).block_nbytes == small


def replace_fit(**kw) -> wire.LatencyFit:
    import msgspec
    return msgspec.structs.replace(FIT, **kw)


def test_a_host_hit_beats_a_miss_in_the_cache_policies():
    for name in ("llumnix-cache", "slo"):
        states = [inst("a", running=2), inst("b", running=2)]
        placed = policy.place(name, states, ask(1600, {"b": (0, 100)}), 0, RULES)
        assert placed.instance_id == "b", name


def test_of_equal_hits_the_engine_one_wins_over_the_host_one():
    for name in ("llumnix-cache", "slo"):
        states = [inst("a", running=2), inst("b", running=2)]
        placed = policy.place(name, states, ask(1600, {"a": (0, 100), "b": (100, 100)}), 0, RULES)
        assert placed.instance_id == "b", name


def test_a_request_without_cache_hits_is_placed_as_before():
    states = [inst("a", running=3), inst("b", running=1), inst("c", running=2)]
    for name in policy.DISPATCH.names:
        before = policy.dispatch(name, states, 7)
        assert policy.place(name, states, ask(500), 7, RULES).instance_id == before, name


# ------------------------------------------------------------------ sessions


def test_a_sessions_turn_goes_where_its_kv_is_while_under_the_bound():
    states = [inst("a", running=2), inst("b", running=1), inst("c", running=1)]  # 2 + 1 <= ceil(1.25 * 5 / 3)
    placed = policy.place("llumnix", states, ask(1600, {"a": (90, 100)}, session="s1"), 0, RULES)
    assert (placed.instance_id, placed.how) == ("a", "affinity")
    plain = policy.place("llumnix", states, ask(1600, {"a": (90, 100)}), 0, RULES)
    assert plain.instance_id != "a"  # without a session llumnix goes by load alone


def test_a_sessions_turn_spills_past_the_bound_with_a_pull_from_its_holder():
    states = [inst("a", running=6), inst("b", running=1), inst("c", running=1)]
    placed = policy.place("llumnix", states, ask(3200, {"a": (200, 200)}, session="s1"), 0, RULES)
    assert placed.instance_id in ("b", "c")
    assert (placed.how, placed.pull_from, placed.pull_blocks) == ("pull", "a", 200)
    no_pull = policy.place("llumnix", states, ask(3200, {"a": (200, 200)}, session="s1"), 0,
                           replace(RULES, sessions=replace(PRICING, pull=False)))
    assert (no_pull.how, no_pull.pull_from, no_pull.pull_blocks) == ("spilled", "", 0)


def test_a_sessions_turn_spills_when_its_holder_is_predicted_past_its_ttft_target():
    states = [inst("a", running=1, waiting=1), inst("b", running=2), inst("c", running=2)]  # within the bound
    states[0] = replace(states[0], waiting_tokens=20000)  # a long prefill queued ahead
    tiers = {"a": (50, 50)}
    kept = policy.place("slo", states, ask(1600, tiers, session="s", ttft_s=0.0), 0, RULES)
    assert kept.instance_id == "a"
    spilled = policy.place("slo", states, ask(1600, tiers, session="s", ttft_s=1.0), 0, RULES)
    assert spilled.instance_id != "a" and spilled.how in ("spilled", "pull")


def test_a_turn_past_its_target_stays_when_no_other_instance_would_serve_it_sooner():
    """Every instance past the target: spilling would add a recompute where the turn waits as long, so it stays
    with its KV; once another instance is predicted sooner, it goes there."""
    queued = dict(waiting=1, waiting_tokens=20000)
    states = [inst("a", running=1, **queued), inst("b", running=2, **queued), inst("c", running=2, **queued)]
    tiers = {"a": (100, 100)}
    stays = policy.place("slo", states, ask(1600, tiers, session="s", ttft_s=1.0), 0, RULES)
    assert (stays.instance_id, stays.how) == ("a", "affinity")
    states[2] = inst("c", running=2)
    moves = policy.place("slo", states, ask(1600, tiers, session="s", ttft_s=1.0), 0, RULES)
    assert moves.instance_id == "c" and moves.how in ("spilled", "pull")


def test_the_baselines_do_not_follow_sessions():
    states = [inst("a", running=2), inst("b", running=0)]
    for name in ("rr", "infaas++", "flood"):
        assert not policy.DISPATCH.get(name).follows_sessions
        with_session = policy.place(name, states, ask(1600, {"a": (90, 100)}, session="s"), 3, RULES)
        assert with_session.instance_id == policy.dispatch(name, states, 3)


def test_the_sessions_last_instance_wins_a_tie_between_holders():
    states = [inst("a"), inst("b"), inst("c")]
    tiers = {"a": (40, 40), "c": (40, 40)}
    assert policy.place("llumnix", states, ask(1600, tiers, "s", home="c"), 0, RULES).instance_id == "c"
    assert policy.place("llumnix", states, ask(1600, tiers, "s", home="a"), 0, RULES).instance_id == "a"


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 8), st.floats(1.0, 3.0), st.lists(st.integers(0, 3), min_size=1, max_size=120),
       st.lists(st.integers(0, 6), min_size=8, max_size=8))
def test_no_instance_takes_more_than_bound_times_its_share_for_its_sessions(n, bound, holders, start):
    """Popular sessions, all held by a few instances, arrive one after another (each counted where it lands): an
    instance takes a turn for its KV only while that keeps it within bound x the mean, this turn counted."""
    rules = replace(RULES, sessions=replace(PRICING, bound=bound, pull=False))
    states = [inst(f"i{k}", running=start[k]) for k in range(n)]
    for turn, h in enumerate(holders):
        holder = f"i{h % n}"
        placed = policy.place("llumnix", states, ask(1600, {holder: (50, 50)}, session=f"s{turn}"), turn, rules)
        total = sum(s.batch for s in states) + 1
        j = next(k for k, s in enumerate(states) if s.instance_id == placed.instance_id)
        if placed.how == "affinity":
            assert placed.instance_id == holder
            assert states[j].batch + 1 <= math.ceil(bound * total / n)
        else:
            assert placed.how == "spilled" and placed.instance_id != holder
            assert states[[s.instance_id for s in states].index(holder)].batch + 1 > math.ceil(bound * total / n)
        states[j] = replace(states[j], pending_requests=states[j].pending_requests + 1)


@settings(max_examples=150, deadline=None)
@given(st.integers(2, 6), st.lists(st.integers(0, 4), min_size=6, max_size=6), st.integers(0, 5))
def test_affinity_holds_whenever_the_holder_is_within_the_bound(n, loads, h):
    states = [inst(f"i{k}", running=loads[k]) for k in range(n)]
    holder = f"i{h % n}"
    placed = policy.place("llumnix-cache", states, ask(1600, {holder: (50, 50)}, session="s"), 0, RULES)
    if sessions.within_bound(states, holder, RULES.sessions.bound):
        assert (placed.instance_id, placed.how) == (holder, "affinity")
    else:
        assert placed.instance_id != holder


def test_affinity_off_places_a_session_as_any_request():
    states = [inst("a", running=2), inst("b")]
    rules = replace(RULES, sessions=replace(PRICING, affinity=False))
    placed = policy.place("llumnix", states, ask(1600, {"a": (90, 100)}, session="s"), 0, rules)
    assert placed.instance_id == "b" and placed.how in ("new", "pull")
