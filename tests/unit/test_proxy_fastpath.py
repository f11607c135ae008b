"""The completion routes' fast path (daemons/proxy/front/fastpath.py) answers exactly as the FastAPI path does.

One real proxy app (its Proxy, tokenizer, keys and limits) over a fake cluster whose "instance" streams
deterministic tokens; every request is sent to both ways of serving it, the raw ASGI fast path and FastAPI's
router, and the two answers must have the same status, headers and bytes, the same request counts and the
same access lines. A client that leaves mid-stream or before its first token aborts the request either way.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import re

import pytest

from daemons import wire
from daemons.config import load_config
from daemons.proxy.app import M_REQUESTS, build_app
from daemons.proxy.cluster.client import Stream
from daemons.proxy.front.fastpath import FastPath

KEY, LOW_KEY = "sk-fast-high", "sk-fast-low"
LIMIT = 2048


class FakeInstance:
    """Streams tokens 200, 201, ... (finish "length" at max_tokens) for every submitted request: the first
    output alone, then two per batch, one batch per loop turn; ``hold`` keeps a request's stream open after
    its first token (a client can then leave mid-stream), and ``on_held`` is called once that token is fed:
    the request then waits for tokens that do not come."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.hold = False
        self.on_held = None
        self.submitted: list[wire.Submit] = []
        cluster.submit = self.submit

    async def submit(self, sub: wire.Submit, tenant: str = "", weight: float = 1.0, give_up_s: float = 0.0,
                     slo_=None, fits=()) -> Stream:
        stream = Stream(sub.request_id, sub, slo_=slo_) if slo_ is not None else Stream(sub.request_id, sub)
        self.cluster.streams[sub.request_id] = stream
        self.submitted.append(sub)
        outs = [self.out(sub, i) for i in range(sub.sampling.max_tokens)]
        batches = [outs[:1]] + [outs[i:i + 2] for i in range(1, len(outs), 2)]
        if self.hold:
            batches = batches[:1]
        asyncio.get_running_loop().call_soon(self.feed, stream, batches, 0)
        return stream

    def feed(self, stream: Stream, batches: list[list[wire.TokenOut]], k: int) -> None:
        if stream.done:
            return
        if k < len(batches):
            for out in batches[k]:
                stream.feed(out)
            asyncio.get_running_loop().call_soon(self.feed, stream, batches, k + 1)
        elif self.hold and self.on_held is not None:
            self.on_held()

    @staticmethod
    def out(sub: wire.Submit, i: int) -> wire.TokenOut:
        last = i == sub.sampling.max_tokens - 1
        top = [(300 + i, -1.25), (200 + i, -0.5)] if sub.sampling.logprobs else None
        return wire.TokenOut(sub.request_id, i, 200 + i + (sub.sampling.seed or 0) % 7, "length" if last else None,
                             -0.5 - i / 8, top=top)


class Client:
    """Drives an ASGI app as uvicorn does (spec 2.3: a gone client is seen only through receive)."""

    def __init__(self, app):
        self.app = app

    async def request(self, path: str, body: bytes | list[bytes], headers: dict[str, str] | None = None,
                      leave_after: int | None = None, length: bool = True,
                      leave: asyncio.Event | None = None) -> tuple[int, list, bytes]:
        """``leave_after``: the client leaves after that many body chunks; ``leave``: once that event is set."""
        parts = body if isinstance(body, list) else [body]
        raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        if length:
            raw.append((b"content-length", str(sum(map(len, parts))).encode()))
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "root_path": "", "headers": raw, "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
        pending = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
        left = leave or asyncio.Event()
        ended = asyncio.Event()
        messages: list[dict] = []

        async def receive():
            if pending:
                return pending.pop(0)
            waits = [asyncio.ensure_future(left.wait()), asyncio.ensure_future(ended.wait())]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            return {"type": "http.disconnect"}

        async def send(message):
            if left.is_set():
                return  # uvicorn drops what is sent to a gone client
            messages.append(message)
            chunks = sum(1 for m in messages if m["type"] == "http.response.body" and m.get("body"))
            if leave_after is not None and chunks >= leave_after:
                left.set()
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                ended.set()

        task = asyncio.ensure_future(self.app(scope, receive, send))
        done, _ = await asyncio.wait({task}, timeout=5)
        assert done, "the app did not answer (or did not stop after its client left) within 5 s"
        task.result()
        start = next(m for m in messages if m["type"] == "http.response.start") if messages else {"status": None}
        headers_out = sorted((k.decode(), v.decode()) for k, v in start.get("headers", []))
        return start["status"], headers_out, b"".join(m.get("body", b"") for m in messages
                                                        if m["type"] == "http.response.body")


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    keys = tmp_path_factory.mktemp("fastpath") / "keys.toml"
    keys.write_text(f'[keys.high]\nkey = "{KEY}"\nhigh_priority = true\n[keys.low]\nkey = "{LOW_KEY}"\n')
    cfg = load_config(None, [f"proxy.api_keys_file={keys}", f"proxy.max_body_bytes={LIMIT}",
                             "model.max_model_len=64", "proxy.max_prompt_tokens=40"])
    app = build_app(cfg)
    proxy = app.state.proxy
    proxy.cluster.token_address = "inproc://fastpath-proxy"  # what start() would have bound (it is not started)
    instance = FakeInstance(proxy.cluster)
    yield {"fast": Client(FastPath(app, proxy, LIMIT)), "fastapi": Client(app)}, proxy, instance
    proxy.cluster.ctx.destroy(linger=0)


