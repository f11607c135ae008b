"""kill -9 at each point of a request's move between instances, with real daemons on the sim engine (real
processes, ZeroMQ, Gloo, HTTP): the client's stream goes on with exactly the sim's tokens and no error (the
proxy fails over by re-prefill, or the source keeps decoding), and the survivors hold no KV block once idle.
Issue #38's kill points: the source before, during and after the copy, the destination mid-copy and
mid-stream.

Migration timeouts are a minute here: a reservation or a suspended request that is let go within seconds was
let go because the manager declared its peer dead (wire.PeerDead), not because a timeout expired. One cluster
of three instances serves every case; each kill is followed by a restart of the killed instance (same id).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from llumnixctl.lab import localcluster
from llumnixctl.main import status_json
from tests.conftest import FAST, UP_TIMEOUT_S, Cluster
from tests.streams import Stream, metric, proxy_metric, samples, wait_for

pytestmark = pytest.mark.e2e

SETS = FAST + [
    "instance.min_step_s=0.01", "manager.dispatch_policy=flood",
    "sim.prefill_ms=5000",  # x time_scale 0.1: each prefill takes 0.5 s, long enough to be killed in
    # A long prompt's ~60 blocks of 4 KiB take ~2.5 s to copy: a kill can land in the copy.
    "migration.bandwidth_limit_mbps=0.1", "migration.chunk_bytes=16384", "migration.max_decode_slowdown=0",
    "migration.timeout_s=60", "migration.dest_idle_timeout_s=60",
]
LONG = list(range(100, 1100))  # 1000 prompt tokens: 63 blocks
SHORT = list(range(100, 180))  # 80: 5 blocks


@pytest.fixture(scope="module")
def c(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("kills")
    cluster = Cluster(localcluster.up(run_dir, 3, "sim", 0, None, SETS, timeout_s=UP_TIMEOUT_S), run_dir)
    try:
        yield cluster
    finally:
        cluster.stop()


# ---------------------------------------------------------------- views (in process: the CLI costs CPU)


def rows(c) -> dict[str, dict]:
    client = c.admin()
    try:
        return {r["id"]: r for r in status_json(client.status(), c.manager)["instances"]}
    finally:
        client.close()


def holder(c, rid: str = "") -> str:
    """The instance that holds ``rid`` (or the one request in flight) now."""
    client = c.admin()
    try:
        held = [r for r in client.requests().requests if not rid or r.request_id == rid]
    finally:
        client.close()
    assert len(held) == 1, held
    return held[0].instance_id


def released(c, iid: str, role: str) -> float:
    """The moves ``iid`` gave up in ``role`` because its peer died: the manager said so (peer_dead), or (as
    destination) the copy failed first, the dead peer's connection closed (transfer_failed)."""
    address = rows(c)[iid]["metrics_address"]
    m = samples(httpx.get(f"http://{address}/metrics", timeout=10).text)
    return sum(metric(m, "llumnix_instance_migration_released_total", 0, role=role, cause=cause)
               for cause in ("peer_dead", "transfer_failed"))


def settled(c, within_s: float) -> None:
    """Every live instance idle with no block held, within ``within_s``."""
    def idle() -> bool:
        return all(r["blocks_used"] == r["running"] == r["waiting"] == r["migrating_out"] == r["migrating_in"] == 0
                   for r in rows(c).values() if r["state"] == "alive")
    wait_for(idle, within_s, f"blocks left behind: {rows(c)}", every=0.1)


def kill(c, iid: str) -> None:
    """kill -9 of ``iid``, then it starts again (same id and settings) and rejoins."""
    proc = c.proc(f"instance-{iid}")
    os.kill(proc.pid, signal.SIGKILL)
    wait_for(lambda: proc.process() is None, 10, f"{iid} did not die")
    wait_for(lambda: rows(c)[iid]["state"] == "dead", 10, f"the manager did not mark {iid} dead")


def restart(c, iid: str) -> None:
    proc = c.proc(f"instance-{iid}")
    c.spawn(proc.name, proc.argv)
    wait_for(lambda: rows(c).get(iid, {}).get("state") == "alive", 60, f"{iid} did not come back")


def others(c, iid: str) -> list[str]:
    return sorted(i for i, r in rows(c).items() if i != iid and r["state"] == "alive")


