"""Hostile-client benchmark: 32 normal streams on a local sim cluster, with and without one client that sends
the worst bodies the proxy's limits allow (from a process of its own), in interleaved rounds; the normal streams' inter-token gaps
(measured at the client, chunk to chunk) are compared. Prints a JSON report with the P50/P99 gap of each
phase and the ratio with/without (goal: P99 rises < 20%).

    python scripts/hostile.py [--rounds 3] [--phase-s 20] [--bodies stops,biggest_prompt,deep_json] [--out report.json]

The worst bodies, each sent again and again by 4 connections at once:
- a streamed request with the most stop strings (proxy.max_stop_strings) of the longest length
  (proxy.max_stop_length), the most stop_token_ids, n = 32, logprobs = 20 and a long output;
- the largest body accepted (proxy.max_body_bytes; by default 1 MiB + 32 bytes a token of context) whose prompt
  is one long string (refused before tokenizing: too many characters for the prompt limit);
- a body nested as deep as JSON allows here (refused: nested too deeply).
Every loop is bounded in count and time; traffic goes only to the cluster it starts on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from daemons.config import body_limit, load_config  # noqa: E402
from llumnixctl.lab import localcluster  # noqa: E402
from llumnixctl.lab.scratch import kept_if, scratch_dir  # noqa: E402
from llumnixctl.stats import percentile  # noqa: E402

SETS = ["manager.heartbeat_interval_s=0.2", "sim.time_scale=0.1", "instance.shutdown_grace_s=1"]
NORMAL_STREAMS = 32
HOSTILE_CONNECTIONS = 4


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
    limit = body_limit(cfg)
    big = b'{"model": "llumnix-sim", "max_tokens": 1, "prompt": "' + b"a" * (limit - 80) + b'"}'
    depth = 100_000
    deep = b'{"model": "llumnix-sim", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    deep = deep[:limit]
    return [(f"stops_n{n}_logprobs20", json.dumps(stream).encode()), ("biggest_prompt", big[:limit]),
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


def hostile_process(url: str, bodies: list[tuple[str, bytes]], on, stop, out) -> None:
    """The hostile client, in a process of its own (as another client would be): its threads' work on the
    largest bodies does not take the normal clients' interpreter lock and so does not bend their measured gaps.
    Sends what it counted (answers by body and status) to ``out`` when ``stop`` is set."""
    t_on, t_stop, lock = threading.Event(), threading.Event(), threading.Lock()
    counts: dict[str, dict[int, int]] = {}
    hostiles = [Hostile(url, bodies, t_on, t_stop, counts, lock, k) for k in range(HOSTILE_CONNECTIONS)]
    for t in hostiles:
        t.start()
    while not stop.is_set():
        if on.wait(0.05):
            t_on.set()
            time.sleep(0.05)
        else:
            t_on.clear()
    t_stop.set()
    for t in hostiles:
        t.join(70)
    out.put(counts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--phase-s", type=float, default=20.0)
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--hostile-n", type=int, default=32, help="n of the hostile streamed request (32: the most "
                    "allowed, which is also 32 sequences of real load on the cluster per connection; 1: the body's "
                    "cost to the proxy alone)")
    ap.add_argument("--set", action="append", default=[], help="section.key=value for every daemon (e.g. a larger "
                    "proxy.max_body_bytes)")
    ap.add_argument("--bodies", default="", help="comma-separated names of the worst bodies to send (default: all): "
                    "stops (the stream with the most stop strings, n and logprobs), biggest_prompt, deep_json")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    sets = SETS + args.set
    cfg = load_config(None, sets)
    run_dir = scratch_dir("llumnix-hostile.")
    with kept_if(run_dir, localcluster.ClusterError):  # its error points at the daemons' logs there
        state = localcluster.up(run_dir, args.instances, "sim", 0, None, sets, timeout_s=180)
    try:
        url = state.url
        phase = ["warmup"]
        stop, lock = threading.Event(), threading.Lock()
        gaps: dict[str, list[float]] = {}
        normals = [Normal(url, k, phase, stop, gaps, lock) for k in range(NORMAL_STREAMS)]
        bodies = worst_bodies(cfg, args.hostile_n)
        if args.bodies:
            wanted = args.bodies.split(",")
            bodies = [b for b in bodies if b[0] in wanted or b[0].split("_")[0] in wanted]  # stops_n32_... as stops
            if not bodies:
                raise SystemExit(f"hostile: no body named {args.bodies}")
        mp = multiprocessing.get_context("spawn")
        on, h_stop, h_out = mp.Event(), mp.Event(), mp.Queue()
        hostile = mp.Process(target=hostile_process, args=(url, bodies, on, h_stop, h_out), daemon=True)
        hostile.start()
        for t in normals:
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
                row[kind] = {"gaps": len(g), "p50_ms": round(percentile(g, 50, "nearest", float("nan")) * 1e3, 2),
                             "p99_ms": round(percentile(g, 99, "nearest", float("nan")) * 1e3, 2)}
                time.sleep(2.0)  # the hostile requests in flight end before the next phase is measured
            row["p99_ratio"] = round(row["hostile"]["p99_ms"] / row["alone"]["p99_ms"], 3)
            rounds.append(row)
            print(json.dumps({"round": r, **row}), flush=True)
        stop.set()
        h_stop.set()
        counts = h_out.get(timeout=90)
        hostile.join(30)
        for t in normals:
            t.join(70)
        ratios = [x["p99_ratio"] for x in rounds]
        report = {"normal_streams": NORMAL_STREAMS, "hostile_n": args.hostile_n, "hostile_connections": HOSTILE_CONNECTIONS, "phase_s": args.phase_s,
                  "instances": args.instances, "bodies": [b[0] for b in bodies], "rounds": rounds, "p99_ratio_median": statistics.median(ratios),
                  "p99_ratio_range": [min(ratios), max(ratios)], "hostile_answers": counts,
                  "normal_errors": sum(n.errors for n in normals),
                  "limits": {k: getattr(cfg.proxy, k) for k in ("max_stop_strings", "max_stop_length",
                                                               "max_stop_token_ids")} | {"body_bytes": body_limit(cfg)}}
        print(json.dumps(report, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))
        return 0
    finally:
        localcluster.stop(state)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # timeout(1): leave through the finally blocks, as on Ctrl-C
    sys.exit(main())
