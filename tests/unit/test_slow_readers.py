"""A client that stops reading a stream (its socket's buffers full: uvicorn's ``send`` no longer returns) is
cut off after proxy.write_timeout_s: the request is aborted on its instance, the proxy lets go of it, the
access line says 408, and a client that keeps reading is not touched (daemons/proxy/front/fastpath.py)."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from daemons.config import load_config
from daemons.proxy.app import build_app
from daemons.proxy.front.fastpath import M_SLOW_READERS, FastPath
from tests.unit.test_proxy_fastpath import Access, FakeInstance


@pytest.fixture()
def fast():
    cfg = load_config(None, ["model.max_model_len=4096", "proxy.write_timeout_s=0.3"])
    app = build_app(cfg)
    proxy = app.state.proxy
    proxy.cluster.token_address = "inproc://slow-proxy"
    instance = FakeInstance(proxy.cluster)
    yield FastPath(app, proxy, 1 << 20, cfg.proxy.write_timeout_s), proxy, instance
    proxy.cluster.ctx.destroy(linger=0)


async def _stream(app, stuck_after: int | None) -> tuple[list[dict], bool]:
    """POST a streamed completion; the client reads ``stuck_after`` body chunks, then reads nothing more (its
    send never returns). Returns what it received and whether its connection ended without a complete
    response (the server then closes it)."""
    body = json.dumps({"model": "llumnix-sim", "prompt": "hi", "max_tokens": 200, "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
    sent: list[dict] = []
    first = True
    never = asyncio.Event()
    done = asyncio.Event()

    async def receive():
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        chunks = sum(1 for m in sent if m["type"] == "http.response.body")
        if message["type"] == "http.response.body" and stuck_after is not None and chunks >= stuck_after:
            await never.wait()  # the client's buffers are full: this write never completes
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            done.set()

    await asyncio.wait_for(app(scope, receive, send), 10)
    complete = bool(sent) and sent[-1]["type"] == "http.response.body" and not sent[-1].get("more_body", False)
    done.set()
    return sent, not complete


def test_a_client_that_stops_reading_is_cut_off_and_its_request_aborted(fast):
    app, proxy, instance = fast
    logger = logging.getLogger("llumnix.access")
    handler, old = Access(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    before = M_SLOW_READERS.labels()._value.get()
    try:
        sent, cut = asyncio.run(_stream(app, stuck_after=1))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    assert cut and sent[0]["status"] == 200
    assert M_SLOW_READERS.labels()._value.get() == before + 1
    assert not proxy.active and not proxy.cluster.streams  # let go (and aborted, had it been running)
    assert len(handler.lines) == 1 and "status=408" in handler.lines[0]


def test_a_client_that_reads_is_not_cut_off(fast):
    app, proxy, _ = fast
    before = M_SLOW_READERS.labels()._value.get()
    sent, cut = asyncio.run(_stream(app, stuck_after=None))
    assert not cut and sent[-1]["body"].endswith(b"data: [DONE]\n\n")
    assert M_SLOW_READERS.labels()._value.get() == before and not proxy.active
