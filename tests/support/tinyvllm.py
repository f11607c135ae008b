"""A local cluster of tiny-model vLLM instances for one test module, and a greedy completion's token ids through
its proxy (the tier and pull e2e tests share them)."""

from __future__ import annotations

import httpx

from llumnixctl.lab import localcluster
from llumnixctl.lab.model import write_tiny_model
from tests.conftest import Cluster


def tiny_cluster(tmp_path_factory, instances: int, sets: list[str], timeout_s: float):
    """(A module fixture's body) ``instances`` vLLM instances of a tiny random model with ``sets``; stopped after."""
    model = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")
    run_dir = tmp_path_factory.mktemp("run")
    state = localcluster.up(run_dir, instances, "vllm", 0, None, sets + [f"model.path={model}", "model.name=tiny-llama"],
                            timeout_s=timeout_s)
    try:
        yield Cluster(state, run_dir)
    finally:
        localcluster.stop(state, timeout_s=20)


def complete(c: Cluster, prompt: list[int], n: int = 12, **extra) -> list[int]:
    """The token ids of a greedy completion of ``prompt`` (``n`` tokens, no early end)."""
    r = httpx.post(c.url + "/v1/completions", timeout=60, json={
        "model": "tiny-llama", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]
