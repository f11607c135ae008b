"""The processes ``llumnixctl bench manager`` (llumnixctl/experiments/bench/manager.py) starts beside the real
manager: emulators, each holding one ZeroMQ DEALER per emulated instance, and the dispatch client.

    python -m llumnixctl.experiments.bench.manager_peers emulate|client SPEC_JSON
"""

from __future__ import annotations

import heapq
import json
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path

import msgspec
import psutil
import zmq

from daemons import wire
from llumnixctl.stats import percentile

MODEL = "llumnix-emulated"
BLOCKS = 2000
BLOCK_SIZE = 16


# ---------------------------------------------------------------------- emulated instances


def emulated_load(rng: random.Random, kind: int, received: int) -> wire.InstanceLoad:
    """A load of class ``kind``: 0 loaded (freeness 1-5, below the default migrate-out threshold 6),
    1 nearly free (freeness in the hundreds), 2 and 3 in between (freeness 6.2-7.8: neither)."""
    if kind == 0:
        running, free = rng.randint(16, 24), rng.uniform(1.0, 5.0)
    elif kind == 1:
        running, free = rng.randint(1, 4), rng.uniform(300.0, 450.0)
    else:
        running, free = rng.randint(8, 12), rng.uniform(6.2, 7.8)
    used = max(0, min(BLOCKS, int(BLOCKS - free * running)))
    return wire.InstanceLoad(blocks_total=BLOCKS, blocks_used=used, running=running, waiting=0, batch_size=256,
                             block_size=BLOCK_SIZE, requests_received=received, running_blocks=used)