class Access(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        line = re.sub(r"(ttft_ms|total_ms)=\S+", r"\1=*", record.getMessage())
        self.lines.append(re.sub(r"cmpl-[0-9a-f]{32} ", "cmpl-* ", line))  # a generated id


def _same(both, path: str, body, headers: dict | None = None, **kw) -> tuple[int, list, bytes]:
    """Send the request both ways; assert the answers, counts and access lines agree; return the answer."""
    clients, proxy, _ = both
    logger = logging.getLogger("llumnix.access")
    old = logger.level
    logger.setLevel(logging.INFO)
    seen = {}
    try:
        for way, client in clients.items():
            handler = Access()
            logger.addHandler(handler)
            before = {s: M_REQUESTS.labels(path, s)._value.get() for s in _STATUSES}
            try:
                status, hdrs, data = asyncio.run(client.request(path, body, headers, **kw))
            finally:
                logger.removeHandler(handler)
            counted = {s: M_REQUESTS.labels(path, s)._value.get() - before[s] for s in _STATUSES}
            hdrs = [(k, v) for k, v in hdrs if k not in ("date", "server")]
            seen[way] = (status, hdrs, re.sub(rb'"created":\d+', b'"created":0', data), counted, handler.lines)
            assert not proxy.active and not proxy.cluster.streams, f"{way}: the request was not let go"
    finally:
        logger.setLevel(old)
    assert seen["fast"] == seen["fastapi"]
    assert sum(seen["fast"][3].values()) == 1 and len(seen["fast"][4]) == 1  # counted once, logged once
    return seen["fast"][:3]


_STATUSES = ("200", "400", "401", "403", "404", "413", "499", "500", "503")
AUTH = {"authorization": f"Bearer {KEY}"}


def _events(data: bytes) -> list:
    return [json.loads(e[6:]) if e != b"data: [DONE]" else "[DONE]" for e in data.strip().split(b"\n\n")]


# Requests past the limits that bound a request's work per token (proxy.max_stop_*), and JSON nested past what
# the decoder follows: a 400 naming the field, before any tokenizing.
LIMITS = [
    (b'{"model": "llumnix-sim", "prompt": "x", "stop": [' + b",".join(b'"s%d"' % i for i in range(33)) + b"]}", "stop"),
    (b'{"model": "llumnix-sim", "prompt": "x", "stop": "' + b"y" * 257 + b'"}', "stop"),
    (b'{"model": "llumnix-sim", "prompt": "x", "stop_token_ids": [' + b",".join(b"7" for _ in range(257)) + b"]}",
     "stop_token_ids"),
    (b'{"guided_json":' + b"[" * 1000 + b"]" * 1000 + b"}", None),  # within LIMIT bytes
]


@pytest.mark.parametrize("body, param", LIMITS, ids=["stops", "stop-length", "stop-token-ids", "nesting"])
def test_limits_name_the_field_and_the_setting(both, body, param):
    status, _, data = _same(both, "/v1/completions", body, AUTH)
    error = json.loads(data)["error"]
    assert status == 400 and error["param"] == param, error
    assert ("proxy.max_" in error["message"]) if param else ("nested too deeply" in error["message"]), error


def test_limits_at_the_bound_pass(both):
    body = {"model": "llumnix-sim", "prompt": "x", "max_tokens": 2, "stop": ["q" * 256] + [f"s{i}" for i in range(31)],
            "stop_token_ids": [7] * 256}
    status, _, data = _same(both, "/v1/completions", json.dumps(body).encode(), {**AUTH, "x-request-id": "fp-bound"})
    assert status == 200, data


@pytest.mark.parametrize("name,path,req", [
    ("stream", "/v1/completions", {"prompt": "hello there", "max_tokens": 5, "stream": True,
                                   "stream_options": {"include_usage": True}}),
    ("plain", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4}),
    ("logprobs", "/v1/completions", {"prompt": "x", "max_tokens": 3, "logprobs": 1, "stream": True,
                                     "return_token_ids": True}),
    ("stop", "/v1/completions", {"prompt": "x", "max_tokens": 8, "stop": ["unknown", None], "stream": True}),
    ("chat_n", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2,
                                        "seed": 3, "stream": True, "stream_options": {"include_usage": True}}),
    ("chat_lp", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                         "logprobs": True, "top_logprobs": 2}),
])
def test_answers_match(both, name, path, req):
    if name == "stop":  # a stop string that the fake's third token's text starts: the output stops before it
        third = both[1].tokenizer.decode_token(202)
        req = {**req, "stop": [third[:3]]}
    status, headers, data = _same(both, path, json.dumps({"model": "llumnix-sim", **req}).encode(),
                                  {**AUTH, "x-request-id": f"fp-{name}"})
    assert status == 200 and ("x-request-id", f"fp-{name}") in headers
    if req.get("stream"):
        assert ("content-type", "text/event-stream; charset=utf-8") in headers
        events = _events(data)
        assert events[-1] == "[DONE]" and all(e["id"].endswith(f"-fp-{name}") for e in events[:-1])
        if name == "stop":
            assert events[-2]["choices"][0]["finish_reason"] == "stop"
        if name == "chat_n":
            assert events[-2]["usage"]["completion_tokens"] == 6
    else:
        assert json.loads(data)["usage"]["completion_tokens"] == req["max_tokens"] * req.get("n", 1)


