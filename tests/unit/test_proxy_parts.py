"""The proxy's parts on their own, each built with only what it receives (daemons/proxy/__init__.py lists
them): the HTTP guard, stream ownership and what the proxy knows of the instances."""

from __future__ import annotations

import asyncio
import logging

import pytest

from daemons import wire
from daemons.clock import VirtualTimeLoop
from daemons.proxy.front.access import AccessLog
from daemons.proxy.front.guard import M_REQUESTS, Guard
from daemons.proxy.cluster.known import KnownInstances
from daemons.proxy.api.protocol import ApiError
from daemons.proxy.cluster.stream import Stream
from daemons.proxy.cluster.streams import Streams

RID = "r1"


class Port:
    """Records what is sent; knows the addresses it was greeted for or sent to."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, wire.Message]] = []

    def send(self, address: str, msg: wire.Message) -> bool:
        self.sent.append((address, msg))
        return True

    def greet(self, address: str) -> None:
        if all(a != address for a, _ in self.sent):
            self.send(address, wire.ProxyAlive("inproc://p"))


def _count(path: str, status: int) -> float:
    return M_REQUESTS.labels(path, str(status))._value.get()


def test_the_guard_refuses_a_declared_body_past_the_limit_and_counts_and_logs_the_refusal(caplog):
    guard = Guard(None, 1024, AccessLog(True))
    assert guard.check("/v1/completions", None, "1024") is None  # no keys: nobody to name
    with pytest.raises(ApiError) as exc:
        guard.check("/v1/completions", None, "1025")
    assert exc.value.status == 413 and exc.value.body()["error"]["code"] == "request_too_large"
    before, tokenize = _count("/v1/chat/completions", 413), _count("/tokenize", 413)
    with caplog.at_level(logging.INFO, logger="llumnix.access"):
        guard.refused("/v1/chat/completions", 413)
        guard.refused("/tokenize", 413)
        guard.refused("/v1/models", 413)  # not a body route: neither counted nor logged here
    assert _count("/v1/chat/completions", 413) == before + 1 and _count("/tokenize", 413) == tokenize + 1
    lines = [r.getMessage() for r in caplog.records if r.name == "llumnix.access"]
    assert len(lines) == 1 and "/v1/chat/completions" in lines[0] and "status=413" in lines[0]


def test_the_guard_stops_a_body_as_soon_as_it_grows_past_the_limit():
    guard = Guard(None, 10, AccessLog(False))
    pieces = [{"type": "http.request", "body": b"x" * 6, "more_body": True}] * 3

    def receiver():
        queue = list(pieces)

        async def receive() -> dict:
            return queue.pop(0)
        return receive

    async def main():
        with pytest.raises(ApiError) as exc:
            await guard.read_body(receiver())
        assert exc.value.status == 413
        limited = guard.limited(receiver())
        await limited()  # 6 bytes: within
        with pytest.raises(ApiError):
            await limited()  # 12
    asyncio.run(main())


def _stream(epoch: int = 1, owner: str = "a") -> Stream:
    stream = Stream(RID, wire.Submit(RID, [1, 2, 3], wire.SamplingParams(), "inproc://p"))
    stream.instance_id, stream.address, stream.epoch = owner, f"inproc://{owner}", epoch
    return stream


def test_stream_ownership_fences_a_losing_copy_once_and_asks_an_orphan_once():
    port, addresses = Port(), {"a": "inproc://a", "b": "inproc://b"}
    streams = Streams(port, lambda iid: addresses.get(iid, ""), addresses.__setitem__)
    stream = _stream()
    streams.add(stream)
    streams.tokens("a", [wire.TokenOut(RID, 0, 7, None, epoch=1)], now=5.0)
    assert [o.token_id for o in stream.ready] == [7] and stream.progress_at == 5.0
    streams.tokens("b", [wire.TokenOut(RID, 1, 8, None, epoch=1)], now=6.0)  # a copy that does not own it
    streams.tokens("b", [wire.TokenOut(RID, 2, 9, None, epoch=1)], now=6.0)
    assert port.sent == [("inproc://b", wire.Abort(RID, 1))]  # fenced once
    assert stream.next_index == 1
    port.sent.clear()
    for _ in range(2):
        streams.tokens("b", [wire.TokenOut("gone", 4, 1, None, epoch=3)], now=7.0)
    assert port.sent == [("inproc://b", wire.Abort("gone", 3))]  # an orphan's instance is asked once


def test_a_claim_for_a_newer_epoch_moves_the_stream_and_an_older_one_is_fenced():
    port, addresses = Port(), {"a": "inproc://a"}
    streams = Streams(port, lambda iid: addresses.get(iid, ""), addresses.__setitem__)
    stream = _stream(epoch=1)
    streams.add(stream)
    streams.moved(stream, wire.Moved(RID, "b", "inproc://b", 2, 4), now=3.0)
    assert (stream.instance_id, stream.epoch, stream.owner_from, stream.sent_at) == ("b", 2, 4, 3.0)
    assert addresses["b"] == "inproc://b" and isinstance(port.sent[0][1], wire.ProxyAlive)  # it must hear of us
    port.sent.clear()
    streams.moved(stream, wire.Moved(RID, "a", "inproc://a", 1, 2), now=4.0)  # late: lost
    aborts = [(a, m) for a, m in port.sent if isinstance(m, wire.Abort)]
    assert stream.instance_id == "b" and aborts == [("inproc://a", wire.Abort(RID, 1))]


def test_an_instance_is_judged_by_its_connection_and_only_without_one_by_silence():
    loop, links = VirtualTimeLoop(100.0), {}
    clock = loop.clock()
    known = KnownInstances(clock, instance_timeout_s=5.0, snapshot_interval_s=1.0,
                           link_state=lambda address: links.get(address, "unknown"))
    load = wire.InstanceLoad(blocks_total=10, blocks_used=0, running=0, waiting=0, batch_size=4, block_size=16)
    known.heard_beat(wire.Heartbeat("a", "inproc://a", True, load, True))
    loop.stall(6.0)
    assert known.dead("a")  # silent past the timeout, no connection seen
    links["inproc://a"] = "up"
    assert not known.dead("a")  # slow is not dead
    links["inproc://a"] = "down"
    assert known.dead("a")
    assert not known.manager_ok()  # no snapshot yet
    known.took_snapshot(wire.Snapshot(0, [], proxy_rank=1, proxies=2))
    assert known.manager_ok() and (known.rank, known.proxies) == (1, 2)


def test_a_requests_latencies_read_the_proxys_clock(caplog):
    """One clock for every latency the proxy judges (goodput's TTFT and TPOT, the histograms, the access log):
    the one it is given, here a clock that moves only when the test moves it."""
    from daemons import metrics
    from daemons.proxy.api.render import Job

    now = [100.0]
    timer = metrics.RequestTimer(now[0], prompt_tokens=4, n=1, now=lambda: now[0])
    now[0] = 100.5
    timer.delivered(0, 1)
    now[0] = 101.5
    timer.delivered(0, 3)
    assert (timer.first[0], timer.last[0], timer.tokens[0]) == (100.5, 101.5, 4)
    access = AccessLog(True, lambda: now[0])
    job = Job(False, "r-clock", 100.0)
    job.first_at = 100.5
    now[0] = 102.0
    with caplog.at_level(logging.INFO, logger="llumnix.access"):
        access.write(job, False, job.arrival, 200)
    (rec,) = [r for r in caplog.records if r.name == "llumnix.access"]
    assert (rec.ttft_ms, rec.total_ms) == (500.0, 2000.0)