def emulate(spec: dict) -> None:
    """Run emulated instances ``spec["ids"]`` (global indexes ``spec["first"]``...) until SIGTERM or
    ``spec["max_s"]``; write what they did to ``spec["out"]``."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    deadline = time.monotonic() + spec["max_s"]
    ids: list[str] = spec["ids"]
    hb = spec["heartbeat_s"]
    min_interval = spec["min_interval_s"]
    rng = random.Random(spec["first"])
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, len(ids) + 64)
    poller = zmq.Poller()
    socks: list[zmq.Socket] = []
    index: dict[zmq.Socket, int] = {}
    kinds = [(spec["first"] + k) % 4 for k in range(len(ids))]
    received = [0] * len(ids)
    seq = [0] * len(ids)
    last_report = [0.0] * len(ids)
    dirty: set[int] = set()
    stats = {"registers": 0, "reports": 0, "migrate_starts": 0, "list_requests": 0, "other": 0, "acks": 0,
             "refused": 0}
    by_id = {iid: k for k, iid in enumerate(ids)}
    feed = ctx.socket(zmq.PULL)
    feed.setsockopt(zmq.LINGER, 0)
    feed.bind(spec["feed"])
    poller.register(feed, zmq.POLLIN)

    def register(k: int) -> None:
        msg = wire.Register(instance_id=ids[k], host="emulated", pid=os.getpid(),
                            request_address=f"inproc://emulated-{ids[k]}", backend="emulated", model=MODEL,
                            load=emulated_load(rng, kinds[k], received[k]), max_model_len=4096, uptime_s=60.0)
        _send(socks[k], msg)
        stats["registers"] += 1

    def report(k: int, now: float) -> None:
        seq[k] += 1
        last_report[k] = now
        _send(socks[k], wire.LoadReport(ids[k], seq[k], emulated_load(rng, kinds[k], received[k])))
        stats["reports"] += 1

    for k, iid in enumerate(ids):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.IDENTITY, f"emu-{iid}".encode())
        s.connect(spec["manager"])
        socks.append(s)
        index[s] = k
        poller.register(s, zmq.POLLIN)
        register(k)
    start = time.monotonic()
    due = [(start + hb * (k + 1) / len(ids), k) for k in range(len(ids))]  # staggered over one interval
    heapq.heapify(due)
    try:
        while not stop and time.monotonic() < deadline:
            now = time.monotonic()
            while due and due[0][0] <= now:
                _, k = heapq.heappop(due)
                dirty.discard(k)
                report(k, now)
                heapq.heappush(due, (now + hb, k))
            for k in [k for k in dirty if now - last_report[k] >= min_interval]:
                dirty.discard(k)
                report(k, now)  # its load changed: a real instance reports at once (coalesced)
            wait = min(due[0][0] - now if due else hb, 0.02 if dirty else hb)
            for sock, _ in poller.poll(max(1, int(wait * 1000))):
                for _ in range(1000):
                    try:
                        frame = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if sock is feed:
                        for iid, n in msgspec.msgpack.decode(frame).items():
                            k = by_id.get(iid)
                            if k is not None:
                                received[k] += n
                                dirty.add(k)
                        continue
                    k = index[sock]
                    msg = wire.decode(frame)
                    if isinstance(msg, wire.RegisterAck):
                        stats["acks"] += 1
                        if not msg.accepted:
                            stats["refused"] += 1
                            if not msg.final:
                                register(k)
                    elif isinstance(msg, wire.MigrateStart):
                        stats["migrate_starts"] += 1  # nothing worth moving: no outcome
                        _send(sock, wire.MigrateResult(msg.query_id, ids[k], []))
                    elif isinstance(msg, wire.ListRequests):
                        stats["list_requests"] += 1
                        _send(sock, wire.RequestList(msg.query_id, ids[k], []))
                    else:
                        stats["other"] += 1
    finally:
        Path(spec["out"]).write_text(json.dumps(stats))
        ctx.destroy(linger=0)


def _send(sock: zmq.Socket, msg) -> None:
    try:
        sock.send(wire.encode(msg), zmq.NOBLOCK)
    except zmq.Again:
        pass  # the manager is not reading: as a real instance, drop (the next report says it again)


# ---------------------------------------------------------------------- the dispatch client (a subprocess)


def _ms(xs: list[float]) -> dict:
    if not xs:
        return {"mean": None, "p50": None, "p99": None, "p999": None, "max": None}
    xs = sorted(xs)

    def pct(p: float) -> float:
        return round(percentile(xs, p, "nearest") * 1e3, 4)

    return {"mean": round(statistics.fmean(xs) * 1e3, 4), "p50": pct(50), "p99": pct(99), "p999": pct(99.9),
            "max": round(xs[-1] * 1e3, 4)}


def client(spec: dict) -> None:
    """Send ``rate`` Dispatch queries a second for ``seconds``, open loop; write the round trips to ``out``."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    rate, seconds, grace = spec["rate"], spec["seconds"], spec["grace_s"]
    total = max(1, int(rate * seconds))
    owner: dict[str, int] = spec["owner"]  # instance id -> emulator index (its feed)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.SNDHWM, 1_000_000)
    dealer.setsockopt(zmq.RCVHWM, 1_000_000)
    dealer.connect(spec["manager"])
    feeds = []
    for address in spec["feeds"]:
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(address)
        feeds.append(push)
    rng = random.Random(spec.get("seed", 0))
    prompts = [rng.randint(16, 1024) for _ in range(1024)]
    sent_at = [0.0] * total
    late = [0.0] * total  # how far behind its schedule each one was sent (the client's own lag)
    latencies: list[float] = []
    failed = answered = 0
    counts: list[dict[str, int]] = [{} for _ in feeds]
    cpu0 = psutil.Process().cpu_times()
    t0 = time.perf_counter()
    last_feed = t0
    i = 0
    send_end = last_answer = t0
    deadline = t0 + seconds + grace
    while not stop:
        now = time.perf_counter()
        target = min(total, int((now - t0) * rate) + 1)
        while i < target:
            try:
                dealer.send(wire.encode(wire.Dispatch(i, f"r{i}", prompts[i % 1024])), zmq.NOBLOCK)
            except zmq.Again:
                break
            sent_at[i] = time.perf_counter()
            late[i] = sent_at[i] - (t0 + i / rate)
            i += 1
        if i == total and send_end == t0:
            send_end = time.perf_counter()
        for _ in range(10_000):
            try:
                frame = dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            got = time.perf_counter()
            msg = wire.decode(frame)
            if not isinstance(msg, wire.DispatchReply) or not 0 <= msg.query_id < i:
                continue
            answered += 1
            last_answer = got
            latencies.append(got - sent_at[msg.query_id])
            if not msg.instance_id:
                failed += 1
            else:
                e = owner.get(msg.instance_id)
                if e is not None:
                    counts[e][msg.instance_id] = counts[e].get(msg.instance_id, 0) + 1
        now = time.perf_counter()
        if now - last_feed >= 0.02:  # the Submits the instances would have received by now
            last_feed = now
            for e, c in enumerate(counts):
                if c:
                    try:
                        feeds[e].send(msgspec.msgpack.encode(c), zmq.NOBLOCK)
                    except zmq.Again:
                        pass
                    counts[e] = {}
        if (i == total and answered >= total) or now > deadline:
            break
        dealer.poll(1)
    cpu1 = psutil.Process().cpu_times()
    send_s = (send_end if send_end > t0 else time.perf_counter()) - t0
    out = {"rate": rate, "seconds": seconds, "sent": i, "answered": answered, "no_instance": failed,
           "unanswered": i - answered, "achieved_rate": round(i / send_s, 1) if send_s > 0 else 0.0,
           "send_s": round(send_s, 3),
           "answered_rate": round(answered / (last_answer - t0), 1) if last_answer > t0 else 0.0,
           "latency_ms": _ms(latencies),
           "send_lag_ms": _ms(late[:i]),
           "client_cpu_percent": round(100 * (cpu1.user + cpu1.system - cpu0.user - cpu0.system)
                                       / max(time.perf_counter() - t0, 1e-9), 1)}
    Path(spec["out"]).write_text(json.dumps(out))
    ctx.destroy(linger=0)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in ("emulate", "client"):
        (emulate if sys.argv[1] == "emulate" else client)(json.loads(sys.argv[2]))
    else:
        sys.exit("usage: python -m llumnixctl.experiments.bench.manager_peers emulate|client SPEC_JSON "
                 "(started by llumnixctl bench manager)")
