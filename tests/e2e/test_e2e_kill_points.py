"""kill -9 at each point of a handover, with real daemons on the sim engine (real processes, ZeroMQ, Gloo,
HTTP), on one prefill + one decode + one spare decode instance (`llumnixctl up --roles prefill,decode,decode`):
the prefill instance before, during and after the handover, the decode instance during it and mid-stream
(issue #38, "failures lose nothing and strand nothing"). The client's stream goes on with exactly the sim's
tokens and no error (the proxy sends it elsewhere, or the source keeps decoding), and the survivors hold no KV
block once idle.

Migration timeouts are a minute here: a reservation or a suspended request let go within seconds was let go
because its peer was known dead (the manager's wire.PeerDead, or its connection closing), not because a timeout
expired. Each kill is followed by a restart of the killed instance (same id, same role).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from llumnixctl.lab import localcluster
from llumnixctl.main import status_json
from tests.conftest import FAST, UP_TIMEOUT_S, Cluster
from tests.streams import Stream, metric, proxy_metric, samples, wait_for

pytestmark = pytest.mark.e2e

ROLES = ["prefill", "decode", "decode"]  # i0 prefills long prompts; i1 and i2 decode (one of them is the spare)
SETS = FAST + [
    "instance.min_step_s=0.01",
    "sim.prefill_ms=5000",  # x time_scale 0.1: each prefill takes 0.5 s, long enough to be killed in
    # A long prompt's ~60 blocks of 4 KiB take ~2.5 s to hand over: a kill can land in the copy.
    "migration.bandwidth_limit_mbps=0.1", "migration.chunk_bytes=16384", "migration.max_decode_slowdown=0",
    "migration.timeout_s=60", "migration.dest_idle_timeout_s=60",
    "disagg.handover_precopy=true",  # a paced pre-copy is a window to kill in (a one-stage copy takes ~10 ms)
]
LONG = list(range(100, 1100))  # 1000 prompt tokens (63 blocks): prefilled on i0, handed over slowly
MEDIUM = list(range(100, 400))  # 300 (19 blocks): prefilled on i0 (over disagg.min_uncached_tokens), handed over


@pytest.fixture(scope="module")
def c(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("kills")
    cluster = Cluster(localcluster.up(run_dir, 3, "sim", 0, None, SETS, timeout_s=UP_TIMEOUT_S, roles=ROLES),
                      run_dir)
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


def holders(c, rid: str = "") -> list[str]:
    """The instances that hold ``rid`` (or any request) now."""
    client = c.admin()
    try:
        return sorted(r.instance_id for r in client.requests().requests if not rid or r.request_id == rid)
    finally:
        client.close()


def instance_metric(c, iid: str, name: str, **labels: str) -> float:
    address = rows(c)[iid]["metrics_address"]
    return metric(samples(httpx.get(f"http://{address}/metrics", timeout=10).text), name, 0, **labels)


def released(c, iid: str, role: str) -> float:
    """The moves ``iid`` gave up in ``role`` because its peer died: the manager said so (peer_dead), or (as
    destination) the copy failed first, the dead peer's connection closed (transfer_failed)."""
    return sum(instance_metric(c, iid, "llumnix_instance_migration_released_total", role=role, cause=cause)
               for cause in ("peer_dead", "transfer_failed"))


def settled(c, within_s: float) -> None:
    """Every live instance idle with no block held, within ``within_s``."""
    def idle() -> bool:
        return all(r["blocks_used"] == r["running"] == r["waiting"] == r["migrating_out"] == r["migrating_in"] == 0
                   for r in rows(c).values() if r["state"] == "alive")
    wait_for(idle, within_s, lambda: f"blocks left behind: {rows(c)}", every=0.1)


def kill(c, iid: str) -> None:
    """kill -9 of ``iid``; returns once the manager has marked it dead."""
    proc = c.proc(f"instance-{iid}")
    os.kill(proc.pid, signal.SIGKILL)
    wait_for(lambda: proc.process() is None, 10, f"{iid} did not die")
    wait_for(lambda: rows(c)[iid]["state"] == "dead", 10, f"the manager did not mark {iid} dead")


def restart(c, iid: str) -> None:
    """The killed instance starts again (same id, settings and role) and rejoins."""
    proc = c.proc(f"instance-{iid}")
    c.spawn(proc.name, proc.argv)
    wait_for(lambda: rows(c).get(iid, {}).get("state") == "alive", 60, f"{iid} did not come back")
    alive = sum(r["state"] == "alive" for r in rows(c).values())
    wait_for(lambda: httpx.get(c.url + "/health", timeout=10).json()["instances_alive"] == alive, 30,
             f"the proxy does not count {iid} back")


