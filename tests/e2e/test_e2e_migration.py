"""Live migration with real daemons on the sim engine: real ZeroMQ, real Gloo, real HTTP.

Steps are paced (instance.min_step_s) so that a request is still decoding when a test moves it; the sim's
tokens are a function of (request id, index), so a stream is checked token by token against what the
request must produce, whichever instance produced each token.

The protocol's failure cases (a request finishing during pre-copy, a destination without room or with another
KV layout, either end killed mid-copy) run in process on virtual time (tests/unit/test_protocol_virtual.py); with
real Gloo and a real engine they run on vLLM (tests/e2e/test_e2e_vllm_migration_aborts.py).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from llumnixctl.lab import localcluster
from tests.conftest import UP_TIMEOUT_S, ctl
from tests.streams import Stream, metric, samples

pytestmark = pytest.mark.e2e

VOCAB = 32000
PACED = ["instance.min_step_s=0.02", "manager.dispatch_policy=flood", "migration.timeout_s=3",
         "migration.dest_idle_timeout_s=2"]


class Streamer(Stream):
    """A streamed sim completion of exactly ``max_tokens`` tokens (no EOS), consumed on a thread."""

    def __init__(self, url: str, max_tokens: int, prompt: str = "move me " * 20, **extra):
        super().__init__(url, max_tokens, prompt=prompt, ignore_eos=True, **extra)

    def check_complete(self, n: int) -> None:
        """Every index once, in order, the right tokens; max_tokens counted across moves."""
        self.check_sim(n)
        assert self.finish == "length"


def migrate(cluster, *args: str, json_out: bool = True):
    res = ctl("migrate", *args, "--run-dir", str(cluster.run_dir), *(["--json"] if json_out else []))
    assert not json_out or res.stdout.strip(), f"llumnixctl migrate printed nothing (exit {res.returncode}): {res.stderr}"
    return res, (json.loads(res.stdout) if json_out else None)


def move(cluster, rid: str, dst: str) -> dict:
    """In-process (milliseconds, where the CLI takes a few hundred): the same manager query as llumnixctl."""
    from llumnixctl.main import outcome_json

    from llumnixctl.admin import AdminClient

    client = AdminClient(cluster.manager, timeout_s=60)
    try:
        return outcome_json(client.migrate(dst, request_id=rid).outcomes[0])
    finally:
        client.close()


def where(cluster, rid: str) -> str:
    client = cluster.admin()
    try:
        return next(r.instance_id for r in client.requests().requests if r.request_id == rid)
    finally:
        client.close()


def settle(cluster, timeout: float = 10) -> dict:
    """Wait until no instance runs or holds anything; returns the last status."""
    deadline = time.monotonic() + timeout
    while True:
        st = cluster.status()
        if all(i["blocks_used"] == 0 and i["running"] == 0 and i["migrating_out"] == i["migrating_in"] == 0
               for i in st["instances"] if i["state"] == "alive"):
            return st
        assert time.monotonic() < deadline, st
        time.sleep(0.1)


@pytest.fixture(scope="module")
def mcluster(tmp_path_factory):
    from tests.conftest import FAST, Cluster

    run_dir = tmp_path_factory.mktemp("mig")
    state = localcluster.up(run_dir, 2, "sim", 0, None, FAST + PACED, timeout_s=UP_TIMEOUT_S)
    try:
        yield Cluster(state, run_dir)
    finally:
        localcluster.stop(state, timeout_s=10)


@pytest.mark.parametrize("plan", [[1], [40], [85], [10, 30, 50]], ids=["after-prefill", "middle", "near-the-end", "back-and-forth"])
def test_stream_is_unbroken_across_migrations(mcluster, plan):
    s = Streamer(mcluster.url, 100)
    s.started.wait(10)
    here = where(mcluster, s.rid)
    for at in plan:
        s.wait_tokens(at)
        there = "i1" if here == "i0" else "i0"
        out = move(mcluster, s.rid, there)
        assert out["outcome"] == "committed", (out, mcluster.logs())
        assert out["from"] == here and out["to"] == there
        assert out["stages"] >= 1 and out["bytes"] > 0 and 0 < out["downtime_ms"] <= out["total_ms"]
        assert at <= out["resumed_at"] < 100
        here = there
    s.check_complete(100)  # every index once, in order, the right tokens, max_tokens counted across moves
    st = settle(mcluster)
    assert st["totals"]["migrations_committed"] >= len(plan)


def test_migrate_count_from_an_instance(mcluster):
    streams = [Streamer(mcluster.url, 250, prompt=f"batch {i} " * (5 + 10 * i)) for i in range(4)]
    for s in streams:
        s.wait_tokens(5)
    src = where(mcluster, streams[0].rid)
    assert {where(mcluster, s.rid) for s in streams} == {src}  # flood: all on one instance
    dst = "i1" if src == "i0" else "i0"
    # In-process, the query `migrate --from --count` sends (the CLI's start-up on a busy machine can outlast
    # the streams; test_e2e_vllm_migration runs the CLI's --count).
    from llumnixctl.main import outcome_json

    client = mcluster.admin()
    try:
        out = [outcome_json(o) for o in client.migrate(dst, src=src, count=2).outcomes]
    finally:
        client.close()
    assert [o["outcome"] for o in out] == ["committed", "committed"], out
    # Shorter first: the two with the shortest prompts went.
    assert {o["request_id"] for o in out} == {streams[0].rid, streams[1].rid}
    for s in streams:
        s.check_complete(250)
    settle(mcluster)


def test_client_abort_follows_the_request(mcluster):
    """After a move, the proxy's abort (client gone) reaches the destination: it frees the request at once."""
    s = Streamer(mcluster.url, 3000)
    s.wait_tokens(5)
    src = where(mcluster, s.rid)
    res, _ = migrate(mcluster, s.rid, "--to", "i1" if src == "i0" else "i0", json_out=False)  # the CLI, human output
    assert res.returncode == 0 and "committed" in res.stdout
    s.stop_after = 0
    s.join(10)
    settle(mcluster, timeout=5)  # 3000 tokens would take 60 s


