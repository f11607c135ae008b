"""The proxy's OpenAI surface on the sim engine: n > 1, top logprobs, vLLM's extra routes, x-request-id,
unsupported fields, vLLM's text at a trailing partial character, the access log."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import threading
import time

import httpx
import pytest

from daemons.config import Config, SimConfig
from daemons.engine.sim import sim_logprobs, sim_token_id
from daemons.proxy.api.tokenizer import HFTokenizer, SimTokenizer

pytestmark = pytest.mark.e2e

CFG = SimConfig()
TOK = SimTokenizer(CFG.vocab_size, CFG.eos_token_id)


def expected_text(request_id: str, n: int) -> str:
    return "".join(TOK.decode_token(sim_token_id(request_id, i, CFG.vocab_size)) for i in range(n))


def sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def post(cluster, path: str, body: dict, headers: dict | None = None, timeout: float = 60) -> httpx.Response:
    return httpx.post(cluster.url + path, json=body, headers=headers, timeout=timeout)


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


# ---------------------------------------------------------------------- n > 1


def test_n_choices_non_streamed(cluster):
    r = post(cluster, "/v1/completions", {"model": "llumnix-sim", "prompt": "one two three", "max_tokens": 7,
                                           "n": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    rid = body["id"]
    assert rid.startswith("cmpl-")
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for k, c in enumerate(body["choices"]):
        assert c["text"] == expected_text(f"{rid}-{k}", 7)  # each sequence is its own request <id>-<k>
        assert c["finish_reason"] == "length"
    assert len({c["text"] for c in body["choices"]}) == 3
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 21, "total_tokens": 24}


def test_n_choices_chat_with_the_openai_client(cluster):
    res = cluster.openai().chat.completions.create(
        model="llumnix-sim", messages=[{"role": "user", "content": "hi"}], max_tokens=5, n=2,
        extra_body={"ignore_eos": True})
    assert [c.index for c in res.choices] == [0, 1]
    assert [c.message.content for c in res.choices] == [expected_text(f"{res.id}-{k}", 5) for k in range(2)]
    assert res.usage.completion_tokens == 10


@pytest.mark.parametrize("chat", [False, True])
def test_n_choices_streamed_interleave_with_their_index(cluster, chat):
    n, lengths = 4, 12
    body = {"model": "llumnix-sim", "max_tokens": lengths, "n": n, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": "stream four"}]
    else:
        body["prompt"] = "stream four"
    r = post(cluster, "/v1/chat/completions" if chat else "/v1/completions", body)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    chunks = sse(r.text)
    rid = chunks[0]["id"]
    assert all(c["id"] == rid for c in chunks)
    texts, finishes, roles = [""] * n, [[] for _ in range(n)], [0] * n
    for chunk in chunks[:-1]:
        assert len(chunk["choices"]) == 1 and "usage" not in chunk
        c = chunk["choices"][0]
        if chat:
            roles[c["index"]] += c["delta"].get("role") == "assistant"
            texts[c["index"]] += c["delta"].get("content") or ""
        else:
            texts[c["index"]] += c["text"]
        if c["finish_reason"] is not None:
            finishes[c["index"]].append(c["finish_reason"])
    assert texts == [expected_text(f"{rid}-{k}", lengths) for k in range(n)]
    assert finishes == [["length"]] * n  # one finish per choice
    if chat:
        assert roles == [1] * n
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == n * lengths
    assert chunks[-1]["usage"]["prompt_tokens"] == (2 if not chat else chunks[-1]["usage"]["prompt_tokens"])


def test_n_with_stop_strings_and_token_ids(cluster):
    r = post(cluster, "/v1/completions", {"model": "llumnix-sim", "prompt": "x", "max_tokens": 60, "n": 3,
                                           "ignore_eos": True, "stop": ["ba"], "return_token_ids": True})
    body = r.json()
    rid = body["id"]
    for k, c in enumerate(body["choices"]):
        full = expected_text(f"{rid}-{k}", 60)
        assert c["text"] == (full[:full.index("ba")] if "ba" in full else full)
        assert c["finish_reason"] == ("stop" if "ba" in full else "length")
        assert c["token_ids"] == [sim_token_id(f"{rid}-{k}", i, CFG.vocab_size) for i in range(len(c["token_ids"]))]
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in body["choices"])


def test_n_too_large_and_best_of(cluster):
    base = {"model": "llumnix-sim", "prompt": "x", "max_tokens": 2}
    assert_openai_error(post(cluster, "/v1/completions", {**base, "n": 33}), 400, "n")
    assert_openai_error(post(cluster, "/v1/completions", {**base, "n": 2, "best_of": 3}), 400, "best_of")
    assert post(cluster, "/v1/completions", {**base, "n": 2, "best_of": 2}).status_code == 200


# ---------------------------------------------------------------------- top logprobs


def _sim_top(rid: str, index: int, k: int) -> tuple[int, float, list]:
    token = sim_token_id(rid, index, CFG.vocab_size)
    lp, top = sim_logprobs(rid, index, token, k, CFG.vocab_size)
    return token, lp, top or []


@pytest.mark.parametrize("stream", [False, True])
def test_completion_top_logprobs(cluster, stream):
    k, n_tokens = 3, 6
    r = post(cluster, "/v1/completions", {"model": "llumnix-sim", "prompt": "lp", "max_tokens": n_tokens,
                                           "ignore_eos": True, "logprobs": k, "stream": stream})
    if stream:
        chunks = sse(r.text)
        rid = chunks[0]["id"]
        lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
        merged = {key: [v for lp in lps for v in lp[key]] for key in ("tokens", "token_logprobs", "top_logprobs")}
    else:
        body = r.json()
        rid, merged = body["id"], body["choices"][0]["logprobs"]
    assert len(merged["tokens"]) == n_tokens
    for i in range(n_tokens):
        token, lp, top = _sim_top(rid, i, k)
        assert merged["tokens"][i] == TOK.decode_token(token)
        assert merged["token_logprobs"][i] == pytest.approx(lp)
        assert merged["top_logprobs"][i] == pytest.approx({TOK.decode_token(t): v for t, v in top})
        assert len(merged["top_logprobs"][i]) == k


def test_completion_logprobs_zero_gives_the_sampled_token_only(cluster):
    body = post(cluster, "/v1/completions", {"model": "llumnix-sim", "prompt": "lp", "max_tokens": 3,
                                              "ignore_eos": True, "logprobs": 0}).json()
    lp = body["choices"][0]["logprobs"]
    assert [list(d) for d in lp["top_logprobs"]] == [[t] for t in lp["tokens"]]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_top_logprobs(cluster, stream):
    k, n_tokens = 4, 5
    body = {"model": "llumnix-sim", "messages": [{"role": "user", "content": "lp"}], "max_tokens": n_tokens,
            "ignore_eos": True, "logprobs": True, "top_logprobs": k, "stream": stream}
    r = post(cluster, "/v1/chat/completions", body)
    if stream:
        chunks = sse(r.text)
        rid = chunks[0]["id"]
        content = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                   for e in c["choices"][0]["logprobs"]["content"]]
    else:
        res = r.json()
        rid, content = res["id"], res["choices"][0]["logprobs"]["content"]
    assert len(content) == n_tokens
    for i, entry in enumerate(content):
        token, lp, top = _sim_top(rid, i, k)
        assert entry["token"] == TOK.decode_token(token) and entry["logprob"] == pytest.approx(lp)
        assert entry["bytes"] == list(entry["token"].encode())
        assert [(a["token"], a["logprob"]) for a in entry["top_logprobs"]] == \
            [(TOK.decode_token(t), pytest.approx(v)) for t, v in top]
        assert all(a["bytes"] == list(a["token"].encode()) for a in entry["top_logprobs"])


def test_chat_logprobs_without_top_and_token_id_names(cluster):
    res = post(cluster, "/v1/chat/completions", {
        "model": "llumnix-sim", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "ignore_eos": True,
        "logprobs": True, "return_tokens_as_token_ids": True}).json()
    content = res["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{sim_token_id(res['id'], i, CFG.vocab_size)}" for i in range(3)]
    assert all(e["top_logprobs"] == [] for e in content)
    r = post(cluster, "/v1/chat/completions", {"model": "llumnix-sim", "messages": [{"role": "user", "content": "x"}],
                                                "top_logprobs": 2})
    assert_openai_error(r, 400, "top_logprobs")


# ---------------------------------------------------------------------- routes


def test_model_by_id(cluster):
    card = httpx.get(cluster.url + "/v1/models/llumnix-sim").json()
    assert card["id"] == "llumnix-sim" and card["object"] == "model" and card["max_model_len"] == 4096
    assert cluster.openai().models.retrieve("llumnix-sim").id == "llumnix-sim"
    for other in ("gpt-4", "llumnix-sim/x", "a%20b"):
        assert_openai_error(httpx.get(cluster.url + f"/v1/models/{other}"), 404, "model", "model_not_found")


def test_version(cluster):
    assert httpx.get(cluster.url + "/version").json() == {"version": importlib.metadata.version("llumnix-toolkit")}


def test_tokenize_and_detokenize(cluster):
    r = post(cluster, "/tokenize", {"model": "llumnix-sim", "prompt": "hello, world"})
    body = r.json()
    assert body["tokens"] == TOK.encode("hello, world") and body["count"] == 3 and body["max_model_len"] == 4096
    chat = post(cluster, "/tokenize", {"model": "llumnix-sim", "messages": [{"role": "user", "content": "hi"}],
                                       "return_token_strs": True}).json()
    assert chat["tokens"] == TOK.encode(TOK.apply_chat_template([{"role": "user", "content": "hi"}]))
    assert chat["token_strs"] == [TOK.decode_token(t) for t in chat["tokens"]]
    # the prompt a chat request is given: its usage counts exactly these tokens
    res = post(cluster, "/v1/chat/completions", {"model": "llumnix-sim", "messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 1}).json()
    assert res["usage"]["prompt_tokens"] == chat["count"]
    ids = [100, 200, 300]
    assert post(cluster, "/detokenize", {"model": "llumnix-sim", "tokens": ids}).json() == \
        {"prompt": "".join(TOK.decode_token(t) for t in ids)}
    assert post(cluster, "/detokenize", {"tokens": ids}).status_code == 200  # model is optional, as in vLLM
    assert_openai_error(post(cluster, "/detokenize", {"model": "llumnix-sim", "tokens": [CFG.vocab_size]}), 400, "tokens")
    assert_openai_error(post(cluster, "/detokenize", {"model": "llumnix-sim", "tokens": [-1]}), 400, "tokens")
    assert_openai_error(post(cluster, "/tokenize", {"model": "llumnix-sim"}), 400, "prompt")
    assert_openai_error(post(cluster, "/tokenize", {"model": "llumnix-sim", "prompt": "x", "messages": []}), 400)
    assert_openai_error(post(cluster, "/tokenize", {"model": "other", "prompt": "x"}), 404, "model")


def test_openapi_document_describes_every_route(cluster):
    doc = httpx.get(cluster.url + "/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    paths = doc["paths"]
    for path, method in [("/v1/completions", "post"), ("/v1/chat/completions", "post"), ("/tokenize", "post"),
                         ("/detokenize", "post"), ("/v1/models", "get"), ("/v1/models/{model_id}", "get"),
                         ("/version", "get"), ("/health", "get"), ("/metrics", "get")]:
        assert method in paths[path], path
    schemas = doc["components"]["schemas"]

    def body_schema(path):
        ref = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        return schemas[ref.rsplit("/", 1)[1]]

    completion = body_schema("/v1/completions")
    assert {"model", "prompt"} <= set(completion["required"])
    assert completion["properties"]["n"]["maximum"] == 32
    assert completion["properties"]["model"]["enum"] == ["llumnix-sim"]
    assert "messages" in body_schema("/v1/chat/completions")["properties"]
    assert "tokens" in body_schema("/detokenize")["required"]
    assert "ErrorResponse" in schemas
    assert httpx.get(cluster.url + "/docs").status_code == 200


# ---------------------------------------------------------------------- x-request-id


def test_client_request_id_is_honoured_and_echoed(cluster):
    r = post(cluster, "/v1/completions", {"model": "llumnix-sim", "prompt": "x", "max_tokens": 6, "ignore_eos": True},
             headers={"x-request-id": "client-id.42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-id.42"
    body = r.json()
    assert body["id"] == "cmpl-client-id.42"
    assert body["choices"][0]["text"] == expected_text("cmpl-client-id.42", 6)
    # the same id again, once the first is done: the same (deterministic) output
    again = post(cluster, "/v1/completions", {"model": "llumnix-sim", "prompt": "x", "max_tokens": 6, "ignore_eos": True},
                 headers={"x-request-id": "client-id.42"}).json()
    assert again["choices"][0]["text"] == body["choices"][0]["text"]
    chat = post(cluster, "/v1/chat/completions", {"model": "llumnix-sim", "messages": [{"role": "user", "content": "x"}],
                                                   "max_tokens": 2, "stream": True}, headers={"x-request-id": "c1"})
    assert chat.headers["x-request-id"] == "c1" and sse(chat.text)[0]["id"] == "chatcmpl-c1"
    # without one, the generated id is echoed
    plain = post(cluster, "/v1/completions", {"model": "llumnix-sim", "prompt": "x", "max_tokens": 1})
    assert plain.headers["x-request-id"] == plain.json()["id"]


@pytest.mark.parametrize("value", ["has space", "x" * 129, "", "tab\there", "ünï"])
def test_bad_request_ids_are_refused(cluster, value):
    r = httpx.post(cluster.url + "/v1/completions", json={"model": "llumnix-sim", "prompt": "x", "max_tokens": 1},
                   headers=[(b"x-request-id", value.encode())], timeout=30)
    assert_openai_error(r, 400, "x-request-id", "invalid_request_id")


def test_request_id_in_flight_is_a_conflict(cluster):
    seen: dict = {}
    body = {"model": "llumnix-sim", "prompt": "long", "max_tokens": 2000, "ignore_eos": True, "stream": True}

    def run():
        with httpx.stream("POST", cluster.url + "/v1/completions", json=body, headers={"x-request-id": "dup"},
                          timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    seen["running"] = True
                if seen.get("stop"):
                    break

    t = threading.Thread(target=run)
    t.start()
    try:
        deadline = time.monotonic() + 20
        while "running" not in seen and time.monotonic() < deadline:
            time.sleep(0.02)
        r = post(cluster, "/v1/completions", {"model": "llumnix-sim", "prompt": "x", "max_tokens": 1},
                 headers={"x-request-id": "dup"})
        assert_openai_error(r, 409, "x-request-id", "request_id_in_use")
        assert r.headers["x-request-id"] == "dup"
        # n > 1 whose sub-request ids would collide: cmpl-dup-0 is free, but a request "dup" with n = 2 is too
        assert post(cluster, "/v1/completions", {"model": "llumnix-sim", "prompt": "x", "max_tokens": 1, "n": 2},
                    headers={"x-request-id": "dup"}).status_code == 409
        client = cluster.admin()  # in-process: the CLI's start-up on a busy machine can outlast the stream
        try:
            listed = [r.request_id for r in client.requests().requests]
        finally:
            client.close()
        assert "cmpl-dup" in listed
    finally:
        seen["stop"] = True
        t.join(30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the stream closed: the id is free again
        r = post(cluster, "/v1/completions", {"model": "llumnix-sim", "prompt": "x", "max_tokens": 1},
                 headers={"x-request-id": "dup"})
        if r.status_code == 200:
            break
        time.sleep(0.1)
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------- unsupported fields


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
     "tool_choice"),  # "auto" by default: no tool-call parser
    ("/v1/chat/completions", {"logit_bias": {"42": 5}}, "logit_bias"),
    ("/v1/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"suffix": "tail"}, "suffix"),
    ("/v1/completions", {"best_of": 4}, "best_of"),
])
def test_unsupported_fields_are_400_naming_the_field(cluster, path, extra, param):
    body = {"model": "llumnix-sim", "max_tokens": 2, **extra}
    body.update({"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"})
    err = assert_openai_error(post(cluster, path, body), 400, param, "unsupported_parameter")
    assert param in err["message"]


def test_unsupported_with_the_openai_client(cluster):
    import openai

    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        cluster.openai().chat.completions.create(
            model="llumnix-sim", messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    assert httpx.get(cluster.url + "/health").status_code == 200


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("path, extra", [
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {}}}}),
    ("/v1/completions", {"structured_outputs": {"regex": "[0-9]+"}, "stream": True}),
    ("/v1/chat/completions", {"tools": [TOOL], "tool_choice": "required"}),
    ("/v1/chat/completions", {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}}),
])
def test_the_sim_engine_refuses_constrained_output(cluster, path, extra):
    """It makes tokens up: a grammar cannot be honoured, so the instance refuses the request, and the client
    gets a 400 saying so (streamed or not) instead of unconstrained output."""
    body = {"model": "llumnix-sim", "max_tokens": 2, **extra}
    body.update({"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"})
    err = assert_openai_error(post(cluster, path, body), 400)
    assert "sim engine cannot constrain its output" in err["message"] and "vllm backend" in err["message"]


def test_tool_and_structured_checks_are_vllms(cluster):
    for extra, param, text in [
        ({"tool_choice": "required"}, "tool_choice", "When using `tool_choice`, `tools` must be set."),
        ({"tools": []}, "tools", "`tools` must not be an empty array"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "the 'json_schema' field must be provided"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "one kind of constraints"),
        ({"guided_json": {"type": "object"}}, "guided_json", "use `structured_outputs`"),
    ]:
        body = {"model": "llumnix-sim", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}], **extra}
        err = assert_openai_error(post(cluster, "/v1/chat/completions", body), 400, param)
        assert text in err["message"]


# ---------------------------------------------------------------------- text as vLLM gives it


def _ends_in_partial_char(tok: HFTokenizer, vocab: int, n: int) -> str:
    """A request id whose sim output of n tokens decodes to text ending in an incomplete character."""
    for k in range(5000):
        rid = f"cmpl-partial-{k}"
        ids = [sim_token_id(rid, i, vocab) for i in range(n)]
        if tok.decode(ids).endswith("\ufffd") and not tok.decode(ids[:-1]).endswith("\ufffd"):
            return rid
    raise AssertionError("no such id in 5000")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from llumnixctl.lab.model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def test_trailing_partial_character_is_dropped_as_vllm_does(start_cluster, tiny_model):
    from tokenizers.decoders import DecodeStream

    tok = HFTokenizer(tiny_model)
    vocab, n = tok.vocab_size, 8
    c = start_cluster(instances=1, sets=[f"model.path={tiny_model}", "model.name=tiny", f"sim.vocab_size={vocab}"])
    rid = _ends_in_partial_char(tok, vocab, n)
    ids = [sim_token_id(rid, i, vocab) for i in range(n)]
    stream = DecodeStream(skip_special_tokens=True)  # vLLM's detokenizer
    want = "".join(stream.step(tok._tok, i) or "" for i in ids)
    assert not want.endswith("\ufffd") and tok.decode(ids).startswith(want)
    body = {"model": "tiny", "prompt": "x", "max_tokens": n, "ignore_eos": True}
    plain = post(c, "/v1/completions", body, headers={"x-request-id": rid.removeprefix("cmpl-")}).json()
    assert plain["id"] == rid
    assert plain["choices"][0]["text"] == want
    streamed = post(c, "/v1/completions", {**body, "stream": True}, headers={"x-request-id": rid.removeprefix("cmpl-")})
    assert "".join(ch["choices"][0]["text"] for ch in sse(streamed.text) if ch["choices"]) == want
    # /detokenize returns the whole decode, as vLLM's does
    assert post(c, "/detokenize", {"tokens": ids}).json()["prompt"] == tok._tok.decode(ids, skip_special_tokens=False)


# ---------------------------------------------------------------------- access log


def _access_lines(cluster, needle: str, timeout: float = 10) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        text = open(cluster.proc("proxy").log, errors="replace").read()
        lines = [line for line in text.splitlines() if needle in line]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.1)


def test_access_log_line_per_request(cluster):
    post(cluster, "/v1/completions", {"model": "llumnix-sim", "prompt": "a b c", "max_tokens": 5, "ignore_eos": True},
         headers={"x-request-id": "acc-1"})
    (line,) = _access_lines(cluster, "cmpl-acc-1 ")
    assert "/v1/completions model=llumnix-sim instance=i" in line and "status=200" in line
    assert "prompt_tokens=3 completion_tokens=5" in line and "finish_reason=length" in line
    assert "ttft_ms=" in line and "total_ms=" in line
    post(cluster, "/v1/chat/completions", {"model": "llumnix-sim", "messages": [{"role": "user", "content": "x"}],
                                           "max_tokens": 4, "n": 2, "ignore_eos": True, "stream": True},
         headers={"x-request-id": "acc-2"})
    (line,) = _access_lines(cluster, "chatcmpl-acc-2 ")
    assert "status=200" in line and "completion_tokens=8" in line and "finish_reason=length" in line
    post(cluster, "/v1/completions", {"model": "nope", "prompt": "x"}, headers={"x-request-id": "acc-3"})
    (line,) = _access_lines(cluster, "cmpl-acc-3 ")
    assert "status=404" in line and "model=nope" in line


def test_access_log_extra_fields_and_setting(tmp_path):
    from daemons.proxy.app import Job, Proxy

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep()
    logger = logging.getLogger("llumnix.access")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    proxy = Proxy(Config())
    try:
        job = Job(False, "x1", time.perf_counter() - 0.25)
        job.model, job.prompt_tokens = "llumnix-sim", 7
        proxy.access.write(job, False, job.arrival, 200)
        proxy.access.write(job, False, job.arrival, 200)  # once per request
        assert len(records) == 1
        rec = records[0]
        assert rec.name == "llumnix.access" and rec.levelno == logging.INFO
        assert (rec.request_id, rec.model, rec.status, rec.prompt_tokens, rec.completion_tokens) == \
            ("cmpl-x1", "llumnix-sim", 200, 7, 0)
        assert rec.total_ms >= 250 and rec.ttft_ms is None and rec.finish_reason is None and rec.instance == "-"
        proxy.access.enabled = False  # proxy.access_log = false
        proxy.access.write(Job(False, "x2", time.perf_counter()), False, time.perf_counter(), 200)
        assert len(records) == 1
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
        proxy.cluster.ctx.destroy(linger=0)