@pytest.mark.parametrize("path,body,headers,status", [
    ("/v1/completions", b'{"model": "llumnix-sim", "prompt": "x"}', {}, 401),  # no key
    ("/v1/completions", b'{"model": "llumnix-sim", "prompt": "x"}', {"authorization": "Bearer nope"}, 401),
    ("/v1/completions", b'{"model": "llumnix-sim", "prompt": "x", "priority": "high"}',
     {"authorization": f"Bearer {LOW_KEY}"}, 403),
    ("/v1/completions", b"{not json", AUTH, 400),
    ("/v1/completions", b"", AUTH, 400),
    ("/v1/completions", b'{"model": "other", "prompt": "x"}', {**AUTH, "x-request-id": "fp-e1"}, 404),
    ("/v1/completions", b'{"model": "llumnix-sim"}', AUTH, 400),
    ("/v1/completions", b'{"model": "llumnix-sim", "prompt": "x"}', {**AUTH, "x-request-id": "bad id"}, 400),
    ("/v1/completions", b'{"model": "llumnix-sim", "prompt": "' + b"a " * 50 + b'"}', AUTH, 400),  # too long
    ("/v1/completions", b'{"model": "llumnix-sim", "prompt": "x", "max_tokens": 100}', AUTH, 400),
    ("/v1/chat/completions", b'{"model": "llumnix-sim", "messages": [{"role": "user", "content": "x"}], '
                             b'"tools": [{"type": "function"}]}', AUTH, 400),
    ("/v1/chat/completions", b'{"model": "llumnix-sim", "messages": []}', {**AUTH, "x-request-id": "fp-e2"}, 400),
    ("/v1/completions", b"x" * (LIMIT + 1), AUTH, 413),  # by its Content-Length
] + [("/v1/completions", body, AUTH, 400) for body, _ in LIMITS])
def test_errors_match(both, path, body, headers, status):
    got, hdrs, data = _same(both, path, body, headers)
    assert got == status
    error = json.loads(data)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if "x-request-id" in headers and status != 400:
        assert ("x-request-id", headers["x-request-id"]) in hdrs
    if status == 401:
        assert any(k == "www-authenticate" for k, _ in hdrs)


