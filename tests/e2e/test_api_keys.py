"""API keys and size limits of the proxy's HTTP API (proxy.api_keys_file, proxy.max_body_bytes,
proxy.max_prompt_tokens, security.metrics_token_file), through a real cluster and the official openai client,
and the proxy's refusal to listen beyond loopback without keys (the keys file itself: tests/unit/test_api_keys_file.py).
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from daemons.config import SimConfig
from daemons.engine.sim import sim_token_id
from daemons.proxy.api.tokenizer import SimTokenizer
from llumnixctl.lab import localcluster
from tests.conftest import FAST, UP_TIMEOUT_S, Cluster
from tests.support.apikeys import KEYS, LIMITED, METRICS_TOKEN, render
from tests.streams import wait_for

pytestmark = pytest.mark.e2e

MODEL = "llumnix-sim"
MAX_BODY = 65536
MAX_PROMPT = 40
TOK = SimTokenizer(SimConfig().vocab_size, SimConfig().eos_token_id)


def expected_text(request_id: str, n: int) -> str:
    return "".join(TOK.decode_token(sim_token_id(request_id, i, SimConfig().vocab_size)) for i in range(n))


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """One instance behind a proxy with API keys, a metrics token and small size limits."""
    files = tmp_path_factory.mktemp("keys")
    keys_path = files / "keys.toml"
    keys_path.write_text(render())
    token_path = files / "metrics.token"
    token_path.write_text(METRICS_TOKEN + "\n")
    run_dir = tmp_path_factory.mktemp("keyed")
    sets = FAST + [f"proxy.api_keys_file={keys_path}", f"security.metrics_token_file={token_path}",
                   f"proxy.max_body_bytes={MAX_BODY}", f"proxy.max_prompt_tokens={MAX_PROMPT}"]
    cluster = Cluster(localcluster.up(run_dir, 1, "sim", 0, None, sets, timeout_s=UP_TIMEOUT_S), run_dir)
    cluster.keys_path = keys_path
    cluster.proxy_pid = cluster.proc("proxy").pid
    try:
        yield cluster
    finally:
        cluster.stop()


def client(cluster, name: str | None = None, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key=key or KEYS[name][0], max_retries=0)


def bearer(name: str) -> dict:
    return {"authorization": f"Bearer {KEYS[name][0]}"}


def post(cluster, path: str, body: dict | None = None, headers: dict | None = None, **kw) -> httpx.Response:
    return httpx.post(cluster.url + path, json=body, headers=headers, timeout=30, **kw)


def assert_error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error" and err["code"] == code
    return err


def access_line(cluster, needle: str) -> str:
    def find():
        text = Path(cluster.proc("proxy").log).read_text(errors="replace")
        return next((line for line in text.splitlines() if "access " in line and needle in line), None)

    return wait_for(find, 10, f"an access line with {needle!r}")


def complete(c: openai.OpenAI, extra_body: dict | None = None, **kw):
    return c.completions.create(model=MODEL, prompt="one two three", max_tokens=5,
                                extra_body={"ignore_eos": True, **(extra_body or {})}, **kw)


# ---------------------------------------------------------------------- 401


def test_no_key_is_401_with_the_openai_body(keyed):
    with pytest.raises(openai.AuthenticationError) as err:
        complete(client(keyed, "alice"), extra_headers={"Authorization": openai.Omit()})
    assert err.value.status_code == 401
    assert err.value.body["code"] == "invalid_api_key" and err.value.body["type"] == "invalid_request_error"
    assert "Authorization" in err.value.body["message"] and err.value.body["param"] is None
    assert err.value.response.headers["www-authenticate"].startswith("Bearer")
    r = post(keyed, "/v1/completions", {"model": MODEL, "prompt": "x"}, headers={"x-request-id": "nokey-1"})
    assert_error(r, 401, "invalid_api_key")
    assert r.headers["www-authenticate"] == "Bearer"
    line = access_line(keyed, "status=401")
    assert "/v1/completions" in line and "key_name=-" in line


@pytest.mark.parametrize("header", ["Bearer sk-wrong-0000000000", "Basic YWxpY2U6cHc=", "Bearer", "sk-alice",
                                    f"Bearer {KEYS['alice'][0]}x", f"Bearer {KEYS['alice'][0][:-1]}"])
def test_wrong_or_malformed_key_is_401(keyed, header):
    r = httpx.get(keyed.url + "/v1/models", headers={"authorization": header}, timeout=10)
    assert_error(r, 401, "invalid_api_key")
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert KEYS["alice"][0] not in r.text


def test_wrong_key_with_the_openai_client(keyed):
    for kw in ({}, {"stream": True}):
        with pytest.raises(openai.AuthenticationError) as err:
            complete(client(keyed, key="sk-not-a-key-123456"), **kw)
        assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(keyed, key="sk-not-a-key-123456").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)


def test_every_v1_route_and_tokenize_need_a_key_health_and_version_do_not(keyed):
    no_key = [("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL}"), ("GET", "/v1/no-such-route"),
              ("POST", "/v1/chat/completions"), ("POST", "/tokenize"), ("POST", "/detokenize")]
    for method, path in no_key:
        r = httpx.request(method, keyed.url + path, json={"model": MODEL, "prompt": "x", "tokens": [5]}, timeout=10)
        assert_error(r, 401, "invalid_api_key")
    with_key = bearer("alice")
    assert httpx.get(keyed.url + "/v1/models", headers=with_key, timeout=10).json()["data"][0]["id"] == MODEL
    assert httpx.get(keyed.url + f"/v1/models/{MODEL}", headers=with_key, timeout=10).status_code == 200
    assert httpx.get(keyed.url + "/v1/no-such-route", headers=with_key, timeout=10).status_code == 404
    assert post(keyed, "/tokenize", {"model": MODEL, "prompt": "a b c"}, headers=with_key).json()["count"] == 3
    assert post(keyed, "/detokenize", {"model": MODEL, "tokens": [5, 6]}, headers=with_key).status_code == 200
    assert httpx.get(keyed.url + "/health", timeout=10).status_code == 200
    assert httpx.get(keyed.url + "/version", timeout=10).json()["version"]
    assert [m.id for m in client(keyed, "alice").models.list()] == [MODEL]


def test_openapi_document_has_the_bearer_scheme(keyed):
    doc = httpx.get(keyed.url + "/openapi.json", timeout=10).json()
    assert doc["components"]["securitySchemes"]["bearer"] == {
        "type": "http", "scheme": "bearer", "description": "an API key of proxy.api_keys_file"}
    for path, method in [("/v1/completions", "post"), ("/v1/chat/completions", "post"), ("/v1/models", "get"),
                         ("/tokenize", "post"), ("/metrics", "get")]:
        assert doc["paths"][path][method]["security"] == [{"bearer": []}], path
        assert "401" in doc["paths"][path][method]["responses"]
    assert "403" in doc["paths"]["/v1/completions"]["post"]["responses"]
    assert "413" in doc["paths"]["/tokenize"]["post"]["responses"]
    assert "security" not in doc["paths"]["/health"]["get"] and "security" not in doc["paths"]["/version"]["get"]


# ---------------------------------------------------------------------- good keys


def test_a_good_key_serves_completions_and_chat_streamed_or_not(keyed):
    c = client(keyed, "alice")
    res = complete(c)
    assert res.choices[0].text == expected_text(res.id, 5) and res.usage.completion_tokens == 5
    chunks = list(complete(c, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == expected_text(chunks[0].id, 5)
    msgs = [{"role": "user", "content": "hello"}]
    chat = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == expected_text(chat.id, 4)
    stream = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == expected_text(stream[0].id, 4)


def test_the_key_name_not_the_key_is_in_the_access_line(keyed):
    r = post(keyed, "/v1/completions", {"model": MODEL, "prompt": "a b", "max_tokens": 2, "ignore_eos": True},
             headers={**bearer("alice"), "x-request-id": "keyname-1"})
    assert r.status_code == 200, r.text
    line = access_line(keyed, "cmpl-keyname-1 ")
    assert "status=200" in line and line.rstrip().endswith("key_name=alice")
    assert KEYS["alice"][0] not in line


def test_a_sha256_key_works(keyed):
    res = complete(client(keyed, "hashed"))
    assert res.usage.completion_tokens == 5
    assert "key_name=hashed" in access_line(keyed, res.id + " ")
    # the stored digest itself is not a key
    digest = hashlib.sha256(KEYS["hashed"][0].encode()).hexdigest()
    with pytest.raises(openai.AuthenticationError):
        complete(client(keyed, key=digest))


# ---------------------------------------------------------------------- 403: priority high


def test_priority_high_needs_a_key_with_high_priority(keyed):
    with pytest.raises(openai.PermissionDeniedError) as err:
        complete(client(keyed, "alice"), extra_body={"priority": "high"})
    assert err.value.status_code == 403
    body = err.value.body
    assert body["code"] == "permission_denied" and body["param"] == "priority"
    assert "alice" in body["message"] and "high_priority" in body["message"]
    # the header asks for the same thing
    r = post(keyed, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
             headers={**bearer("alice"), "x-llumnix-priority": "high"})
    assert_error(r, 403, "permission_denied")
    # priority normal is anyone's
    assert complete(client(keyed, "alice"), extra_body={"priority": "normal"}).usage
    res = complete(client(keyed, "boss"), extra_body={"priority": "high"})
    assert res.choices[0].text == expected_text(res.id, 5)
    streamed = list(complete(client(keyed, "boss"), stream=True, extra_body={"priority": "high"}))
    assert streamed[-1].choices[0].finish_reason == "length"


# ---------------------------------------------------------------------- 413 and 400


def test_a_body_over_max_body_bytes_is_413_by_content_length(keyed):
    body = b'{"model": "llumnix-sim", "prompt": "' + b"a " * MAX_BODY + b'"}'
    r = httpx.post(keyed.url + "/v1/completions", content=body, timeout=30,
                   headers={**bearer("alice"), "content-type": "application/json"})
    assert r.request.headers["content-length"] == str(len(body))
    err = assert_error(r, 413, "request_too_large")
    assert str(MAX_BODY) in err["message"] and "proxy.max_body_bytes" in err["message"]


def test_a_chunked_body_growing_past_max_body_bytes_is_413(keyed):
    def chunks():
        yield b'{"model": "llumnix-sim", "prompt": "'
        for _ in range(2 * MAX_BODY // 8192):
            yield b"a " * 4096
        yield b'"}'

    for path in ("/v1/completions", "/tokenize"):
        r = httpx.post(keyed.url + path, content=chunks(), timeout=30,
                       headers={**bearer("alice"), "content-type": "application/json"})
        assert r.request.headers["transfer-encoding"] == "chunked" and "content-length" not in r.request.headers
        assert_error(r, 413, "request_too_large")
    # just under the limit is a body like any other (here: a prompt too long)
    small = b'{"model": "llumnix-sim", "prompt": "' + b"a " * ((MAX_BODY - 64) // 2) + b'"}'
    r = httpx.post(keyed.url + "/v1/completions", content=iter([small]), timeout=30,
                   headers={**bearer("alice"), "content-type": "application/json"})
    assert_error(r, 400, "prompt_too_long")


def test_a_prompt_over_max_prompt_tokens_is_400(keyed):
    c = client(keyed, "alice")
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model=MODEL, prompt=" ".join(["w"] * (MAX_PROMPT + 1)), max_tokens=2)
    assert err.value.body["code"] == "prompt_too_long" and err.value.body["param"] == "prompt"
    assert f"at most {MAX_PROMPT} tokens" in err.value.body["message"] and "proxy.max_prompt_tokens" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:  # token ids: the list's length
        c.completions.create(model=MODEL, prompt=[5] * (MAX_PROMPT + 1), max_tokens=2)
    assert err.value.body["code"] == "prompt_too_long"
    with pytest.raises(openai.BadRequestError) as err:  # chat: the rendered template's tokens
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w " * MAX_PROMPT}], max_tokens=2)
    assert err.value.body["param"] == "messages"
    res = c.completions.create(model=MODEL, prompt=[5] * MAX_PROMPT, max_tokens=2, extra_body={"ignore_eos": True})
    assert res.usage.prompt_tokens == MAX_PROMPT  # the limit itself is allowed
    # and the context limit still applies on its own
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model=MODEL, prompt=[5] * 10, max_tokens=5000)
    assert "maximum context length" in err.value.body["message"]


# ---------------------------------------------------------------------- /metrics


def test_metrics_needs_the_metrics_token(keyed):
    r = httpx.get(keyed.url + "/metrics", timeout=10)
    assert_error(r, 401, "invalid_api_key")
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert httpx.get(keyed.url + "/metrics", headers=bearer("boss"), timeout=10).status_code == 401  # an API key is not it
    r = httpx.get(keyed.url + "/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"}, timeout=10)
    assert r.status_code == 200 and "llumnix_proxy_requests_total" in r.text
    assert 'status="401"' in r.text  # the refused requests are counted


def test_a_key_past_its_requests_per_minute_gets_429_with_retry_after(keyed):
    c = client(keyed, key=LIMITED)
    assert complete(c).usage.completion_tokens == 5
    with pytest.raises(openai.RateLimitError) as exc:
        complete(c)
    r = exc.value.response
    err = r.json()["error"]
    assert r.status_code == 429 and err["code"] == "requests_per_minute" and err["type"] == "rate_limit_exceeded"
    assert "'limited'" in err["message"] and 1 <= int(r.headers["retry-after"]) <= 60
    assert complete(client(keyed, "alice")).usage.completion_tokens == 5  # the other keys are not touched
    m = httpx.get(keyed.url + "/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"}, timeout=10).text
    assert 'llumnix_proxy_tenant_rejections_total{key="limited"' in m and 'reason="requests_per_minute"' in m


# ---------------------------------------------------------------------- revoking and reloading


def test_a_key_revoked_in_the_file_stops_working_without_a_restart(keyed):
    victim = client(keyed, "victim")
    assert complete(victim).usage.completion_tokens == 5
    keyed.keys_path.write_text(render(disabled={"victim"}))

    def refused():
        try:
            victim.models.list()
        except openai.AuthenticationError:
            return True
        return False

    wait_for(refused, 5, "the revoked key being refused")
    with pytest.raises(openai.AuthenticationError):
        complete(victim, stream=True)
    assert complete(client(keyed, "alice")).usage.completion_tokens == 5  # the others go on
    assert keyed.proc("proxy").pid == keyed.proxy_pid


def test_sighup_reloads_the_keys_file_at_once(keyed):
    hup = client(keyed, "hup")
    assert [m.id for m in hup.models.list()] == [MODEL]
    path = keyed.keys_path
    before = os.stat(path)
    with open(path, "r+") as f:  # the same file, size and mtime: only a SIGHUP can tell the proxy
        f.write(render(disabled={"victim", "hup"}))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_mtime_ns, after.st_size, after.st_ino) == (before.st_mtime_ns, before.st_size, before.st_ino)
    os.kill(keyed.proxy_pid, signal.SIGHUP)

    def refused():
        try:
            hup.models.list()
        except openai.AuthenticationError:
            return True
        return False

    wait_for(refused, 5, "the key disabled before SIGHUP being refused")
    assert psutil.pid_exists(keyed.proxy_pid)


def test_the_proxy_still_serves_after_all_of_it(keyed):
    # runs last in this module: every refusal above left the same proxy process serving
    proxy = keyed.proc("proxy")
    assert proxy.pid == keyed.proxy_pid and proxy.process() is not None
    res = complete(client(keyed, "boss"), extra_body={"priority": "high"})
    assert res.choices[0].text == expected_text(res.id, 5)
    log = Path(proxy.log).read_text(errors="replace")
    assert "Traceback" not in log and "internal error" not in log
    for key, _, _ in KEYS.values():
        assert key not in log  # names, never keys
    assert "API keys reloaded" in log


# ---------------------------------------------------------------------- listening beyond loopback


def run_proxy(tmp_path, sets: list[str], wait_for_line: str | None, timeout: float = 30) -> tuple[int | None, str]:
    """Start llumnix-proxy on an ephemeral port (no manager needed to start); with ``wait_for_line``, wait
    until its log has that line, then stop it. Returns (exit status, log)."""
    argv = [sys.executable, "-m", "daemons.proxy.app", "--set", "proxy.port=0",
            "--set", f"manager.address=tcp://127.0.0.1:{localcluster.free_port()}"]
    argv += [a for s in sets for a in ("--set", s)]
    log_path = tmp_path / f"proxy-{len(list(tmp_path.iterdir()))}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        if wait_for_line is None:
            return proc.wait(timeout=timeout), log_path.read_text()
        wait_for(lambda: wait_for_line in log_path.read_text() or proc.poll() is not None, timeout,
                 f"{wait_for_line!r} in the proxy's log")
        alive = proc.poll() is None
        proc.terminate()
        rc = proc.wait(timeout=15)
        return (rc if alive else None), log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_no_start_beyond_loopback_without_keys(tmp_path, host):
    rc, log = run_proxy(tmp_path, [f"proxy.host={host}"], None)
    assert rc == 1, log
    lines = log.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in log, log
    assert f"proxy.host = {host} listens beyond loopback without proxy.api_keys_file" in lines[0]
    assert "security.trusted_network = true" in lines[0] and "llumnix-proxy(8)" in lines[0]


@pytest.mark.parametrize("how", ["trusted_network", "api_keys_file"])
def test_beyond_loopback_with_keys_or_a_trusted_network(tmp_path, how):
    keys = tmp_path / "keys.toml"
    keys.write_text(render())
    sets = ["proxy.host=0.0.0.0", "security.trusted_network=true" if how == "trusted_network"
            else f"proxy.api_keys_file={keys}"]
    rc, log = run_proxy(tmp_path, sets, "serving the OpenAI API on http://0.0.0.0:")
    assert rc == 0, log  # it served, then stopped cleanly on SIGTERM
    assert ("API keys: 6 enabled" in log) is (how == "api_keys_file")


def test_a_bad_keys_file_stops_the_start(tmp_path):
    keys = tmp_path / "keys.toml"
    keys.write_text('[keys.carol]\nkey = "sk-carol-1"\nhigh_priority = "yes"\n')
    rc, log = run_proxy(tmp_path, [f"proxy.api_keys_file={keys}"], None)
    assert rc == 1 and "Traceback" not in log, log
    assert f"cannot start: {keys}: [keys.carol]: high_priority must be true or false" in log
    rc, log = run_proxy(tmp_path, [f"proxy.api_keys_file={tmp_path / 'missing.toml'}"], None)
    assert rc == 1 and "cannot read the API keys file" in log and "missing.toml" in log, log
