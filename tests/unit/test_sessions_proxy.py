"""Sessions at the proxy, without daemons: how a request names its session and retention (400s included), the
session table, and admission that does not count a session's cached prompt as queued work."""

from __future__ import annotations

import msgspec
import pytest

from daemons import prefix, wire
from daemons.config import ConfigError, load_config
from daemons.proxy.api.errors import ApiError
from daemons.proxy.api.protocol import ChatRequest, CompletionRequest, decode_body
from daemons.proxy.api.sessions import DAY_S, Session, retention_s, session_of
from daemons.proxy.cluster.client import ClusterClient, Overloaded
from daemons.sessions import SessionTable


class Headers(dict):
    pass


def body(**kw) -> ChatRequest:
    return decode_body(msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}),
                       ChatRequest)


def test_prompt_cache_key_names_the_session_else_the_header_else_none():
    h = Headers({"x-session-id": "from-header"})
    assert session_of(body(prompt_cache_key="conv-1"), h, "x-session-id", 0) == Session("conv-1", 0.0)
    assert session_of(body(), h, "x-session-id", 0) == Session("from-header", 0.0)
    assert session_of(body(), h, "", 0) == Session("", 0.0)  # sessions.header = "": the body alone names them
    assert session_of(body(), Headers(), "x-session-id", 0) == Session()
    completion = decode_body(b'{"model": "m", "prompt": "x", "prompt_cache_key": "c"}', CompletionRequest)
    assert session_of(completion, Headers(), "x-session-id", 0).name == "c"


def test_retention_in_memory_is_the_default_and_24h_the_bound():
    assert retention_s(None, 600) == retention_s("in_memory", 600) == retention_s("in-memory", 600) == 0.0
    assert retention_s("24h", 600) == 600.0
    assert retention_s("24h", 0) == DAY_S
    assert session_of(body(prompt_cache_key="k", prompt_cache_retention="24h"), Headers(), "x", 3600).retain_s == 3600


@pytest.mark.parametrize("fields, param", [
    ({"prompt_cache_key": 12}, "prompt_cache_key"),
    ({"prompt_cache_key": "x" * 257}, "prompt_cache_key"),
    ({"prompt_cache_retention": 5}, "prompt_cache_retention"),
])
def test_a_bad_session_field_is_a_400_naming_it(fields, param):
    with pytest.raises(ApiError) as exc:
        body(**fields)
    assert exc.value.status == 400 and exc.value.param == param


def test_an_unknown_retention_or_an_overlong_header_is_a_400():
    with pytest.raises(ApiError) as exc:
        body(prompt_cache_retention="forever")
    assert exc.value.status == 400 and exc.value.param == "prompt_cache_retention"
    with pytest.raises(ApiError) as exc:
        retention_s("forever", 0)
    assert exc.value.status == 400 and exc.value.param == "prompt_cache_retention"
    with pytest.raises(ApiError) as exc:
        session_of(body(), Headers({"x-session-id": "s" * 300}), "x-session-id", 0)
    assert exc.value.status == 400 and exc.value.param == "x-session-id"


def test_a_bad_session_header_setting_names_the_key():
    with pytest.raises(ConfigError, match="sessions.header"):
        load_config(None, ["sessions.header=x session"])


def test_the_session_table_is_bounded_least_recently_seen_first():
    now = [0.0]
    t = SessionTable(2, lambda: now[0])
    t.placed("a", "i0", [1, 2], 40)
    now[0] = 1.0
    t.placed("b", "i1", [3], 20)
    t.placed("a", "i2", [1, 2, 4], 60)  # "a" seen again: "b" is now the oldest
    t.placed("c", "i0", [], 10)
    assert len(t) == 2 and "b" not in t and t.forgotten == 1
    assert (t.home("a"), t.keys("a")) == ("i2", [1, 2, 4])
    engine, host = prefix.PrefixIndex(), prefix.PrefixIndex()
    engine.stored("i2", [1, 2])
    host.stored("i2", [4])
    host.stored("i1", [1])
    now[0] = 5.0
    rows = t.rows(lambda keys: prefix.match_tiers(engine, host, keys))
    assert [r.session for r in rows] == ["c", "a"]  # most recently seen first
    a = rows[1]
    assert (a.instance_id, a.turns, a.prompt_tokens, a.blocks) == ("i2", 2, 60, 3)
    assert (a.age_s, a.idle_s) == (5.0, 4.0)
    assert a.engine_blocks == {"i2": 2} and a.host_blocks == {"i2": 1, "i1": 1}
    assert len(t.rows(lambda keys: {}, limit=1)) == 1


# ------------------------------------------------------------------ admission

_made: list[ClusterClient] = []


@pytest.fixture(autouse=True)
def _close():
    yield
    while _made:
        _made.pop().ctx.destroy(linger=0)


def client(*sets: str) -> ClusterClient:
    c = ClusterClient(load_config(None, list(sets)))
    _made.append(c)
    return c


FIT = wire.LatencyFit(steps=50, prefill_ms=5.0, prefill_ms_per_token=0.5, decode_ms=10.0, decode_ms_per_seq=1.0,
                      chunk_tokens=2048, finish_rate=5.0)


def beat(iid: str, latency=None, blocks_used: int = 100) -> wire.Heartbeat:
    load = wire.InstanceLoad(blocks_total=1000, blocks_used=blocks_used, running=1, waiting=0, batch_size=8,
                             block_size=16, latency=latency, context_tokens=100)
    return wire.Heartbeat(iid, f"tcp://127.0.0.1:{1000 + len(iid)}", True, load, True)


def test_our_dispatches_count_as_queued_work_without_their_cached_tokens():
    """The issue's failure: a conversation's turns refused for "prompt tokens would wait" that were all cached."""
    c = client("admission.max_queued_tokens=1000", "admission.max_queued_requests=1000")
    c.known.beats = {"a": beat("a", blocks_used=1000)}  # no free KV: every queued token counts
    load = c.known.beats["a"].load
    for _ in range(4):  # four turns of 3000 tokens, 2900 of each cached on "a"
        c.view.sent_to("a", load, 3000, 16, cached_tokens=2900)
    c.admit(0)  # 4 x (3008 - 2900) = 432 tokens of work: admitted
    c.view.sent_to("a", load, 3000, 16)  # one without a cache: 3008 more
    with pytest.raises(Overloaded) as exc:
        c.admit(0)
    assert exc.value.reason == "queued_tokens"


def test_the_slo_prediction_does_not_count_a_sessions_cached_prompt():
    c = client("slo.ttft_ms=1000")
    c.known.beats = {"a": beat("a", FIT), "b": beat("b", FIT)}
    keys = list(range(1, 501))  # the session's last prompt: 500 blocks of 16 tokens
    c.sessions.placed("conv", "a", keys, 8000)
    c.cache_index.index.stored("a", keys[:300])  # its engine holds 300 of them
    c.cache_index.host.stored("a", keys[300:])  # its host tier the other 200
    with pytest.raises(Overloaded) as exc:  # 8100 tokens to prefill at 0.5 ms: past 0.8 x 1 s anywhere
        c.admit(0, prompt_tokens=8100)
    assert exc.value.reason == "ttft"
    verdict = c.admit(0, prompt_tokens=8100, session="conv")  # 100 uncached on "a"
    assert verdict.admitted and verdict.fits == ("a",)
    assert c.admission.cached("conv", 8100) == {"a": 8000}
    assert c.admission.cached("other", 8100) == {}