def move(c, rid: str, dst: str) -> dict:
    """The manager's answer to `llumnixctl migrate RID --to DST` (in process)."""
    from llumnixctl.main import outcome_json

    from llumnixctl.admin import AdminClient

    client = AdminClient(c.manager, timeout_s=90)
    try:
        reply = client.migrate(dst, request_id=rid)
        return {"outcomes": [outcome_json(o) for o in reply.outcomes]}
    except Exception as exc:  # the manager's error reply (the source died during the move)
        return {"error": str(exc)}
    finally:
        client.close()


class Mover(threading.Thread):
    def __init__(self, c, rid: str, dst: str):
        super().__init__(daemon=True)
        self.c, self.rid, self.dst, self.reply = c, rid, dst, None
        self.start()

    def run(self) -> None:
        self.reply = move(self.c, self.rid, self.dst)


def copying(c, s: Stream) -> tuple[str, str, Mover]:
    """Start moving ``s``'s request to another instance; return (source, destination, the move) once the
    destination has reserved blocks for it and the copy runs."""
    s.wait_tokens(3)
    src = holder(c, s.rid)
    dst = others(c, src)[0]
    mover = Mover(c, s.rid, dst)
    wait_for(lambda: rows(c)[dst]["migrating_in"] > 0 and rows(c)[dst]["blocks_used"] > 0, 10,
             "the copy did not start")
    return src, dst, mover


# ---------------------------------------------------------------- the kill points


def test_source_killed_before_the_copy_in_its_prefill(c):
    s = Stream(c.url, 120, prompt=LONG)
    wait_for(lambda: rows(c) and sum(r["waiting"] + r["running"] for r in rows(c).values()) == 1, 10, "not taken")
    src = holder(c)
    assert not s.ids  # still in its prefill
    again = proxy_metric(c.url, "llumnix_proxy_redispatches_total")
    kill(c, src)
    s.check_sim(120, prompt_tokens=len(LONG))
    assert proxy_metric(c.url, "llumnix_proxy_redispatches_total") == again + 1  # no token yet: dispatched anew
    settled(c, 10)
    restart(c, src)


def test_source_killed_during_the_copy_has_the_reservation_released_at_once(c):
    s = Stream(c.url, 250, prompt=LONG)
    src, dst, mover = copying(c, s)
    before = released(c, dst, "destination")
    kill(c, src)
    t0 = time.monotonic()
    wait_for(lambda: released(c, dst, "destination") == before + 1, 5, "the reservation was not released")
    assert time.monotonic() - t0 < 5  # migration.dest_idle_timeout_s is 60
    assert rows(c)[dst]["migrating_in"] == 0
    s.check_sim(250, prompt_tokens=len(LONG))  # continued by re-prefill
    mover.join(30)
    assert "died during the migration" in mover.reply.get("error", ""), mover.reply
    settled(c, 10)
    restart(c, src)


def test_source_killed_after_the_commit_then_destination_killed_mid_stream(c):
    """After the commit the source dies: the stream never notices. Then its new instance dies mid-stream: the
    proxy continues it on the third instance by re-prefill."""
    s = Stream(c.url, 300, prompt=SHORT)
    s.wait_tokens(3)
    src = holder(c, s.rid)
    dst = others(c, src)[0]
    reply = move(c, s.rid, dst)
    assert [o["outcome"] for o in reply["outcomes"]] == ["committed"], reply
    failovers = proxy_metric(c.url, "llumnix_proxy_failovers_total")
    kill(c, src)
    s.wait_tokens(len(s.ids) + 20)
    assert proxy_metric(c.url, "llumnix_proxy_failovers_total") == failovers  # it never noticed
    assert holder(c, s.rid) == dst
    kill(c, dst)
    s.check_sim(300, prompt_tokens=len(SHORT))
    assert proxy_metric(c.url, "llumnix_proxy_failovers_total") == failovers + 1
    settled(c, 10)
    restart(c, src)
    restart(c, dst)


def test_destination_killed_during_the_copy_keeps_the_request_decoding_at_the_source(c):
    s = Stream(c.url, 250, prompt=LONG)
    src, dst, mover = copying(c, s)
    before = released(c, src, "source")
    failovers = proxy_metric(c.url, "llumnix_proxy_failovers_total")
    kill(c, dst)
    mover.join(5)  # migration.timeout_s is 60
    assert not mover.is_alive(), "the move waited for its dead destination"
    (o,) = mover.reply["outcomes"]
    assert o["outcome"] == "aborted", o
    s.check_sim(250, prompt_tokens=len(LONG))
    assert proxy_metric(c.url, "llumnix_proxy_failovers_total") == failovers  # the source kept it
    assert released(c, src, "source") <= before + 1  # peer_dead if the manager's word came before the drop
    settled(c, 10)
    restart(c, dst)
