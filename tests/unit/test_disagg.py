"""The disaggregation decision per request and the handover's destination (daemons/policy/disagg.py): pure."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from daemons import wire
from daemons.policy import disagg
from daemons.policy.usage import InstanceState

RULES = disagg.Rules(min_uncached_tokens=256, min_uncached_fraction=0.5, prefill_busy_tokens=4096)


def S(iid: str, role: str, **kw) -> InstanceState:
    return InstanceState(iid, kw.pop("blocks_total", 1000), role=role, **kw)


def test_a_long_uncached_prompt_prefills_remotely_and_a_short_one_locally():
    states = [S("p", "prefill"), S("d", "decode"), S("m", "mixed")]
    d = disagg.decide(states, 1000, None, RULES)
    assert d.remote and [s.instance_id for s in d.pool] == ["p"]
    d = disagg.decide(states, 100, None, RULES)
    assert d.decision == "local_short" and {s.instance_id for s in d.pool} == {"d", "m"}


def test_a_cache_hot_prompt_stays_where_it_is_cached():
    states = [S("p", "prefill"), S("d", "decode")]
    # 1000 tokens, 50 blocks of 16 (800 tokens) cached on the decode instance: 200 uncached < 256
    assert disagg.decide(states, 1000, {"d": 50}, RULES).decision == "local_cached"
    # 30 blocks (480) cached: 520 uncached, but under half of the prompt? no: 0.52 of it: remote
    assert disagg.decide(states, 1000, {"d": 30}, RULES).remote
    # what a prefill instance caches does not count: the decision is about the decode candidate
    assert disagg.decide(states, 1000, {"p": 60}, RULES).remote
    # cached on the decode instance, more than half of a long prompt: local
    assert disagg.decide(states, 4000, {"d": 150}, RULES).decision == "local_cached"


def test_a_busy_prefill_pool_sends_prompts_local():
    states = [S("p", "prefill", waiting_tokens=5000), S("d", "decode")]
    assert disagg.decide(states, 1000, None, RULES).decision == "local_prefill_busy"
    states = [S("p", "prefill", waiting_tokens=5000), S("p2", "prefill", waiting_tokens=100), S("d", "decode")]
    assert disagg.decide(states, 1000, None, RULES).remote  # the least loaded prefill instance decides


def test_a_ttft_target_the_prefill_pool_would_miss_sends_prompts_local():
    fit = wire.LatencyFit(steps=100, prefill_ms=5, prefill_ms_per_token=0.5, decode_ms=10, decode_ms_per_seq=0.5,
                          finish_rate=10.0)
    pre = S("p", "prefill", waiting=4, waiting_tokens=3000, latency=fit, batch_size=16)
    dec = S("d", "decode", running=4, context_tokens=2000, latency=fit, batch_size=16)
    rules = disagg.Rules(256, 0.5, 100_000, ttft_target_s=1.0)  # the queue alone is 1.5 s of prefill there
    assert disagg.decide([pre, dec], 1000, None, rules).decision == "local_prefill_busy"
    assert disagg.decide([pre, dec], 1000, None, disagg.Rules(256, 0.5, 100_000, ttft_target_s=5.0)).remote


def test_empty_pools_degrade_to_mixed_serving():
    assert disagg.decide([S("a", "mixed"), S("b", "mixed")], 5000, None, RULES).decision == "no_prefill_pool"
    d = disagg.decide([S("p", "prefill"), S("q", "prefill")], 10, None, RULES)
    assert d.decision == "no_decode_pool" and len(d.pool) == 2
    d = disagg.decide([S("p", "prefill"), S("d", "decode", draining=True)], 5000, None, RULES)
    assert d.decision == "no_decode_pool"  # a draining decode instance takes nothing


def test_the_handover_goes_to_the_freest_decode_instance_with_room_never_a_prefill_one():
    states = [S("p", "prefill"), S("p2", "prefill"), S("d1", "decode", blocks_used=600, running=10),
              S("d2", "decode", blocks_used=200, running=4), S("d3", "decode", blocks_total=40)]
    assert disagg.handover_destination(states, "p", 1000, 63) == "d2"
    assert disagg.handover_destination(states, "p", 1000, 900) is None  # nobody has room
    assert disagg.handover_destination([S("p", "prefill")], "p", 1000, 63) is None


def test_with_a_tpot_target_the_handover_goes_where_decoding_stays_fastest():
    fit = wire.LatencyFit(steps=100, prefill_ms=5, prefill_ms_per_token=0.5, decode_ms=10, decode_ms_per_seq=2.0,
                          finish_rate=10.0)
    busy = S("d1", "decode", running=12, blocks_used=100, latency=fit, batch_size=16)
    calm = S("d2", "decode", running=2, blocks_used=500, latency=fit, batch_size=16)  # fewer, longer requests
    assert disagg.handover_destination([S("p", "prefill"), busy, calm], "p", 1000, 63, tpot_target_s=0.03) == "d2"


roles = st.sampled_from(disagg.ROLES)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(roles, st.integers(0, 1000), st.integers(0, 20000), st.booleans()), min_size=0, max_size=6),
       st.integers(1, 8000))
def test_the_pool_is_never_a_wrong_role_and_never_empty_while_some_instance_takes_requests(rows, prompt):
    states = [S(f"i{k}", role, blocks_used=used, waiting_tokens=queued, draining=draining)
              for k, (role, used, queued, draining) in enumerate(rows)]
    d = disagg.decide(states, prompt, None, RULES)
    assert d.decision in disagg.DECISIONS
    assert all(s.dispatchable for s in d.pool)
    if any(s.dispatchable for s in states):
        assert d.pool, "a request must go somewhere while some instance takes requests"
    if d.remote:
        assert all(s.role == "prefill" for s in d.pool)
    elif d.decision != "no_decode_pool":
        assert all(s.role != "prefill" for s in d.pool)
    dst = disagg.handover_destination(states, "i0", prompt, 4)
    assert dst is None or next(s for s in states if s.instance_id == dst).role != "prefill"