def test_chunked_body_past_the_limit_is_413_both_ways(both):
    got, _, data = _same(both, "/v1/completions", [b'{"model": "llumnix-sim", "prompt": "', b"a" * LIMIT, b'"}'],
                         AUTH, length=False)
    assert got == 413 and json.loads(data)["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("stream", [True, False])
def test_client_leaving_aborts_both_ways(both, stream):
    """Mid-stream (after the first chunk), or while a non-streamed request waits for its tokens (the client
    leaves once the instance has sent the first token and holds the rest): the request is let go on both ways
    and logged once with 499."""
    _, _, instance = both
    instance.hold = True

    async def leave_while_waiting(client, body, headers):
        left = asyncio.Event()
        instance.on_held = left.set
        return await client.request("/v1/completions", body, headers, leave=left)

    try:
        body = json.dumps({"model": "llumnix-sim", "prompt": "x", "max_tokens": 20, "stream": stream}).encode()
        for way, client in both[0].items():
            handler = Access()
            logging.getLogger("llumnix.access").addHandler(handler)
            logging.getLogger("llumnix.access").setLevel(logging.INFO)
            headers = {**AUTH, "x-request-id": f"fp-leave-{stream}"}
            sent = len(instance.submitted)
            try:
                asyncio.run(client.request("/v1/completions", body, headers, leave_after=1) if stream
                            else leave_while_waiting(client, body, headers))
            finally:
                logging.getLogger("llumnix.access").removeHandler(handler)
            assert len(handler.lines) == 1 and "status=499" in handler.lines[0], (way, handler.lines)
            assert not both[1].active and not both[1].cluster.streams, way
            assert len(instance.submitted) == sent + 1, way  # it reached the instance before the client left
    finally:
        instance.hold = False
        instance.on_held = None


def test_request_path_leaves_no_reference_cycles(both):
    """Every object a request makes on the fast path is freed by reference counting: the proxy runs the
    garbage collector rarely on that basis (GC_THRESHOLD in daemons/proxy/app.py); a cycle per request (a
    cancelled task's traceback, a closure that names itself) would be garbage only the collector frees."""
    fast = both[0]["fast"].app
    bodies = [json.dumps({"model": "llumnix-sim", **req}).encode() for req in (
        {"prompt": "x y", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}},
        {"prompt": [5, 6], "max_tokens": 2},
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2, "stream": True},
        {"prompt": "x", "max_tokens": 2, "logprobs": 2, "stop": ["zz"]},
        {"prompt": "x", "model": "other"},  # 404
    )]

    async def one(body: bytes) -> None:  # a driver that makes no cycles of its own
        pending = [{"type": "http.request", "body": body, "more_body": False}]
        ended = asyncio.Event()

        async def receive():
            if pending:
                return pending.pop()
            await ended.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                ended.set()

        scope = {"type": "http", "method": "POST", "path": "/v1/completions" if b"prompt" in body else
                 "/v1/chat/completions", "headers": [(b"authorization", f"Bearer {KEY}".encode())]}
        await fast(scope, receive, send)
        await asyncio.sleep(0)  # the watcher's last turn

    async def run() -> list[str]:
        for body in bodies * 2:  # warm: caches, metric children
            await one(body)
        # Nothing pending from earlier tests in this process (an xdist worker runs many): collect until a pass
        # finds nothing, since a finalizer run by one pass can release more (figures that other tests drew).
        for _ in range(10):
            if not gc.collect():
                break
        gc.garbage.clear()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for body in bodies * 4:
                await one(body)
            gc.collect()
            return [type(o).__name__ for o in gc.garbage]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()

    assert asyncio.run(run()) == []


def test_error_counts_are_labelled_by_route_not_by_raw_path(both):
    """Every /v1/models/<anything> would otherwise add a series to the proxy's metrics for good."""
    from fastapi.testclient import TestClient

    from daemons import metrics

    client = TestClient(both[0]["fastapi"].app)
    for i in range(3):
        assert client.get(f"/v1/models/nope-{i}", headers=AUTH).status_code == 404
    routes = {s.labels["route"] for m in metrics.P_REQUESTS.family.collect() for s in m.samples
              if s.labels.get("status") == "404"}
    assert "/v1/models/{model_id:path}" in routes and not any("nope" in r for r in routes), routes
