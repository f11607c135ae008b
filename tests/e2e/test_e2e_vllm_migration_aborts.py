"""Live migration between real vLLM instances that ends in an abort, on a cluster whose KV link is slow (a
stage 0 of a long prompt takes seconds): a request that finishes during pre-copy, a destination without room
or with a shorter context limit, either end killed mid-copy (real Gloo). Every stream is what it would be
unmigrated. Apart from tests/e2e/test_e2e_vllm_migration.py so that one vLLM cluster runs at a time.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

pytest.importorskip("vllm")

from llumnixctl.lab import localcluster  # noqa: E402
from llumnixctl.lab.model import write_tiny_model  # noqa: E402
from tests.conftest import Cluster  # noqa: E402
from tests.e2e.test_e2e_migration import migrate, move, where  # noqa: E402
from tests.e2e.test_e2e_vllm_migration import BASE, Stream  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")


def settle(c: Cluster, timeout: float = 30) -> dict:
    """Nothing runs or is held any more (a longer bound than the sim's: vLLM instances on two cores)."""
    from tests.e2e.test_e2e_migration import settle as settle_sim

    return settle_sim(c, timeout)


def _up(model_dir, run_dir, extra: list[str] = ()) -> Cluster:
    state = localcluster.up(run_dir, 2, "vllm", 0, None, BASE + [f"model.path={model_dir}", *extra], timeout_s=240)
    return Cluster(state, run_dir)


def _other(instance: str) -> str:
    return "i1" if instance == "i0" else "i0"


@pytest.fixture(scope="module")
def slow(model_dir, tmp_path_factory):
    # One 64 KiB block per chunk at 0.5 MB/s: a 600-token request's stage 0 (19 blocks) takes ~2.5 s.
    c = _up(model_dir, tmp_path_factory.mktemp("vslow"),
            ["migration.bandwidth_limit_mbps=0.5", "migration.chunk_bytes=65536", "migration.timeout_s=10"])
    try:
        yield c
    finally:
        localcluster.stop(c.state, timeout_s=20)


def _long_body(max_tokens: int) -> dict:
    return {"prompt": list(range(5, 605)), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def _wait_reserved(c: Cluster, dst: str, mover: threading.Thread, result: dict) -> None:
    """Until ``dst`` holds the migration's reservation (its stage 0 then takes seconds on the slow link). The
    bound is generous: on a busy machine the migrate command and a new pair's first Gloo connection are slow;
    a migration that ended before reserving fails at once, with its answer."""
    deadline = time.monotonic() + 60
    while True:
        rows = {i["id"]: i for i in c.status()["instances"]}
        if rows.get(dst, {}).get("migrating_in") and rows[dst]["blocks_used"]:
            return
        assert mover.is_alive(), f"the migration ended before {dst} reserved anything: {result}"
        assert time.monotonic() < deadline, json.dumps(
            {i: {k: r.get(k) for k in ("state", "running", "blocks_used", "migrating_in", "migrating_out")}
             for i, r in rows.items()})
        time.sleep(0.05)


def test_vllm_request_finishing_during_precopy(slow):
    s = Stream(slow.url, _long_body(30))
    s.wait_tokens(2)
    out = move(slow, s.rid, _other(where(slow, s.rid)))
    assert out["outcome"] == "aborted" and "finished" in out["reason"], out
    assert len(s.result().ids) == 30
    settle(slow)


def test_vllm_destination_without_room(slow):
    """The destination holds 23 blocks of 32 tokens: the first request (10 blocks) moves there, the second
    (15 blocks) no longer fits and stays where it runs."""
    # Flood dispatch keeps sending to the first instance that registered, never to this one.
    localcluster.add_instance(slow.run_dir, slow.state, "small", ["vllm.kv_cache_bytes=1572864",
                                                                   "model.max_model_len=736"], timeout_s=240)
    first = Stream(slow.url, {"prompt": list(range(5, 305)), "max_tokens": 400, "temperature": 0, "ignore_eos": True})
    second = Stream(slow.url, {"prompt": list(range(5, 455)), "max_tokens": 250, "temperature": 0, "ignore_eos": True})
    first.wait_tokens(2)
    second.wait_tokens(2)
    assert move(slow, first.rid, "small")["outcome"] == "committed"
    out = move(slow, second.rid, "small")
    assert out["outcome"] == "aborted" and "no room" in out["reason"], out
    assert len(first.result().ids) == 400 and len(second.result().ids) == 250
    settle(slow)


def test_vllm_context_limit_of_the_destination_is_respected(slow):
    s = Stream(slow.url, _long_body(300))  # may reach 900 tokens; "small" stops at 736
    s.wait_tokens(2)
    out = move(slow, s.rid, "small")
    assert out["outcome"] == "aborted" and "context limit is 736" in out["reason"], out
    assert len(s.result().ids) == 300
    settle(slow)


def test_vllm_destination_killed_mid_copy(slow):
    s = Stream(slow.url, _long_body(300))
    s.wait_tokens(2)
    src = where(slow, s.rid)
    dst = "i1" if src != "i1" else "i0"
    result = {}
    t = threading.Thread(target=lambda: result.update(out=move(slow, s.rid, dst)))
    t.start()
    _wait_reserved(slow, dst, t, result)
    os.kill(slow.proc(f"instance-{dst}").pid, signal.SIGKILL)
    t.join(60)
    assert result["out"]["outcome"] == "aborted", result
    assert len(s.result().ids) == 300  # the source kept it running
    settle(slow)


def test_vllm_source_killed_mid_copy(slow):
    localcluster.add_instance(slow.run_dir, slow.state, "i2", timeout_s=240)
    ref = Stream(slow.url, _long_body(300)).result()
    s = Stream(slow.url, _long_body(300))
    s.wait_tokens(2)
    src = where(slow, s.rid)
    # Any live instance but its own and "small" (whose context limit is shorter than this request's).
    alive = {i["id"] for i in slow.status()["instances"] if i["state"] == "alive"}
    dst = next(i for i in ("i2", "i0", "i1") if i != src and i in alive)
    res = {}
    t = threading.Thread(target=lambda: res.update(r=migrate(slow, s.rid, "--to", dst, json_out=False)[0]))
    t.start()
    _wait_reserved(slow, dst, t, res)
    os.kill(slow.proc(f"instance-{src}").pid, signal.SIGKILL)
    t.join(60)
    assert res["r"].returncode == 1, res["r"].stderr
    # The proxy continued the stream on another instance by re-prefill: greedy output is unchanged.
    assert s.result().ids == ref.ids
    deadline = time.monotonic() + 20
    while True:  # the destination gives its reservation back
        d = next(i for i in slow.status()["instances"] if i["id"] == dst)
        if d["blocks_used"] == 0 and d["migrating_in"] == 0:
            break
        assert time.monotonic() < deadline, d
        time.sleep(0.2)