def test_cli_errors_are_one_line(mcluster):
    res, _ = migrate(mcluster, "no-such-request", "--to", "i1", json_out=False)
    assert res.returncode == 1 and "not on any instance" in res.stderr and "Traceback" not in res.stderr
    res, _ = migrate(mcluster, "--from", "i0", "--to", "nope", json_out=False)
    assert res.returncode == 1 and "'nope' is not a live instance" in res.stderr
    res, _ = migrate(mcluster, "x", "--from", "i0", "--to", "i1", json_out=False)
    assert res.returncode == 2 and "either REQUEST_ID or --from" in res.stderr
    res, _ = migrate(mcluster, "--from", "i0", "--to", "i0", json_out=False)
    assert res.returncode == 1 and "already on i0" in res.stderr
    res, out = migrate(mcluster, "--from", "i0", "--to", "i1")  # nothing running: nothing to move
    assert res.returncode == 1 and out == []


def test_metrics_count_migrations(mcluster):
    s = Streamer(mcluster.url, 60)
    s.wait_tokens(3)
    src = where(mcluster, s.rid)
    assert move(mcluster, s.rid, "i1" if src == "i0" else "i0")["outcome"] == "committed"
    s.check_complete(60)
    inst = next(i for i in mcluster.status()["instances"] if i["id"] == src)
    m = samples(httpx.get(f"http://{inst['metrics_address']}/metrics").text)
    assert metric(m, "llumnix_migrations_total", outcome="committed", instance_id=src, model_name="llumnix-sim") >= 1
    assert metric(m, "llumnix_migration_downtime_seconds_count", instance_id=src) >= 1


# ---------------------------------------------------------------- aborts (each on its own cluster)


def test_bench_migration_json_shape_on_the_sim():
    """The benchmark's contract (scripts/fig10.sh reads it): one row per length, every figure present."""
    res = ctl("bench", "migration", "--backend", "sim", "--lengths", "64,200", "--decode-tokens", "48", "--json",
              timeout=300)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["backend"] == "sim" and [r["tokens"] for r in data["results"]] == [64, 200]
    for r in data["results"]:
        for key in ("downtime_ms", "migration_ms", "blocking_copy_ms", "recompute_ms", "decode_step_ms",
                    "decode_step_migrating_ms"):
            assert key in r
        assert 0 < r["downtime_ms"] <= r["migration_ms"] and r["blocking_copy_ms"] > 0 and r["recompute_ms"] > 0
        assert r["bytes"] >= r["tokens"] * 64 * 1024 * 0.9  # the kv-heavy shape: 64 KiB per token
    bad = ctl("bench", "migration", "--lengths", "x")
    assert bad.returncode == 2 and "--lengths" in bad.stderr
