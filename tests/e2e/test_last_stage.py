"""The last stage of a live migration on real daemons (sim engine, real ZeroMQ and Gloo): of the request's
partial last block only the written token slots travel, and the request goes on as if it never moved.

The migration outcome's ``bytes`` is everything the stages moved: every full block whole (pre-copy sends
only full blocks, which never change again) plus the written part of the partial one, nothing more.
"""

from __future__ import annotations

import pytest

from llumnixctl.lab import localcluster
from tests.streams import Stream
from tests.e2e.test_e2e_migration import move, where

pytestmark = pytest.mark.e2e

BS, LAYERS, HEADS, DIM, ITEM = 16, 2, 2, 8, 2  # sim KV: float16 blocks of [2 (K, V), BS, HEADS, DIM] per layer
TOKENS = 400  # of a moved stream: long enough to be running still when the move comes, on a loaded host
BLOCK = LAYERS * 2 * BS * HEADS * DIM * ITEM
SETS = ["instance.min_step_s=0.02", "manager.dispatch_policy=flood", "migration.timeout_s=5",
        f"sim.block_size={BS}", f"sim.kv_layers={LAYERS}", f"sim.kv_heads={HEADS}", f"sim.head_dim={DIM}",
        "sim.kv_dtype=float16"]


@pytest.fixture(scope="module")
def small_kv(tmp_path_factory):
    from tests.conftest import FAST, UP_TIMEOUT_S, Cluster

    run_dir = tmp_path_factory.mktemp("last-stage")
    state = localcluster.up(run_dir, 2, "sim", 0, None, FAST + SETS, timeout_s=UP_TIMEOUT_S)
    try:
        yield Cluster(state, run_dir)
    finally:
        localcluster.stop(state, timeout_s=10)


def written_bytes(tokens: int) -> int:
    """Full blocks whole, then the written slots of the partial block (all layers, K and V)."""
    return tokens // BS * BLOCK + tokens % BS * BLOCK // BS


@pytest.mark.parametrize("prompt", [37, 48], ids=["partial", "block-aligned-prompt"])
def test_last_stage_moves_only_the_written_part(small_kv, prompt):
    # 400 tokens (8 s at 20 ms a step): under a CPU hog, locating and moving the request took over the 1.2 s
    # that a 60-token stream lasts, and the move found it finished.
    s = Stream(small_kv.url, TOKENS, prompt=list(range(10, 10 + prompt)), ignore_eos=True)
    s.wait_tokens(5)
    here = where(small_kv, s.rid)
    out = move(small_kv, s.rid, "i1" if here == "i0" else "i0")
    assert out["outcome"] == "committed", out
    # The sim holds KV for prompt + generated tokens, generated = the index it resumes at on the destination.
    assert out["bytes"] == written_bytes(prompt + out["resumed_at"]), out
    s.check_sim(TOKENS, prompt_tokens=prompt)


def test_blocking_copy_moves_only_the_written_part(small_kv):
    from llumnixctl.admin import AdminClient

    s = Stream(small_kv.url, TOKENS // 2, prompt=list(range(10, 31)), ignore_eos=True)
    s.wait_tokens(3)
    here = where(small_kv, s.rid)
    client = AdminClient(small_kv.manager, timeout_s=60)
    try:
        out = client.migrate("i1" if here == "i0" else "i0", request_id=s.rid, blocking=True).outcomes[0]
    finally:
        client.close()
    assert out.outcome == "committed" and out.stages == 1, out
    assert out.bytes == written_bytes(21 + out.resumed_at)
    s.check_sim(TOKENS // 2, prompt_tokens=21)
