"""Tenants: per-key limits (daemons/proxy/front/tenants.py) and the fair queue between keys (daemons/proxy/cluster/fairness.py),
alone on a hand-driven clock, then through the proxy's HTTP path with a keys file (429, Retry-After, the
code naming the limit, the metric by key and reason, and the limit given back when a request ends)."""

from __future__ import annotations

import asyncio
import json

import pytest

from daemons.config import load_config
from daemons.proxy.front.apikeys import ApiKeysError, Principal, parse
from daemons.proxy.app import build_app
from daemons.proxy.cluster.fairness import ACTIVE_S, FairQueue
from daemons.proxy.cluster.telemetry import M_TENANT_REJECTED
from daemons.proxy.front.tenants import TenantLimited, Tenants
from tests.unit.test_proxy_fastpath import Client, FakeInstance


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


# ---------------------------------------------------------------- limits


def test_requests_per_minute_refuses_past_the_bucket_and_says_when_to_retry():
    clock = Clock()
    t = Tenants(clock)
    p = Principal("a", requests_per_minute=3)
    for _ in range(3):
        t.release(t.enter(p), 0)
    with pytest.raises(TenantLimited) as exc:
        t.enter(p)
    assert exc.value.reason == "requests_per_minute" and exc.value.retry_after == 20  # one request per 20 s
    clock.t += 20
    t.enter(p)  # refilled by one
    with pytest.raises(TenantLimited):
        t.enter(p)


def test_another_key_is_not_limited_by_the_first():
    t = Tenants(Clock())
    a, b = Principal("a", requests_per_minute=1), Principal("b", requests_per_minute=1)
    t.enter(a)
    with pytest.raises(TenantLimited):
        t.enter(a)
    t.enter(b)


def test_concurrency_counts_requests_in_flight_and_frees_on_release():
    t = Tenants(Clock())
    p = Principal("a", max_concurrent_requests=2)
    first, second = t.enter(p), t.enter(p)
    with pytest.raises(TenantLimited) as exc:
        t.enter(p)
    assert exc.value.reason == "concurrent_requests" and exc.value.retry_after == 1
    t.release(first, 0)
    t.release(first, 0)  # idempotent: frees one slot only
    t.enter(p)
    with pytest.raises(TenantLimited):
        t.enter(p)
    assert t.in_flight("a") == 2 and second


def test_tokens_per_minute_charges_the_estimate_and_gives_back_what_was_not_generated():
    clock = Clock()
    t = Tenants(clock)
    p = Principal("a", tokens_per_minute=600)  # 10 tokens a second
    ticket = t.enter(p)
    t.charge(p, ticket, 500)
    second = t.enter(p)
    with pytest.raises(TenantLimited) as exc:
        t.charge(p, second, 200)  # 100 left
    assert exc.value.reason == "tokens_per_minute" and exc.value.retry_after == 10  # 100 more at 10/s
    assert t.in_flight("a") == 1  # the refused request no longer counts
    t.release(ticket, 150)  # used 150 of 500: 350 back
    third = t.enter(p)
    t.charge(p, third, 400)  # 450 available


def test_a_request_larger_than_the_whole_bucket_waits_for_a_full_bucket_not_for_ever():
    clock = Clock()
    t = Tenants(clock)
    p = Principal("a", tokens_per_minute=100)
    t.charge(p, t.enter(p), 1000)  # a full bucket lets it through, into debt
    with pytest.raises(TenantLimited) as exc:
        t.charge(p, t.enter(p), 1)
    assert exc.value.retry_after == 541  # 901 tokens of debt and one more, at 100 a minute
    clock.t += 541
    t.charge(p, t.enter(p), 1)


def test_a_limit_changed_by_a_reload_applies_to_the_next_request():
    clock = Clock()
    t = Tenants(clock)
    t.enter(Principal("a", requests_per_minute=1))
    with pytest.raises(TenantLimited):
        t.enter(Principal("a", requests_per_minute=1))
    t.enter(Principal("a", requests_per_minute=10))  # nine more fit in the larger bucket
    t.enter(Principal("a"))  # no limit at all


