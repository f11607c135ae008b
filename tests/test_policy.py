from collections import Counter

import pytest
from hypothesis import given, strategies as st

from daemons.policy import Candidate, blocks_for, dispatch, freeness

cands = st.lists(
    st.builds(Candidate, instance_id=st.sampled_from([f"i{k}" for k in range(6)]),
              blocks_total=st.integers(1, 4096), usage=st.floats(0, 8192), batch_size=st.integers(1, 256),
              alive=st.booleans(), draining=st.booleans()),
    max_size=8, unique_by=lambda c: c.instance_id,
)


@given(cands, st.sampled_from(["llumnix", "rr", "flood"]), st.integers(0, 10_000))
def test_dispatch_never_picks_dead_or_draining(cs, policy, turn):
    chosen = dispatch(policy, cs, turn)
    eligible = {c.instance_id for c in cs if c.alive and not c.draining}
    assert chosen in eligible if eligible else chosen is None


@given(cands, st.integers(0, 10_000))
def test_llumnix_picks_a_freest_instance(cs, turn):
    chosen = dispatch("llumnix", cs, turn)
    eligible = [c for c in cs if c.eligible]
    if eligible:
        best = max(freeness(c.blocks_total, c.usage, c.batch_size) for c in eligible)
        pick = next(c for c in eligible if c.instance_id == chosen)
        assert freeness(pick.blocks_total, pick.usage, pick.batch_size) == pytest.approx(best)


@given(st.integers(1, 10_000), st.floats(0, 10_000), st.floats(0.001, 1000), st.integers(1, 512))
def test_freeness_falls_as_usage_grows(total, usage, more, batch):
    assert freeness(total, usage + more, batch) < freeness(total, usage, batch)


def test_ties_do_not_starve_anyone():
    cs = [Candidate(f"i{k}", 100, 10, 8) for k in range(4)]
    picks = Counter(dispatch("llumnix", cs, turn) for turn in range(400))
    assert picks == {f"i{k}": 100 for k in range(4)}


def test_round_robin_and_flood():
    cs = [Candidate(f"i{k}", 100, 90 - k, 8) for k in range(3)]
    assert [dispatch("rr", cs, t) for t in range(4)] == ["i0", "i1", "i2", "i0"]
    assert {dispatch("flood", cs, t) for t in range(5)} == {"i0"}


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown dispatch policy"):
        dispatch("best", [Candidate("i0", 1, 0, 1)], 0)


def test_blocks_for():
    assert [blocks_for(t, 16) for t in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
