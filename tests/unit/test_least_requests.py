"""The least-requests dispatch policy (daemons/policy/plugins/least_requests.py): registered from its own module,
it sends each request to the instance serving the fewest, counting dispatches not yet reported, and never
migrates."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from daemons import policy
from daemons.config import Config
from daemons.policy import InstanceState, dispatch, dispatch_batch
from daemons.policy.plugins.least_requests import request_share

instances = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(0, 10), st.booleans()),
                     min_size=1, max_size=8)


def _states(rows) -> list[InstanceState]:
    return [InstanceState(f"i{k}", 1000, blocks_used=10 * r, running=r, waiting=w, pending_requests=p, draining=d)
            for k, (r, w, p, d) in enumerate(rows)]


def test_it_is_a_choice_of_the_setting_and_never_migrates():
    p = policy.DISPATCH.get("least-requests")
    assert "least-requests" in policy.DISPATCH.names and policy.DISPATCH.default.name == "llumnix"
    assert not p.migrates and not p.prefix_aware
    cfg = Config()
    cfg.manager.dispatch_policy = "least-requests"
    assert policy.DISPATCH.get(cfg.manager.dispatch_policy) is p
    assert "least-requests (fewest requests" in policy.DISPATCH.described("where new requests go")


@given(instances, st.integers(0, 1000))
def test_it_picks_an_eligible_instance_with_the_fewest_requests(rows, turn):
    ss = _states(rows)
    chosen = dispatch("least-requests", ss, turn)
    eligible = [s for s in ss if s.dispatchable]
    if not eligible:
        assert chosen is None
        return
    fewest = min(s.batch for s in eligible)
    assert next(s for s in ss if s.instance_id == chosen).batch == fewest


def test_it_ignores_kv_usage_and_counts_dispatches_not_yet_reported():
    ss = [InstanceState("i0", 1000, blocks_used=900, running=2), InstanceState("i1", 1000, blocks_used=10, running=3),
          InstanceState("i2", 1000, running=1, pending_requests=2)]
    assert dispatch("least-requests", ss, 0) == "i0"
    assert dispatch("llumnix", ss, 0) != "i0"
    assert request_share(ss[0]) > request_share(ss[1]) == request_share(ss[2])


def test_ties_rotate_and_a_burst_spreads():
    ss = [InstanceState(f"i{k}", 100, running=4) for k in range(4)]
    assert Counter(dispatch("least-requests", ss, turn) for turn in range(40)) == {f"i{k}": 10 for k in range(4)}
    assert Counter(dispatch_batch("least-requests", ss, [(0, 16)] * 40, turn=3)) == {f"i{k}": 10 for k in range(4)}
