"""A migration to an instance that was killed and started again under the same id (on a new port, as
auto-scaling or systemd brings it back) commits at the first try: the source makes a new KV pair for the new
process rather than sending over the Gloo pair it had with the old one (which failed: "Connection closed by
peer", seen in the 2-hour soak)."""

from __future__ import annotations

import os
import signal

import pytest

from tests.e2e.test_e2e_migration import move, where
from tests.streams import Stream, wait_for

pytestmark = pytest.mark.e2e


def test_a_migration_to_a_restarted_peer_makes_a_new_pair_and_commits(start_cluster):
    c = start_cluster(2, ["instance.min_step_s=0.02", "manager.dispatch_policy=flood"])  # flood: all on i0
    s = Stream(c.url, 150, prompt="x " * 40)
    s.wait_tokens(3)
    assert where(c, s.rid) == "i0"
    assert move(c, s.rid, "i1")["outcome"] == "committed"  # the i0 > i1 pair now exists
    s.check_sim(150)

    old = c.proc("instance-i1")
    address = next(i["request_address"] for i in c.status()["instances"] if i["id"] == "i1")
    os.kill(old.pid, signal.SIGKILL)
    wait_for(lambda: old.process() is None, 10)
    c.spawn("instance-i1", old.argv)  # port 0: a new address
    wait_for(lambda: any(i["id"] == "i1" and i["state"] == "alive" and i["request_address"] != address
                         for i in c.status()["instances"]), 30, "i1 did not come back")

    s = Stream(c.url, 150, prompt="x " * 40)
    s.wait_tokens(3)
    assert where(c, s.rid) == "i0"
    out = move(c, s.rid, "i1")
    assert out["outcome"] == "committed", out
    s.check_sim(150)