def handing_over(c, s: Stream) -> str:
    """Wait until ``s``'s handover copies (a decode instance has reserved its blocks); that instance."""
    def dst() -> str:
        return next((i for i, r in rows(c).items() if r["role"] == "decode" and r["migrating_in"] > 0
                     and r["blocks_used"] > 0), "")
    return wait_for(dst, 10, "the handover did not start")


def handed_over(c, s: Stream) -> str:
    s.wait_tokens(1)
    return wait_for(lambda: next((i for i in holders(c, s.rid) if i != "i0"), ""), 10, "no handover")


# ---------------------------------------------------------------- the kill points


def test_links_were_made_when_the_instances_joined(c):
    """Set-up off the request path: the prefill instance links to both decode instances once they have joined
    (after they are up: the links are made while the cluster already serves)."""
    log = Path(c.proc("instance-i0").log)

    def linked() -> bool:
        text = log.read_text()
        return "links to i1 made ahead" in text and "links to i2 made ahead" in text

    wait_for(linked, 30, lambda: log.read_text()[-2000:])
    assert instance_metric(c, "i0", "llumnix_instance_links_made_ahead_total", outcome="ready") == 2


def test_prefill_killed_before_the_handover_in_its_prefill(c):
    s = Stream(c.url, 120, prompt=LONG)
    wait_for(lambda: holders(c) == ["i0"], 10, "the prefill instance did not take it")
    assert not s.ids  # still in its prefill
    again = proxy_metric(c.url, "llumnix_proxy_redispatches_total")
    kill(c, "i0")
    s.check_sim(120, prompt_tokens=len(LONG))  # prefilled on a decode instance (no prefill pool left)
    assert proxy_metric(c.url, "llumnix_proxy_redispatches_total") == again + 1  # no token yet: dispatched anew
    settled(c, 10)
    restart(c, "i0")


def test_prefill_killed_during_the_handover_has_the_reservation_released_at_once(c):
    s = Stream(c.url, 250, prompt=LONG)
    dst = handing_over(c, s)
    before = released(c, dst, "destination")
    failovers = proxy_metric(c.url, "llumnix_proxy_failovers_total")
    kill(c, "i0")
    t0 = time.monotonic()
    wait_for(lambda: released(c, dst, "destination") == before + 1, 5, "the reservation was not released")
    assert time.monotonic() - t0 < 5  # migration.dest_idle_timeout_s is 60
    s.check_sim(250, prompt_tokens=len(LONG))  # continued by re-prefill on a decode instance
    assert proxy_metric(c.url, "llumnix_proxy_failovers_total") == failovers + 1
    settled(c, 10)
    restart(c, "i0")


def test_prefill_killed_after_the_handover_then_decode_killed_mid_stream(c):
    """After the handover the prefill instance dies: the stream never notices. Then its decode instance dies
    mid-stream: the proxy continues it on the spare by re-prefill."""
    s = Stream(c.url, 300, prompt=MEDIUM)
    dst = handed_over(c, s)
    failovers = proxy_metric(c.url, "llumnix_proxy_failovers_total")
    kill(c, "i0")
    s.wait_tokens(len(s.ids) + 20)
    assert proxy_metric(c.url, "llumnix_proxy_failovers_total") == failovers  # it never noticed
    assert holders(c, s.rid) == [dst]
    kill(c, dst)
    assert len(s.ids) < 300
    s.check_sim(300, prompt_tokens=len(MEDIUM))
    assert proxy_metric(c.url, "llumnix_proxy_failovers_total") == failovers + 1
    settled(c, 10)
    restart(c, "i0")
    restart(c, dst)


def test_decode_killed_during_the_handover_keeps_the_request_decoding_on_the_prefill_instance(c):
    s = Stream(c.url, 250, prompt=LONG)
    dst = handing_over(c, s)
    failovers = proxy_metric(c.url, "llumnix_proxy_failovers_total")
    kill(c, dst)
    # The handover aborted at once (its timeouts are a minute): the prefill instance decodes it on.
    wait_for(lambda: rows(c)["i0"]["migrating_out"] == 0, 5, "the handover waited for its dead destination")
    s.check_sim(250, prompt_tokens=len(LONG))
    assert proxy_metric(c.url, "llumnix_proxy_failovers_total") == failovers  # never left its instance
    settled(c, 10)
    restart(c, dst)
