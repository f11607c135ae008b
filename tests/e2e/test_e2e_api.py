"""The OpenAI API through real daemons on loopback, with the official openai client."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from daemons.config import SimConfig
from daemons.engine.sim import sim_token_id
from daemons.proxy.api.tokenizer import SimTokenizer

pytestmark = pytest.mark.e2e

TOK = SimTokenizer(SimConfig().vocab_size, SimConfig().eos_token_id)


def expected_text(request_id: str, n: int) -> str:
    """The sim engine's output for a request is a function of its id: what every index must decode to."""
    cfg = SimConfig()
    return "".join(TOK.decode_token(sim_token_id(request_id, i, cfg.vocab_size)) for i in range(n))


def test_completion_non_streamed(cluster):
    client = cluster.openai()
    res = client.completions.create(model="llumnix-sim", prompt="the quick brown fox", max_tokens=12,
                                    extra_body={"ignore_eos": True})
    assert res.id.startswith("cmpl-")
    assert res.choices[0].finish_reason == "length"
    assert res.usage.prompt_tokens == 4 and res.usage.completion_tokens == 12 and res.usage.total_tokens == 16
    assert res.choices[0].text == expected_text(res.id, 12)


def test_completion_streamed_with_usage(cluster):
    client = cluster.openai()
    chunks = list(client.completions.create(model="llumnix-sim", prompt=[5, 6, 7], max_tokens=20, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    rid = chunks[0].id
    assert all(c.id == rid for c in chunks)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected_text(rid, 20)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].usage.prompt_tokens == 3


def test_chat_non_streamed_and_streamed(cluster):
    client = cluster.openai()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    res = client.chat.completions.create(model="llumnix-sim", messages=msgs, max_tokens=8, extra_body={"ignore_eos": True})
    assert res.id.startswith("chatcmpl-") and res.object == "chat.completion"
    assert res.choices[0].message.role == "assistant"
    assert res.choices[0].message.content == expected_text(res.id, 8)
    assert res.usage.completion_tokens == 8

    stream = client.chat.completions.create(model="llumnix-sim", messages=msgs, max_tokens=8, stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == expected_text(chunks[0].id, 8)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sim_eos_ends_a_request_early(cluster):
    # eos_rate 0.01 by default: across many requests with room for 400 tokens, some stop on EOS.
    client = cluster.openai()
    reasons = {client.completions.create(model="llumnix-sim", prompt="x", max_tokens=400).choices[0].finish_reason
               for _ in range(4)}
    assert "stop" in reasons


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_output(cluster, stream):
    client = cluster.openai()
    for _ in range(5):  # "ba" is in about one token in 25: almost always within 100 tokens
        res = client.completions.create(model="llumnix-sim", prompt="abc", max_tokens=100, stop=["ba", "zzzz"],
                                        stream=stream, extra_body={"ignore_eos": True})
        chunks = list(res) if stream else [res]
        rid = chunks[0].id
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        full = expected_text(rid, 100)
        if "ba" in full:
            assert reason == "stop"
            assert text == full[: full.index("ba")]
            return
        assert reason == "length" and text == full
    pytest.fail("no output contained the stop string")


def test_models_health_metrics(cluster):
    models = cluster.openai().models.list()
    assert [m.id for m in models.data] == ["llumnix-sim"]
    h = httpx.get(cluster.url + "/health").json()
    assert h["status"] == "ok" and h["instances_alive"] == 2 and h["manager"] == "ok"
    metrics = httpx.get(cluster.url + "/metrics").text
    assert "llumnix_proxy_requests_total" in metrics and "llumnix_proxy_time_to_first_token_seconds" in metrics


@pytest.mark.parametrize("body, status, param", [
    ("{not json", 400, None),
    ("", 400, None),
    ('{"prompt": "x"}', 400, "model"),
    ('{"model": "llumnix-sim"}', 400, "prompt"),
    ('{"model": "llumnix-sim", "prompt": "x", "max_tokens": -3}', 400, "max_tokens"),
    ('{"model": "llumnix-sim", "prompt": "x", "max_tokens": 5000}', 400, "max_tokens"),
    ('{"model": "llumnix-sim", "prompt": [1, "a"]}', 400, "prompt"),
    ('{"model": "other", "prompt": "x"}', 404, "model"),
])
def test_bad_requests_get_openai_errors(cluster, body, status, param):
    r = httpx.post(cluster.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param


def test_prompt_over_context_limit_via_client(cluster):
    client = cluster.openai()
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="llumnix-sim", messages=[{"role": "user", "content": "w " * 5000}])
    assert "maximum context length is 4096" in str(exc.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="llumnix-sim", prompt="x", max_tokens=-1)
    # and the cluster still serves
    assert client.completions.create(model="llumnix-sim", prompt="x", max_tokens=2).usage.completion_tokens >= 1


def test_response_id_is_the_id_llumnixctl_shows(cluster):
    from tests.conftest import ctl_json

    client = cluster.openai()
    seen: dict = {}

    def run():
        stream = client.completions.create(model="llumnix-sim", prompt="slow", max_tokens=2000, stream=True,
                                           extra_body={"ignore_eos": True})
        for chunk in stream:
            seen.setdefault("id", chunk.id)
            if seen.get("stop"):
                stream.close()
                break

    t = threading.Thread(target=run)
    t.start()
    try:
        deadline = time.monotonic() + 20
        while "id" not in seen and time.monotonic() < deadline:
            time.sleep(0.05)
        listed = ctl_json("requests", "--run-dir", str(cluster.run_dir))["requests"]
        row = next(r for r in listed if r["id"] == seen["id"])
        assert row["state"] == "running" and row["instance"] in ("i0", "i1") and row["output_tokens"] >= 1
    finally:
        seen["stop"] = True
        t.join(30)
    # the client went away: the proxy aborts the request on its instance
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        ids = [r["id"] for r in ctl_json("requests", "--run-dir", str(cluster.run_dir))["requests"]]
        if seen["id"] not in ids:
            break
        time.sleep(0.2)
    assert seen["id"] not in ids


async def _stream(client, n_tokens: int) -> tuple[str, str, int]:
    stream = await client.completions.create(model="llumnix-sim", prompt="load", max_tokens=n_tokens, stream=True,
                                             extra_body={"ignore_eos": True})
    rid, parts, finishes = "", [], 0
    async for chunk in stream:
        rid = chunk.id
        for c in chunk.choices:
            parts.append(c.text)
            finishes += c.finish_reason is not None
    return rid, "".join(parts), finishes


def test_200_concurrent_streams_every_index_once_in_order(start_cluster):
    c = start_cluster(instances=3, sets=["sim.time_scale=0.02"])
    from openai import AsyncOpenAI

    async def main():
        client = AsyncOpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0,
                             http_client=__import__("httpx").AsyncClient(limits=httpx.Limits(max_connections=250), timeout=120))
        return await asyncio.gather(*(_stream(client, 40 + (k % 7) * 10) for k in range(200)))

    results = asyncio.run(main())
    assert len(results) == 200
    for k, (rid, text, finishes) in enumerate(results):
        n = 40 + (k % 7) * 10
        assert finishes == 1
        assert text == expected_text(rid, n), f"request {rid}: tokens missing, repeated or out of order"
    assert len({rid for rid, _, _ in results}) == 200
    st = c.status()
    assert st["totals"]["running"] == 0 and st["totals"]["blocks_used"] == 0
    per = {r["id"]: r for r in st["instances"]}
    assert 'llumnix_proxy_duplicate_tokens_total{model_name="llumnix-sim"} 0.0' in httpx.get(c.url + "/metrics").text
    assert len(per) == 3


@pytest.mark.parametrize("stream", [False, True])
def test_return_token_ids_gives_the_engine_tokens(cluster, stream):
    cfg = SimConfig()
    res = httpx.post(cluster.url + "/v1/completions", timeout=30, json={
        "model": "llumnix-sim", "prompt": "ids", "max_tokens": 9, "ignore_eos": True, "return_token_ids": True,
        "stream": stream})
    if stream:
        chunks = [json.loads(line[6:]) for line in res.text.splitlines() if line.startswith("data: {")]
        ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
        rid = chunks[0]["id"]
    else:
        body = res.json()
        ids, rid = body["choices"][0]["token_ids"], body["id"]
    assert ids == [sim_token_id(rid, i, cfg.vocab_size) for i in range(9)]
