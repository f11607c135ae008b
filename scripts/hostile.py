"""Hostile-client benchmark: 32 normal streams on a local sim cluster, with and without one client that sends
the worst bodies the proxy's limits allow, in interleaved rounds; the normal streams' inter-token gaps
(measured at the client, chunk to chunk) are compared. Prints a JSON report with the P50/P99 gap of each
phase and the ratio with/without (goal: P99 rises < 20%).

    python scripts/hostile.py [--rounds 3] [--phase-s 20] [--out report.json]

The worst bodies, each sent again and again by 4 connections at once:
- a streamed request with the most stop strings (proxy.max_stop_strings) of the longest length
  (proxy.max_stop_length), the most stop_token_ids, n = 32, logprobs = 20 and a long output;
- an 8 MiB body (proxy.max_body_bytes) whose prompt is one long string (refused before tokenizing);
- a body nested as deep as JSON allows here (refused: nested too deeply).
Every loop is bounded in count and time; traffic goes only to the cluster it starts on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from daemons.config import load_config  # noqa: E402
from llumnixctl.lab import localcluster  # noqa: E402

SETS = ["manager.heartbeat_interval_s=0.2", "sim.time_scale=0.1", "instance.shutdown_grace_s=1"]
NORMAL_STREAMS = 32
HOSTILE_CONNECTIONS = 4


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Normal(threading.Thread):
    """One normal client: streamed completions one after another; the gaps between its chunks, by phase."""

    def __init__(self, url: str, seed: int, phase: list[str], stop: threading.Event, gaps: dict[str, list[float]],
                 lock: threading.Lock):
        super().__init__(daemon=True)
        self.url, self.rnd, self.phase, self.stop, self.gaps, self.lock = url, random.Random(seed), phase, stop, gaps, lock
        self.errors = 0

    def run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                body = {"model": "llumnix-sim", "prompt": [self.rnd.randrange(3, 30000) for _ in range(64)],
                        "max_tokens": 120, "stream": True, "ignore_eos": True}
                last = None
                try:
                    with client.stream("POST", self.url + "/v1/completions", json=body) as resp:
                        if resp.status_code != 200:
                            self.errors += 1
                            continue
                        for line in resp.iter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            now = time.perf_counter()
                            if last is not None:
                                with self.lock:
                                    self.gaps.setdefault(self.phase[0], []).append(now - last)
                            last = now
                except httpx.HTTPError:
                    self.errors += 1


def worst_bodies(cfg, n: int = 32) -> list[tuple[str, bytes]]:
    pc = cfg.proxy
    rnd = random.Random(7)
    stops = ["".join(rnd.choice("abcdefghij ") for _ in range(pc.max_stop_length)) for _ in range(pc.max_stop_strings)]
    stream = {"model": "llumnix-sim", "prompt": "hello " * 50, "max_tokens": 64, "stream": True, "n": n,
              "logprobs": 20, "stop": stops, "stop_token_ids": list(range(10, 10 + pc.max_stop_token_ids)),
              "ignore_eos": True}
    big = b'{"model": "llumnix-sim", "max_tokens": 1, "prompt": "' + b"a" * (pc.max_body_bytes - 80) + b'"}'
    depth = 100_000
    deep = b'{"model": "llumnix-sim", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    deep = deep[:pc.max_body_bytes]
    return [(f"stops_n{n}_logprobs20", json.dumps(stream).encode()), ("8MiB_prompt", big[:pc.max_body_bytes]),
            ("deep_json", deep)]


class Hostile(threading.Thread):
    def __init__(self, url: str, bodies: list[tuple[str, bytes]], on: threading.Event, stop: threading.Event,
                 counts: dict[str, dict[int, int]], lock: threading.Lock, k: int):
        super().__init__(daemon=True)
        self.url, self.bodies, self.on, self.stop, self.counts, self.lock, self.k = url, bodies, on, stop, counts, lock, k

    def run(self) -> None:
        with httpx.Client(timeout=60) as client:
            i = self.k
            while not self.stop.is_set():
                if not self.on.wait(0.2):
                    continue
                name, body = self.bodies[i % len(self.bodies)]
                i += 1
                try:
                    with client.stream("POST", self.url + "/v1/completions", content=body,
                                       headers={"content-type": "application/json"}) as resp:
                        for _ in resp.iter_bytes():
                            pass
                        status = resp.status_code
                except httpx.HTTPError:
                    status = -1
                with self.lock:
                    per = self.counts.setdefault(name, {})
                    per[status] = per.get(status, 0) + 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--phase-s", type=float, default=20.0)
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--hostile-n", type=int, default=32, help="n of the hostile streamed request (32: the most "
                    "allowed, which is also 32 sequences of real load on the cluster per connection; 1: the body's "
                    "cost to the proxy alone)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    cfg = load_config(None, SETS)
    run_dir = Path(tempfile.mkdtemp(prefix="llumnix-hostile."))
    state = localcluster.up(run_dir, args.instances, "sim", 0, None, SETS, timeout_s=180)
    try:
        url = state.url
        phase = ["warmup"]
        stop, on, lock = threading.Event(), threading.Event(), threading.Lock()
        gaps: dict[str, list[float]] = {}
        counts: dict[str, dict[int, int]] = {}
        normals = [Normal(url, k, phase, stop, gaps, lock) for k in range(NORMAL_STREAMS)]
        bodies = worst_bodies(cfg, args.hostile_n)
        hostiles = [Hostile(url, bodies, on, stop, counts, lock, k) for k in range(HOSTILE_CONNECTIONS)]
        for t in normals + hostiles:
            t.start()
        time.sleep(min(10.0, args.phase_s))
        rounds = []
        for r in range(args.rounds):
            row = {}
            for kind in ("alone", "hostile"):
                name = f"{kind}-{r}"
                (on.set if kind == "hostile" else on.clear)()
                with lock:
                    phase[0] = name
                time.sleep(args.phase_s)
                with lock:
                    phase[0] = "between"
                on.clear()
                g = gaps.get(name, [])
                row[kind] = {"gaps": len(g), "p50_ms": round(pct(g, 0.5) * 1e3, 2), "p99_ms": round(pct(g, 0.99) * 1e3, 2)}
                time.sleep(2.0)  # the hostile requests in flight end before the next phase is measured
            row["p99_ratio"] = round(row["hostile"]["p99_ms"] / row["alone"]["p99_ms"], 3)
            rounds.append(row)
            print(json.dumps({"round": r, **row}), flush=True)
        stop.set()
        for t in normals + hostiles:
            t.join(70)
        ratios = [x["p99_ratio"] for x in rounds]
        report = {"normal_streams": NORMAL_STREAMS, "hostile_n": args.hostile_n, "hostile_connections": HOSTILE_CONNECTIONS, "phase_s": args.phase_s,
                  "instances": args.instances, "rounds": rounds, "p99_ratio_median": statistics.median(ratios),
                  "p99_ratio_range": [min(ratios), max(ratios)], "hostile_answers": counts,
                  "normal_errors": sum(n.errors for n in normals),
                  "limits": {k: getattr(cfg.proxy, k) for k in ("max_stop_strings", "max_stop_length",
                                                               "max_stop_token_ids", "max_body_bytes")}}
        print(json.dumps(report, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))
        return 0
    finally:
        localcluster.stop(state)


if __name__ == "__main__":
    sys.exit(main())
