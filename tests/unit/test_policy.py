"""The pure scheduling policies, with plain values and property tests."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
from hypothesis import given, settings, strategies as st

from daemons import config, policy
from daemons.policy import (INF, InstanceState, Scaler, blocks_for, dispatch, dispatch_batch, fading_credit, freeness,
                            instance_freeness, move_lowers_potential, pair, potential, real_freeness, select_migrants,
                            virtual_usage)
from daemons.wire import RequestLoad

IDS = [f"i{k}" for k in range(6)]
HEADROOMS = st.sampled_from([0.0, 0.05, 0.2])

an_instance = st.builds(InstanceState, instance_id=st.sampled_from(IDS), blocks_total=st.integers(1, 4096),
                        blocks_used=st.integers(0, 4096), running=st.integers(0, 64), waiting=st.integers(0, 16),
                        hol_demand=st.integers(0, 512), high_priority=st.integers(0, 4), pending_blocks=st.integers(0, 64),
                        pending_requests=st.integers(0, 4), alive=st.booleans(), draining=st.booleans(),
                        cordoned=st.booleans(), credit=st.floats(0, 512), migrations=st.integers(0, 3))
states = st.lists(an_instance, max_size=8, unique_by=lambda s: s.instance_id)
# Lists with at least one instance that takes requests (the first, made so): a random state takes requests
# one time in eight, so filtering for one would discard most examples (Hypothesis's filter_too_much check).
serving_states = st.lists(an_instance, min_size=1, max_size=8, unique_by=lambda s: s.instance_id).map(
    lambda ss: [dataclasses.replace(ss[0], alive=True, draining=False, cordoned=False)] + ss[1:])


def test_policy_names_match_the_config():
    fields = {f"{sec}.{f.name}": f for sec, cls in config.sections() for f in dataclasses.fields(cls)}
    assert fields["manager.dispatch_policy"].metadata["choices"] == policy.DISPATCH.names
    assert fields["scheduling.pairing_policy"].metadata["choices"] == policy.PAIRING.names
    assert fields["scheduling.request_selection"].metadata["choices"] == policy.SELECTION.names
    assert fields["scaling.policy"].metadata["choices"] == policy.SCALING.names


# ---------------------------------------------------------------- virtual usage and freeness


@given(st.integers(1, 10_000), st.floats(0, 10_000), st.floats(0.001, 1000), st.integers(1, 512))
def test_freeness_falls_as_usage_grows(total, usage, more, batch):
    assert freeness(total, usage + more, batch) < freeness(total, usage, batch)


@given(states, HEADROOMS, st.integers(1, 100))
def test_every_kind_of_usage_lowers_freeness(ss, headroom, more):
    for s in ss:
        if s.draining:
            assert virtual_usage(s, headroom) == INF and instance_freeness(s, headroom) == -INF
            continue
        f = instance_freeness(s, headroom)
        assert instance_freeness(dataclasses.replace(s, blocks_used=s.blocks_used + more), headroom) < f
        assert instance_freeness(dataclasses.replace(s, hol_demand=s.hol_demand + more), headroom) < f
        if headroom:
            assert instance_freeness(dataclasses.replace(s, high_priority=s.high_priority + 1), headroom) < f
        assert instance_freeness(dataclasses.replace(s, draining=True), headroom) < f


def test_virtual_usage_terms():
    s = InstanceState("i0", 1000, blocks_used=100, running=4, waiting=1, hol_demand=50, high_priority=2,
                      pending_blocks=10, pending_requests=1, credit=30)
    assert virtual_usage(s, 0.1) == 100 + 10 + 50 + 2 * 100 - 30
    assert instance_freeness(s, 0.1) == pytest.approx((1000 - 330) / 6)
    assert real_freeness(s) == pytest.approx((1000 - 110) / 6)


def test_credit_fades_to_zero():
    values = [fading_credit(500.0, t, 10.0) for t in (0, 2.5, 5, 9.9, 10, 50)]
    assert values[0] == 500 and values[-2:] == [0.0, 0.0]
    assert values == sorted(values, reverse=True)


def test_potential_and_moves():
    assert potential([(100, 1000), (0, 1000)]) == pytest.approx(10.0)
    assert move_lowers_potential(100, 1000, 0, 1000, 40, 40)
    assert not move_lowers_potential(100, 1000, 0, 1000, 100, 100)  # just swaps the two: no better
    assert not move_lowers_potential(50, 1000, 50, 1000, 1, 1)
    assert move_lowers_potential(INF, 1000, 900, 1000, 500, 500)  # out of a draining instance, always


# ---------------------------------------------------------------- dispatch


@given(states, st.sampled_from(policy.DISPATCH.names), st.integers(0, 10_000), HEADROOMS)
def test_dispatch_never_picks_dead_draining_or_cordoned(ss, name, turn, headroom):
    chosen = dispatch(name, ss, turn, headroom)
    eligible = {s.instance_id for s in ss if s.alive and not s.draining and not s.cordoned}
    assert chosen in eligible if eligible else chosen is None


@given(serving_states, st.integers(0, 10_000), HEADROOMS)
def test_llumnix_picks_the_freest_by_virtual_usage_and_infaas_by_real_usage(ss, turn, headroom):
    eligible = [s for s in ss if s.dispatchable]
    for name, score in (("llumnix", lambda s: instance_freeness(s, headroom)), ("infaas++", real_freeness)):
        pick = next(s for s in eligible if s.instance_id == dispatch(name, ss, turn, headroom))
        assert score(pick) == pytest.approx(max(score(s) for s in eligible))


@pytest.mark.parametrize("name", ["llumnix", "infaas++", "rr"])
def test_ties_do_not_starve_anyone(name):
    ss = [InstanceState(f"i{k}", 100, blocks_used=10, running=8) for k in range(4)]
    picks = Counter(dispatch(name, ss, turn) for turn in range(400))
    assert picks == {f"i{k}": 100 for k in range(4)}


def test_a_burst_spreads_over_equal_instances():
    ss = [InstanceState(f"i{k}", 1000, blocks_used=100, running=4) for k in range(4)]
    picks = Counter(dispatch_batch("llumnix", ss, [(0, 64)] * 40, turn=7))
    assert picks == {f"i{k}": 10 for k in range(4)}


@given(states, st.sampled_from(policy.DISPATCH.names), st.integers(0, 10_000), HEADROOMS, st.floats(0, 0.999))
def test_a_start_still_picks_a_freest_eligible_instance(ss, name, turn, headroom, start):
    eligible = [s for s in ss if s.dispatchable]
    chosen = dispatch(name, ss, turn, headroom, start=start)
    assert (chosen is None) == (not eligible)
    if eligible and name in ("llumnix", "infaas++"):
        score = (lambda s: instance_freeness(s, headroom)) if name == "llumnix" else real_freeness
        pick = next(s for s in eligible if s.instance_id == chosen)
        assert score(pick) == pytest.approx(max(score(s) for s in eligible))


def _proxies_burst(n_instances: int, n_proxies: int, each: int, base: float) -> Counter:
    """Proxies that see the same idle instances and only their own dispatches, each placing ``each`` requests
    with evenly spaced starts: where the burst lands."""
    landed = Counter()
    for rank in range(n_proxies):
        mine = Counter()
        for turn in range(each):
            ss = [InstanceState(f"i{k:02d}", 1000, pending_blocks=4 * mine[f"i{k:02d}"],
                                pending_requests=mine[f"i{k:02d}"]) for k in range(n_instances)]
            iid = dispatch("llumnix", ss, turn, start=(base + rank / n_proxies) % 1.0)
            mine[iid] += 1
        landed.update(mine)
    return landed


@settings(max_examples=60)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 2), st.floats(0, 0.999))
def test_proxies_with_spaced_starts_fan_a_burst_out_evenly(per_proxy, n_proxies, rounds, base):
    # Each proxy fills its own stretch of the instances first: with no shared view at all, a burst of any
    # whole number of rounds lands evenly.
    n = per_proxy * n_proxies
    assert _proxies_burst(n, n_proxies, per_proxy * rounds, base) == {f"i{k:02d}": rounds for k in range(n)}


def test_proxies_with_one_start_herd():
    # What the starts prevent: proxies that break ties alike all pick the same instances.
    landed = Counter()
    for _ in range(4):
        ss = [InstanceState(f"i{k}", 1000) for k in range(4)]
        landed[dispatch("llumnix", ss, 1)] += 1
    assert landed == {"i1": 4}


def test_round_robin_and_flood():
    ss = [InstanceState(f"i{k}", 100, blocks_used=90 - k, running=8) for k in range(3)]
    assert [dispatch("rr", ss, t) for t in range(4)] == ["i0", "i1", "i2", "i0"]
    assert {dispatch("flood", ss, t) for t in range(5)} == {"i0"}


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown dispatch policy"):
        dispatch("best", [InstanceState("i0", 1)], 0)
    with pytest.raises(ValueError, match="unknown request selection policy"):
        select_migrants("best", [], 1, src_usage=0, src_blocks=1, dst_usage=0, dst_blocks=1, headroom=0, block_size=16)


@given(serving_states, st.lists(st.tuples(st.sampled_from([0, 1]), st.integers(1, 2000)), min_size=1, max_size=12),
       st.integers(0, 1000), HEADROOMS)
def test_batch_dispatch_serves_higher_priority_first(ss, requests, turn, headroom):
    chosen = dispatch_batch("llumnix", ss, requests, turn, headroom)
    assert all(c is not None for c in chosen)
    # The first high-priority request (wherever it stands in the batch) gets an instance that was freest
    # before anything in the batch was placed (headroom does not repel high-priority requests).
    highs = [i for i, (p, _) in enumerate(requests) if p == 1]
    if highs:
        best = max(instance_freeness(s, 0.0) for s in ss if s.dispatchable)
        pick = next(s for s in ss if s.instance_id == chosen[highs[0]])
        assert instance_freeness(pick, 0.0) == pytest.approx(best)


def _batch_one_by_one(policy_name, ss, requests, turn, headroom):
    """The definition dispatch_batch must agree with: one dispatch per request, earlier ones counted."""
    from dataclasses import replace as _replace

    by_id = {s.instance_id: s for s in ss}
    order = sorted(range(len(requests)), key=lambda i: -requests[i][0])
    chosen = [None] * len(requests)
    for k, i in enumerate(order):
        iid = dispatch(policy_name, list(by_id.values()), turn + k, headroom, requests[i][0])
        chosen[i] = iid
        if iid is not None:
            s = by_id[iid]
            by_id[iid] = _replace(s, pending_blocks=s.pending_blocks + blocks_for(requests[i][1], s.block_size),
                                  pending_requests=s.pending_requests + 1)
    return chosen


@given(states, st.sampled_from(policy.DISPATCH.names),
       st.lists(st.tuples(st.sampled_from([0, 1]), st.integers(1, 2000)), min_size=1, max_size=20),
       st.integers(0, 1000), HEADROOMS)
def test_batch_dispatch_is_one_dispatch_per_request(ss, name, requests, turn, headroom):
    assert dispatch_batch(name, ss, requests, turn, headroom) == _batch_one_by_one(name, ss, requests, turn, headroom)


def test_headroom_keeps_normal_requests_away_and_gathers_high_ones():
    a = InstanceState("a", 1000, blocks_used=100, running=4, high_priority=1)  # runs a high-priority request
    b = InstanceState("b", 1000, blocks_used=300, running=6)
    assert dispatch("llumnix", [a, b], 0, headroom=0.5) == "b"  # normal: a looks half full
    assert dispatch("llumnix", [a, b], 0, headroom=0.5, priority=1) == "a"  # high: where normal load is light
    assert dispatch("llumnix", [a, b], 0, headroom=0.0) == "a"


def test_blocks_for():
    assert [blocks_for(t, 16) for t in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


# ---------------------------------------------------------------- pairing and selection


@st.composite
def clusters(draw, equal_size: bool = False):
    """Instances with the requests they hold: each state agrees with its request list."""
    n = draw(st.integers(2, 6))
    size = draw(st.integers(64, 2048))
    out = []
    for k in range(n):
        total = size if equal_size else draw(st.integers(64, 2048))
        reqs = []
        used = 0
        for j in range(draw(st.integers(0, 12))):
            blocks = draw(st.integers(1, max(1, total // 8)))
            if used + blocks > total:
                break
            used += blocks
            reqs.append(RequestLoad(f"r{k}-{j}", "running", blocks, blocks * 16 - 8, 8, draw(st.sampled_from([0, 0, 1]))))
        waiting = draw(st.integers(0, 2))
        reqs += [RequestLoad(f"w{k}-{j}", "waiting", 0, draw(st.integers(1, 2000)), 0, 0) for j in range(waiting)]
        hol = blocks_for(reqs[-1].prompt_tokens + 1, 16) if waiting else 0
        state = InstanceState(f"i{k}", total, blocks_used=used, running=len(reqs) - waiting, waiting=waiting,
                              hol_demand=hol, high_priority=sum(1 for r in reqs if r.state == "running" and r.priority),
                              alive=draw(st.booleans()) or k == 0, draining=draw(st.booleans()) and k > 0 and draw(st.booleans()),
                              cordoned=draw(st.booleans()) and draw(st.booleans()), migrations=draw(st.integers(0, 2)))
        out.append((state, reqs))
    return out


THRESHOLDS = st.tuples(st.sampled_from([-INF, 0.0, 4.0, 50.0, INF]), st.sampled_from([-INF, 0.0, 16.0, 100.0]))


@settings(max_examples=300)
@given(clusters(), HEADROOMS, THRESHOLDS, st.integers(1, 3), st.booleans(), st.integers(0, 100))
def test_pairing_invariants(cluster, headroom, thresholds, k, balance, turn):
    ss = [s for s, _ in cluster]
    out_thr, in_thr = thresholds
    by_id = {s.instance_id: s for s in ss}
    pairs = pair(ss, headroom, out_thr, in_thr, k, balance, turn)
    seen = [x for p in pairs for x in (p.src, p.dst)]
    assert len(seen) == len(set(seen)), "an instance in two pairs"
    for p in pairs:
        src, dst = by_id[p.src], by_id[p.dst]
        assert p.src != p.dst
        assert instance_freeness(src, headroom) < instance_freeness(dst, headroom), "source freer than its destination"
        assert src.alive and src.busy and dst.dispatchable
        assert 1 <= p.count <= k - max(src.migrations, dst.migrations)
        assert p.drain == src.draining
        if not src.draining:
            assert balance and instance_freeness(src, headroom) < out_thr and instance_freeness(dst, headroom) > in_thr


def by_rid_blocks(reqs: list[RequestLoad], chosen) -> list[int]:
    blocks = {r.request_id: r.blocks for r in reqs}
    return [blocks[c.request_id] for c in chosen]


def _apply(state: InstanceState, r: RequestLoad, sign: int) -> InstanceState:
    return dataclasses.replace(state, blocks_used=state.blocks_used + sign * r.blocks, running=state.running + sign,
                               high_priority=state.high_priority + sign * (r.priority > 0))


# first-waiting re-dispatches queued requests first: not migrations, and what they change on the source
# depends on which request heads its queue next (test_selection_orders covers them).
@settings(max_examples=300)
@given(clusters(equal_size=True), HEADROOMS, st.sampled_from(["llumnix", "last-running", "longest"]), st.integers(1, 4))
def test_each_chosen_migration_lowers_the_imbalance(cluster, headroom, selection, k):
    ss = {s.instance_id: s for s, _ in cluster}
    reqs = {s.instance_id: r for s, r in cluster}
    for p in pair(list(ss.values()), headroom, INF, -INF, k):  # every instance may be a source and a destination
        src = ss[p.src]
        chosen = select_migrants(selection, reqs[p.src], p.count, src_usage=p.src_usage, src_blocks=src.blocks_total,
                                 dst_usage=p.dst_usage, dst_blocks=p.dst_blocks, headroom=headroom, block_size=16,
                                 drain=p.drain, dst_free=p.dst_free)
        moves = [c for c in chosen if not c.redispatch]
        assert len(moves) <= p.count
        assert sum(by_rid_blocks(reqs[p.src], moves)) + 4 * len(moves) <= p.dst_free  # it has the room
        by_rid = {r.request_id: r for r in reqs[p.src]}
        for c in chosen:
            r = by_rid[c.request_id]
            if c.redispatch:  # a drain gives its never-started queued requests back
                assert p.drain and r.state == "waiting" and r.output_tokens == 0
                continue
            assert r.state == "running"
            before = [virtual_usage(s, headroom) for s in ss.values() if not s.draining]
            was_src = virtual_usage(ss[p.src], headroom)
            ss[p.src], ss[p.dst] = _apply(ss[p.src], r, -1), _apply(ss[p.dst], r, +1)
            after = [virtual_usage(s, headroom) for s in ss.values() if not s.draining]
            if not math.isinf(was_src):
                assert sum(v * v for v in after) < sum(v * v for v in before), f"{c} raised sum V^2"


def test_selection_orders():
    reqs = [RequestLoad("a", "running", 10, 100, 5, 0), RequestLoad("b", "running", 3, 40, 2, 1),
            RequestLoad("c", "running", 5, 60, 9, 0), RequestLoad("q", "waiting", 0, 30, 0, 0),
            RequestLoad("p", "preempted", 0, 30, 4, 0)]
    common = dict(src_usage=INF, src_blocks=100, dst_usage=0, dst_blocks=100, headroom=0.1, block_size=16, drain=True)

    def ids(name, count=10, **kw):
        return [c.request_id for c in select_migrants(name, reqs, count, **{**common, **kw})]

    assert ids("llumnix") == ["q", "c", "a", "b"]  # a drain gives queued ones back; normal before high, then fewer blocks
    assert ids("llumnix", count=1) == ["q", "c"]  # giving back is not counted against the migrations
    assert ids("longest") == ["q", "a", "c", "b"]
    assert ids("last-running") == ["q", "c", "b", "a"]
    assert ids("first-waiting") == ["q", "c", "a", "b"]  # the never-started queued one is re-dispatched first
    assert ids("first-waiting", count=2, drain=False, src_usage=100.0) == ["q", "c"]  # balancing: counted
    assert ids("llumnix", count=2) == ["q", "c", "a"]
    assert ids("llumnix", exclude={"c", "q"}) == ["a", "b"]
    # Balancing (no drain): only moves that lower the pair's potential. Source 20 blocks used, destination 10:
    # moving 3 or 5 helps, moving 10 would just swap them.
    balance = dict(src_usage=20.0, dst_usage=10.0, headroom=0.0, drain=False)
    assert ids("llumnix", **balance) == ["c"]  # then 15 vs 15: nothing more helps
    assert ids("llumnix", dst_free=16) == ["q", "c", "b"]  # 5 + 4 fits, 10 + 4 no longer does, 3 + 4 still does
    assert ids("llumnix", dst_free=8) == ["q", "b"]


def test_selection_weighs_the_blocks_that_would_move():
    """With prefix caching, a request whose prompt the destination holds costs only what it lacks."""
    reqs = [RequestLoad("long-shared", "running", 10, 300, 5, 0), RequestLoad("short", "running", 3, 40, 2, 0),
            RequestLoad("mid", "running", 5, 60, 9, 0)]
    common = dict(src_usage=INF, src_blocks=100, dst_usage=0, dst_blocks=100, headroom=0.1, block_size=32, drain=True)

    def ids(count, **kw):
        return [c.request_id for c in select_migrants("llumnix", reqs, count, **{**common, **kw})]

    assert ids(1) == ["short"]  # nothing cached: fewest blocks first
    assert ids(1, cached={"long-shared": 9}) == ["long-shared"]  # 1 block to move, not 10
    assert ids(3, cached={"mid": 3}) == ["mid", "short", "long-shared"]  # 2, 3 and 10 blocks to move
    assert ids(3, cached={"long-shared": 50}) == ["long-shared", "short", "mid"]  # never below zero
    # Room at the destination counts only the blocks that move (plus the copy headroom of 4).
    assert ids(3, dst_free=6) == []
    assert ids(3, dst_free=6, cached={"long-shared": 9}) == ["long-shared"]
    # Other orders do not change: longest frees the most, whatever moves.
    assert [c.request_id for c in select_migrants("longest", reqs, 1, **common, cached={"short": 2})] == ["long-shared"]


# ---------------------------------------------------------------- scaling


def _scaler(**kw) -> Scaler:
    args = dict(up_threshold=4.0, down_threshold=100.0, sustain_s=5.0, cooldown_s=10.0, min_instances=1, max_instances=3)
    return Scaler(**{**args, **kw})


def test_scaler_needs_a_sustained_signal_and_keeps_its_cooldown():
    s = _scaler()
    assert [s.observe(t, 2.0, 1, 0) for t in (0, 2, 4.9)] == [None, None, None]
    assert s.observe(5.0, 2.0, 1, 0) == "up"
    assert s.observe(6.0, 2.0, 2, 0) is None  # sustain starts over, and the cooldown runs
    assert s.observe(11.0, 2.0, 2, 0) is None
    assert s.observe(15.5, 2.0, 2, 0) == "up"
    assert s.observe(40.0, 2.0, 3, 0) is None and s.observe(50.0, 2.0, 3, 0) is None  # at max_instances
    assert s.observe(60.0, 50.0, 3, 0) is None  # inside the band: nothing
    assert [s.observe(t, 500.0, 3, 0) for t in (61, 65.9, 66)] == [None, None, "down"]


def test_scaler_adds_at_once_below_min_and_never_removes_below_it():
    s = _scaler(min_instances=2, not_before=-1.0)
    assert s.observe(0.0, None, 1, 0) == "up"
    assert s.observe(1.0, None, 1, 1) is None  # one is launching
    assert s.observe(2.0, None, 1, 0) is None  # it failed: try again after the cooldown, not at every tick
    assert s.observe(10.0, None, 1, 0) == "up"
    assert [s.observe(t, 1e6, 2, 0) for t in (20, 30, 40)] == [None, None, None]


def test_scaler_gives_a_starting_cluster_time_to_register():
    s = _scaler(min_instances=2, not_before=30.0)
    assert [s.observe(t, None, 0, 0) for t in (0.0, 10.0, 29.0)] == [None, None, None]
    assert s.observe(30.0, None, 1, 0) == "up"


@settings(max_examples=200)
@given(st.lists(st.floats(0, 300), min_size=1, max_size=60), st.integers(1, 3), st.integers(0, 4))
def test_scaling_stays_within_min_and_max(signal, lo, span):
    hi = lo + span
    s = _scaler(min_instances=lo, max_instances=hi, sustain_s=1.0, cooldown_s=0.0)
    n = lo
    for t, avg in enumerate(signal):
        d = s.observe(float(t), avg, n, 0)
        n += {"up": 1, "down": -1, None: 0}[d]
        assert lo <= n <= hi


def test_scale_in_victim_is_the_freest():
    ss = [InstanceState("i0", 100, blocks_used=50, running=5), InstanceState("i1", 100, blocks_used=5, running=1),
          InstanceState("i2", 100, running=0, draining=True)]
    assert policy.scale_in_victim(ss) == "i1"
    # A new instance's credit does not make it the victim; a cordoned one still serves and counts.
    ss[0] = dataclasses.replace(ss[0], credit=1000.0, cordoned=True)
    assert policy.scale_in_victim(ss) == "i1"
    assert len(policy.scaling.serving(ss)) == 2
    assert policy.average_freeness(ss) == pytest.approx(((100 - 50) / 5 + (100 - 5) / 1) / 2)
    # A scale-in protected instance is never the victim, however free; it still counts as serving.
    ss[1] = dataclasses.replace(ss[1], scale_in_protected=True)
    assert policy.scale_in_victim(ss) == "i0" and len(policy.scaling.serving(ss)) == 2
    ss[0] = dataclasses.replace(ss[0], scale_in_protected=True)
    assert policy.scale_in_victim(ss) is None


# ---------------------------------------------------------------- llumnix-cache


def _cache_pick(states, hits, band=0.5, floor=6.0, turn=0):
    return dispatch("llumnix-cache", states, turn, hits=hits, cache_band=band, cache_floor=floor)


def test_llumnix_cache_is_llumnix_when_nothing_is_cached():
    ss = [InstanceState(f"i{k}", 1000, blocks_used=100 * k, running=k) for k in range(4)]
    for turn in range(8):
        assert _cache_pick(ss, None, turn=turn) == dispatch("llumnix", ss, turn)
        assert _cache_pick(ss, {}, turn=turn) == dispatch("llumnix", ss, turn)


def test_the_cache_decides_among_instances_free_enough_and_load_decides_otherwise():
    ss = [InstanceState("i0", 1000, blocks_used=500, running=10), InstanceState("i1", 1000, blocks_used=480, running=10),
          InstanceState("i2", 1000, blocks_used=400, running=10)]
    assert dispatch("llumnix", ss, 0) == "i2"  # the freest: 60 blocks a request
    assert _cache_pick(ss, {"i0": 24}) == "i0"  # 50 >= half of 60: free enough, and it holds the prefix
    assert _cache_pick(ss, {"i0": 24, "i1": 30}) == "i1"  # the most of the request wins
    assert _cache_pick(ss, {"i0": 24, "i1": 24}) == "i1"  # a tie: the freer
    ss[0] = dataclasses.replace(ss[0], running=30)  # i0 busier: (1000 - 500) / 30 < 30
    assert _cache_pick(ss, {"i0": 24}) == "i2"
    assert _cache_pick(ss, {"i0": 24}, band=0.2) == "i0"


def test_a_hot_instance_is_not_chosen_for_its_cache_while_another_has_room():
    ss = [InstanceState("i0", 1000, blocks_used=960, running=10), InstanceState("i1", 1000, blocks_used=900, running=10)]
    # i0's freeness is 4, below the floor of 6 while i1 has 10: however much it caches, load decides.
    assert _cache_pick(ss, {"i0": 1000}, band=0.0) == "i1"
    assert _cache_pick(ss, {"i0": 1000}, band=0.0, floor=3.0) == "i0"


def test_when_every_instance_is_overloaded_the_cache_still_decides_within_the_band():
    # Freeness -1, -1.5 and -4 (the head of each queue does not fit): the band is measured on the deficit.
    ss = [InstanceState("i0", 1000, blocks_used=990, running=10, waiting=5, hol_demand=20),
          InstanceState("i1", 1000, blocks_used=995, running=10, waiting=5, hol_demand=20),
          InstanceState("i2", 1000, blocks_used=1000, running=10, waiting=9, hol_demand=40)]
    assert dispatch("llumnix", ss, 0) == "i0"
    assert _cache_pick(ss, {"i1": 24}) == "i1"  # -1.5 >= -1 - 0.5 * 1
    assert _cache_pick(ss, {"i2": 24}) == "i0"  # -4 is too far behind
    assert _cache_pick(ss, {"i2": 24}, band=0.0) == "i0"  # -4 < -1 - 1 * 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 40), st.integers(0, 60), st.integers(0, 300)),
                min_size=1, max_size=6),
       st.floats(0, 1), st.floats(0, 20))
def test_a_cache_choice_is_free_enough_and_holds_the_most_of_those(rows, band, floor):
    states = [InstanceState(f"i{k}", 1000, blocks_used=used, running=batch, waiting=1 if hol else 0, hol_demand=hol)
              for k, (used, batch, _, hol) in enumerate(rows)]
    hits = {f"i{k}": h for k, (_, _, h, _) in enumerate(rows)}
    chosen = _cache_pick(states, hits, band, floor)
    f = {s.instance_id: policy.instance_freeness(s, 0.0) for s in states}
    best = max(f.values())
    limit = best - (1 - band) * abs(best)
    if best >= floor:
        limit = max(limit, floor)
    enough = [i for i in f if f[i] >= limit and hits[i] > 0]
    if not enough:
        assert chosen == dispatch("llumnix", states, 0)
    else:
        assert chosen in enough and hits[chosen] == max(hits[i] for i in enough)