@pytest.mark.parametrize("field, value, says", [
    ("requests_per_minute", "-1", "requests_per_minute must be a whole number >= 0"),
    ("tokens_per_minute", "1.5", "tokens_per_minute must be a whole number >= 0"),
    ("max_concurrent_requests", "true", "max_concurrent_requests must be a whole number >= 0"),
    ("weight", "0", "weight must be a number > 0"),
    ("weight", '"x"', "weight must be a number > 0"),
])
def test_a_bad_limit_in_the_keys_file_names_the_file_the_key_and_the_field(field, value, says):
    with pytest.raises(ApiKeysError) as exc:
        parse("/etc/keys.toml", f'[keys.alice]\nkey = "sk-a"\n{field} = {value}\n')
    assert str(exc.value).startswith("/etc/keys.toml: [keys.alice]: " + says)


def test_the_keys_file_carries_limits_and_weight_to_the_principal():
    entries = parse("k.toml", '[keys.a]\nkey = "sk-a"\nrequests_per_minute = 60\ntokens_per_minute = 1000\n'
                              'max_concurrent_requests = 4\nweight = 2\n[keys.b]\nkey = "sk-b"\n')
    a, b = sorted((e.principal for e in entries.values()), key=lambda p: p.name)
    assert (a.requests_per_minute, a.tokens_per_minute, a.max_concurrent_requests, a.weight) == (60, 1000, 4, 2.0)
    assert (b.requests_per_minute, b.tokens_per_minute, b.max_concurrent_requests, b.weight) == (0, 0, 0, 1.0)


# ---------------------------------------------------------------- the fair queue


def test_the_key_served_least_goes_first_whatever_the_arrival_order():
    fq = FairQueue(Clock())
    heavy = [fq.join("heavy", f"h{i}", 100, 1.0) for i in range(10)]
    light = fq.join("light", "l0", 100, 1.0)
    order = []
    while fq.head() is not None:
        w = fq.head()
        order.append(w.request_id)
        fq.release(w)
    assert order[:2] == ["h0", "l0"]  # equal counters: the older first, then the light key at once
    assert order[2:] == [f"h{i}" for i in range(1, 10)] and light.gone and all(h.gone for h in heavy)


def test_while_both_wait_service_alternates_by_tokens_over_weight():
    fq = FairQueue(Clock())
    for i in range(30):
        fq.join("a", f"a{i}", 100, 1.0)
        fq.join("b", f"b{i}", 100, 2.0)  # twice a's share
    served = {"a": 0, "b": 0}
    for _ in range(30):
        w = fq.head()
        served[w.tenant] += 1
        fq.release(w)
    assert served == {"a": 10, "b": 20}


def test_a_key_back_from_idle_has_saved_no_credit():
    clock = Clock()
    fq = FairQueue(clock)
    fq.seen("busy")
    for i in range(50):  # busy is served alone for a long time
        fq.charge("busy", 100, 1.0)
    for i in range(5):
        fq.join("busy", f"b{i}", 100, 1.0)
    fq.seen("late")
    fq.join("late", "l0", 100, 1.0)
    fq.join("late", "l1", 100, 1.0)
    fq.join("late", "l2", 100, 1.0)
    first = [fq.head().request_id]
    fq.release(fq.head())
    # "late" started at no less than busy's counter (the lowest waiting one): the two alternate, late is not
    # served its whole backlog first for having been away
    while len(first) < 4:
        w = fq.head()
        first.append(w.request_id)
        fq.release(w)
    assert sorted(first) != ["l0", "l1", "l2"] and {r[0] for r in first} == {"b", "l"}


def test_a_request_that_ends_early_gives_back_what_it_did_not_generate():
    fq = FairQueue(Clock())
    fq.charge("a", 1100, 1.0)  # prompt 100 + max_tokens 1000
    fq.charge("b", 300, 1.0)
    fq.ended("a", 990, 1.0)  # generated 10
    fq.join("a", "a1", 10, 1.0)
    fq.join("b", "b1", 10, 1.0)
    assert fq.head().request_id == "a1"  # a: 110 served, b: 300


def test_only_active_keys_count_and_a_key_under_its_share_in_flight_may_use_the_reserve():
    clock = Clock()
    fq = FairQueue(clock)
    fq.seen("a")
    fq.charge("a", 100, 1.0)
    fq.charge("a", 100, 1.0)
    assert not fq.contended()  # alone: nothing waits, nothing is reserved
    fq.seen("b")
    assert fq.contended() and fq.under_share("b", 1.0) and not fq.under_share("a", 1.0)  # a holds 2 of 2
    fq.charge("b", 100, 1.0)
    assert fq.under_share("b", 1.0) and not fq.under_share("a", 1.0)  # 1 of 3 < 1.5
    fq.seen("b", 3.0)  # b's share is three times a's: 1/3 < 3/4 of the 3 in flight
    assert fq.under_share("b", 3.0)
    fq.ended("a", 0, 1.0)
    fq.ended("a", 0, 1.0)
    fq.ended("b", 0, 1.0)
    clock.t += ACTIVE_S + 1
    fq.seen("a")
    assert not fq.contended()  # b went quiet
    fq.forget_idle()
    assert set(fq.tenants) == {"a"}


