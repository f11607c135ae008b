"""The proxy's OpenAI extras on real vLLM instances against vLLM's own offline engine: top logprobs
(completions and chat shapes) and n > 1 with a seed."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("vllm")

from tests.test_e2e_vllm import model_dir, offline, vcluster  # noqa: E402,F401  (module fixtures, reused)

pytestmark = pytest.mark.e2e

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
