"""``least-requests``: each new request to the instance serving the fewest requests (running, queued, and
dispatched but not yet in its reports), no migration. A baseline that ignores KV usage, and the example of a
policy in a module of its own: this file and its test are all it takes (daemons/policy/plugins/__init__.py)."""

from __future__ import annotations

from dataclasses import dataclass

from daemons.policy.registry import DISPATCH, DispatchPolicy
from daemons.policy.usage import InstanceState


def request_share(s: InstanceState) -> float:
    """The share of the instance a new request would get, 1 / (its requests + 1): higher is freer."""
    return 1.0 / (s.batch + 1)


@dataclass(frozen=True)
class LeastRequests(DispatchPolicy):
    def scorer(self, headroom=0.0, high=False, tpot_target_s=0.0):
        return request_share


DISPATCH.register(LeastRequests("least-requests", "fewest requests (running, queued or dispatched), no migration",
                                migrates=False))