def test_a_withdrawn_waiter_leaves_the_queue_once():
    fq = FairQueue(Clock())
    w = fq.join("a", "a0", 10, 1.0)
    fq.withdraw(w)
    fq.withdraw(w)
    fq.release(w)
    assert fq.waiting == 0 and fq.head() is None


# ---------------------------------------------------------------- through HTTP


@pytest.fixture()
def limited(tmp_path):
    keys = tmp_path / "keys.toml"
    keys.write_text('[keys.few]\nkey = "sk-few"\nrequests_per_minute = 2\n'
                    '[keys.one]\nkey = "sk-one"\nmax_concurrent_requests = 1\n'
                    '[keys.small]\nkey = "sk-small"\ntokens_per_minute = 60\n'
                    '[keys.free]\nkey = "sk-free"\n')
    cfg = load_config(None, [f"proxy.api_keys_file={keys}", "model.max_model_len=64"])
    app = build_app(cfg)
    proxy = app.state.proxy
    proxy.cluster.token_address = "inproc://tenants-proxy"
    instance = FakeInstance(proxy.cluster)
    yield Client(app), proxy, instance
    proxy.cluster.ctx.destroy(linger=0)


def _post(client, key: str, max_tokens: int = 4, stream: bool = False, leave_after=None):
    body = json.dumps({"model": "llumnix-sim", "prompt": "hello", "max_tokens": max_tokens, "stream": stream})
    return asyncio.run(client.request("/v1/completions", body.encode(), {"authorization": f"Bearer {key}"},
                                      leave_after=leave_after))


def _rejected(key: str, reason: str) -> float:
    return M_TENANT_REJECTED.labels(key, reason)._value.get()


def test_http_requests_per_minute_429_with_retry_after_and_the_metric(limited):
    client, proxy, _ = limited
    before = _rejected("few", "requests_per_minute")
    assert [_post(client, "sk-few")[0] for _ in range(2)] == [200, 200]
    status, headers, data = _post(client, "sk-few")
    error = json.loads(data)["error"]
    assert status == 429 and error["code"] == "requests_per_minute" and error["type"] == "rate_limit_exceeded"
    assert "'few'" in error["message"] and 1 <= int(dict(headers)["retry-after"]) <= 30
    assert _rejected("few", "requests_per_minute") == before + 1
    assert _post(client, "sk-free")[0] == 200  # the other keys are not touched


def test_http_concurrency_limit_counts_an_open_stream_and_frees_it_when_it_ends(limited):
    client, proxy, instance = limited
    instance.hold = True  # the stream stays open after its first token

    async def both():
        leave = asyncio.Event()
        first = asyncio.ensure_future(client.request(
            "/v1/completions", json.dumps({"model": "llumnix-sim", "prompt": "hi", "max_tokens": 8,
                                           "stream": True}).encode(), {"authorization": "Bearer sk-one"},
            leave=leave))
        while not proxy.cluster.streams:  # the first is being served
            await asyncio.sleep(0)
        assert proxy.tenants.in_flight("one") == 1
        second = await client.request("/v1/completions", json.dumps({"model": "llumnix-sim", "prompt": "hi"}).encode(),
                                      {"authorization": "Bearer sk-one"})
        leave.set()  # the first client leaves (before or after its first chunk: either way it ends)
        return await first, second

    first, second = asyncio.run(both())
    assert second[0] == 429 and json.loads(second[2])["error"]["code"] == "concurrent_requests"
    assert proxy.tenants.in_flight("one") == 0  # the client left: its slot is free
    instance.hold = False
    assert _post(client, "sk-one")[0] == 200


def test_http_tokens_per_minute_gives_back_what_a_finished_request_did_not_use(limited):
    client, proxy, _ = limited
    # "hello" is a few tokens; max_tokens 40 takes most of the 60-token bucket, the fake stops at max_tokens
    assert _post(client, "sk-small", max_tokens=40)[0] == 200  # used all it asked for
    status, _, data = _post(client, "sk-small", max_tokens=40)
    assert status == 429 and json.loads(data)["error"]["code"] == "tokens_per_minute"
    assert proxy.tenants.in_flight("small") == 0
