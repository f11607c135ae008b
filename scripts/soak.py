"""Soak driver (scripts/soak.sh runs it): bounded streamed load on a local cluster, with random operator
migrations, drains, kill -9 of instances, and kill -9 and restart of a proxy and of the manager; every
stream is checked token by token against the sim, and every daemon's RSS, file descriptors and sockets are
sampled all along.

    soak.py run --run-dir DIR --duration S --out soak.json   load + chaos, settle, measure, write the report
    soak.py check-stopped --out soak.json                    after `llumnixctl down`: are its pids all gone?
    soak.py plot --out soak.json --png rss.png               the RSS and descriptor curves of every daemon

A lost request is one that errored or got other tokens than the sim's (goal 0). A stream cut because the
proxy serving it was killed under it (or refused while that proxy was down) is counted apart and sent again
to another proxy, as a client behind a load balancer would: no proxy can finish a stream whose connection
died with it. Leaked blocks are the KV blocks still held by live instances once the load stopped and the
cluster settled (goal 0). The first proxy and instance i0 are never killed, and the manager is killed only in
the first half of the warm-up: these three are the witnesses whose memory must stay flat after the warm-up (RSS growth
below 10%) while every peer around them comes and goes. Every migration an instance logged as aborted is
listed with its reason and what explains it (the request ended on its source, the destination refused, or
the destination was killed); an unexplained one fails the soak as a lost request does.
Every loop is bounded in count and time; traffic goes only to the local cluster on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from daemons.engine.sim import sim_token_id  # noqa: E402
from llumnixctl.lab import localcluster  # noqa: E402
from soak_cluster import Chaos, now_s, procs, settle, wall  # noqa: E402
from soak_report import WITNESSES, aborted_migrations, growth, plot, print_summary  # noqa: E402

VOCAB = 32000
REQUEST_DEADLINE_S = 300.0  # one stream, start to end, at most
SAMPLE_EVERY_S = 15.0


# ---------------------------------------------------------------------- cluster views


def rss(run_dir: Path) -> dict[str, dict]:
    """RSS (MB) of every running daemon of the cluster, by name."""
    out = {}
    for p in procs(run_dir):
        live = p.process()
        if live is None:
            continue
        try:
            out[p.name] = {"pid": p.pid, "rss_mb": round(live.memory_info().rss / 2**20, 1)}
        except psutil.Error:
            pass
    return out


def sample(run_dir: Path, t: float) -> list[dict]:
    """RSS, open file descriptors and sockets of every running daemon of the cluster."""
    out = []
    for p in procs(run_dir):
        live = p.process()
        if live is None:
            continue
        try:
            with live.oneshot():
                out.append({"t": round(t, 1), "name": p.name, "pid": p.pid,
                            "rss_mb": round(live.memory_info().rss / 2**20, 1), "fds": live.num_fds(),
                            "sockets": len(live.net_connections("all"))})
        except psutil.Error:
            pass
    return out


def _samples(url: str, name: str) -> list[tuple[str, float]] | None:
    """The samples of ``name`` at ``url``/metrics as (the line's key, value); None if unreachable."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    out = []
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            if key == name or key.startswith(name + "{"):
                out.append((key, float(value)))
    return out


def proxy_metric(url: str, name: str) -> float:
    got = _samples(url, name)
    return float("nan") if got is None else sum(v for _, v in got)


def by_label(url: str, name: str, label: str) -> dict[str, float]:
    """The samples of ``name`` at ``url``/metrics, summed by the value of ``label`` ({} if unreachable)."""
    out: dict[str, float] = {}
    for key, value in _samples(url, name) or []:
        if f'{label}="' in key:
            v = key.split(f'{label}="', 1)[1].split('"', 1)[0]
            out[v] = out.get(v, 0.0) + value
    return out


def session_counts(url: str, st: dict | None) -> dict:
    """A session soak's view: the first proxy's session dispatches by how, and the prompt tokens of the live
    instances by where they came from (engine, host tier, pulled, recomputed; killed instances' are gone)."""
    tokens: dict[str, float] = {}
    for i in (st or {}).get("instances", []):
        if i["state"] == "alive" and i.get("metrics_address"):
            for k, v in by_label(f"http://{i['metrics_address']}", "llumnix_prefix_tokens_total", "source").items():
                tokens[k] = tokens.get(k, 0.0) + v
    return {"dispatches": by_label(url, "llumnix_proxy_session_dispatches_total", "how"), "prompt_tokens": tokens}


# ---------------------------------------------------------------------- load


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.sent = self.completed = 0
        self.lost: list[dict] = []
        self.tokens = 0
        self.cuts = 0  # streams whose proxy was killed under them, sent again elsewhere

    def cut(self, n: int) -> None:
        with self.lock:
            self.tokens += n
            self.cuts += 1

    def add(self, ok: bool, n: int, detail: dict | None = None) -> None:
        with self.lock:
            self.tokens += n
            if ok:
                self.completed += 1
            else:
                self.lost.append(detail or {})


class Cut(Exception):
    """The stream broke because its proxy was killed under it (or was down when it was sent)."""


class Session:
    """A conversation (``--sessions``): each turn's prompt is the last one, its answer and a new message, under
    one prompt_cache_key; it starts over past MAX_HISTORY tokens (a new conversation under the same key)."""

    MAX_HISTORY = 1500

    def __init__(self, key: str):
        self.key = key
        self.history: list[int] = []

    def prompt(self, rnd: random.Random) -> list[int]:
        if len(self.history) > self.MAX_HISTORY:
            self.history = []
        return self.history + [rnd.randrange(3, VOCAB) for _ in range(rnd.randint(8, 60))]


def one_stream(client: httpx.Client, url: str, rnd: random.Random, tally: Tally, chaos: "Chaos | None" = None,
               chosen_at: float | None = None, session: Session | None = None) -> None:
    """One streamed request to ``url``, checked token by token. ``chosen_at``: since when a kill of that proxy
    explains a connection error (when the worker chose it as healthy, or last used its kept-alive connection to
    it, whichever is earlier): such a request is cut (sent again), not lost. ``session``: the next turn of that
    conversation (its history grows by this prompt and answer when the answer is right)."""
    max_tokens = rnd.randint(20, 200)
    prompt = session.prompt(rnd) if session else [rnd.randrange(3, VOCAB) for _ in range(rnd.randint(8, 300))]
    body = {"model": "llumnix-sim", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    if session:
        body["prompt_cache_key"] = session.key
    ids: list[int] = []
    rid, usage, error = "", None, None
    start = time.monotonic()
    chosen_at = start if chosen_at is None else chosen_at
    try:
        with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                error = f"HTTP {resp.status_code}: {resp.read()[:300]!r}"
            else:
                for line in resp.iter_lines():
                    if time.monotonic() - start > REQUEST_DEADLINE_S:
                        error = f"not finished within {REQUEST_DEADLINE_S:g}s"
                        break
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = f"stream error: {chunk['error']}"
                        break
                    rid = chunk["id"]
                    usage = chunk.get("usage") or usage
                    for ch in chunk["choices"]:
                        ids += ch.get("token_ids") or []
    except (httpx.HTTPError, ValueError) as exc:
        error = repr(exc)
        if isinstance(exc, httpx.TransportError) and chaos is not None and chaos.proxy_was_down(url, chosen_at):
            tally.cut(len(ids))
            raise Cut(url) from None
    if error is None:
        if ids != [sim_token_id(rid, i, VOCAB) for i in range(max_tokens)]:
            error = f"wrong tokens: {len(ids)} of {max_tokens}"
        elif not usage or usage.get("completion_tokens") != max_tokens or usage.get("prompt_tokens") != len(prompt):
            error = f"wrong usage: {usage}"
    if session:
        session.history = prompt + ids if error is None else []
    tally.add(error is None, len(ids), None if error is None else
              {"id": rid, "max_tokens": max_tokens, "got": len(ids), "error": str(error)[:300],
               "seconds": round(time.monotonic() - start, 2), "proxy": url, "at": wall(time.time())})


def worker(urls: list[str], seed: int, end: float, budget: threading.Semaphore, tally: Tally,
           chaos: "Chaos | None" = None, sessions: int = 0) -> None:
    """``sessions``: this client's conversations (each request the next turn of one of them); 0: none."""
    rnd = random.Random(seed)
    mine = [Session(f"s{seed}-{k}") for k in range(sessions)]
    last_used: dict[str, float] = {}  # proxy URL -> when this client's kept-alive connection to it was last used
    with httpx.Client(timeout=httpx.Timeout(60.0, connect=10.0)) as client:
        while time.monotonic() < end and budget.acquire(blocking=False):
            with tally.lock:
                tally.sent += 1
            # As a load balancer picks: a healthy proxy. One killed between this choice and the request (a
            # race the chaos thread wins now and then) cuts it like a kill mid-stream.
            chosen_at = time.monotonic()
            up = [u for u in urls if chaos is None or not chaos.is_down(u)] or urls
            url = rnd.choice(up)
            for _ in range(len(urls) + 2):  # a cut stream goes to the next proxy (bounded)
                used = url
                try:
                    one_stream(client, used, rnd, tally, chaos, min(chosen_at, last_used.get(used, chosen_at)),
                               rnd.choice(mine) if mine else None)
                    break
                except Cut:
                    url = urls[(urls.index(url) + 1) % len(urls)]
                    time.sleep(0.2)
                    chosen_at = time.monotonic()
                finally:
                    last_used[used] = time.monotonic()
            else:
                tally.add(False, 0, {"error": "cut on every proxy"})
            time.sleep(rnd.uniform(0.0, 0.5))  # think time


# ---------------------------------------------------------------------- chaos


# ---------------------------------------------------------------------- run


def run(args) -> int:
    run_dir = Path(args.run_dir)
    state = localcluster.ClusterState.load(run_dir)
    if state is None:
        print(f"soak: no local cluster in {run_dir}", file=sys.stderr)
        return 2
    url, manager = state.url, state.manager_address
    assert url.startswith("http://127.0.0.1:"), url
    t0 = time.monotonic()
    rss_start = rss(run_dir)
    end = t0 + args.duration
    tally = Tally()
    budget = threading.Semaphore(args.max_requests)
    rnd = random.Random(args.seed)
    warmup = min(args.warmup, args.duration / 4)
    manager_chaos_s = warmup / 2 if args.manager_chaos_s is None else args.manager_chaos_s
    chaos = Chaos(run_dir, manager, random.Random(args.seed + 1), end, args.chaos_min, args.chaos_max, t0,
                  manager_until=t0 + manager_chaos_s)
    per_worker = -(-args.sessions // args.concurrency) if args.sessions else 0
    workers = [threading.Thread(target=worker, args=(state.urls, args.seed * 1000 + k, end, budget, tally, chaos,
                                                     per_worker), daemon=True) for k in range(args.concurrency)]
    series: list[dict] = sample(run_dir, 0.0)
    sampling = threading.Event()

    def sampler() -> None:
        while not sampling.wait(SAMPLE_EVERY_S):
            series.extend(sample(run_dir, time.monotonic() - t0))

    threading.Thread(target=sampler, daemon=True).start()
    print(f"soak: {args.duration:g}s, {args.concurrency} streams at a time (at most {args.max_requests}), "
          f"chaos every {args.chaos_min:g}-{args.chaos_max:g}s, cluster {url}", flush=True)
    for w in workers:
        w.start()
        time.sleep(rnd.uniform(0, 0.3))
    chaos.start()
    next_report = t0 + 30
    while any(w.is_alive() for w in workers) and time.monotonic() < end + REQUEST_DEADLINE_S + 60:
        time.sleep(1)
        if time.monotonic() >= next_report:
            next_report += 30
            mem = " ".join(f"{r['name']}={r['rss_mb']:.0f}MB/{r['fds']}fd" for r in series[-12:]
                           if r["name"] in WITNESSES and r["t"] >= series[-1]["t"] - 1)
            print(f"soak {now_s(t0)}: sent {tally.sent}, completed {tally.completed}, cut {tally.cuts}, "
                  f"lost {len(tally.lost)}; {mem}", flush=True)
    stuck = sum(1 for w in workers if w.is_alive())
    chaos.stop.set()
    chaos.join(120)
    chaos.finish()
    load_s = time.monotonic() - t0
    st, settle_s = settle(manager, args.settle_timeout)
    alive = [i for i in (st or {}).get("instances", []) if i["state"] == "alive"]
    leaked = sum(i["blocks_used"] for i in alive) if st is not None else None
    rss_end = rss(run_dir)
    sampling.set()
    series.extend(sample(run_dir, time.monotonic() - t0))
    grown = growth(series, warmup)
    aborts = aborted_migrations(run_dir, chaos.kills)
    flat = all(g.get("rss_mb", {}).get("growth") is not None and g["rss_mb"]["growth"] < 0.10
               and g["fds"]["end"] <= g["fds"]["after_warmup"] * 1.10 + 2 for g in grown.values())
    report = {
        "duration_s": args.duration, "load_s": round(load_s, 1), "settle_s": round(settle_s, 1),
        "seed": args.seed, "concurrency": args.concurrency, "sessions": per_worker * args.concurrency,
        "requests": {"sent": tally.sent, "completed": tally.completed, "lost": len(tally.lost),
                     "cut_by_proxy_kill": tally.cuts, "unfinished_workers": stuck, "tokens": tally.tokens},
        "lost_samples": tally.lost[:20],
        "leaked_blocks": leaked,
        "instances_at_end": [{"id": i["id"], "blocks_used": i["blocks_used"], "running": i["running"],
                              "waiting": i["waiting"]} for i in alive],
        "manager_unreachable_at_end": st is None,
        "proxy": {"failovers": proxy_metric(url, "llumnix_proxy_failovers_total"),
                  "redispatches": proxy_metric(url, "llumnix_proxy_redispatches_total"),
                  "given_back": proxy_metric(url, "llumnix_proxy_given_back_total"),
                  "fenced": proxy_metric(url, "llumnix_proxy_fenced_total"),
                  "duplicates": proxy_metric(url, "llumnix_proxy_duplicate_tokens_total")},
        "migrations": None if st is None else {k: st["totals"][k] for k in (
            "migrations_committed", "migrations_aborted", "scale_outs", "scale_ins")},
        "aborted_migrations": aborts,
        "sessions_seen": session_counts(url, st) if args.sessions else None,
        "chaos": chaos.counts, "manager_chaos_s": manager_chaos_s, "chaos_events": chaos.events,
        "rss_mb": {"start": rss_start, "end": rss_end},
        "warmup_s": warmup, "witness_growth": grown, "memory_flat": flat, "samples": series,
        "pids": sorted({p.pid for p in procs(run_dir)}),
        "processes": [{"name": p.name, "pid": p.pid, "create_time": p.create_time} for p in procs(run_dir)],
    }
    report["ok"] = bool(report["requests"]["lost"] == 0 and leaked == 0 and stuck == 0 and tally.sent > 0
                        and aborts["unexplained"] == 0 and (flat or not args.check_memory))
    Path(args.out).write_text(json.dumps(report, indent=2))
    print_summary(report)
    return 0 if report["ok"] else 1


def check_stopped(args) -> int:
    path = Path(args.out)
    report = json.loads(path.read_text())
    left = []
    for p in report.get("processes", []):
        proc = localcluster.Proc(p["name"], p["pid"], p["create_time"], "", [])
        if proc.process() is not None:
            left.append(f"{p['name']} (pid {p['pid']})")
    report["left_running_after_down"] = left
    report["ok"] = bool(report.get("ok")) and not left
    path.write_text(json.dumps(report, indent=2))
    print(f"after down: {len(left)} of {len(report.get('processes', []))} recorded process(es) still running"
          + (f": {', '.join(left)}" if left else ""))
    print("FINAL:", "OK" if report["ok"] else "FAILED")
    return 0 if report["ok"] else 1


def up(args) -> int:
    """The soak's cluster, as `llumnixctl up` starts it, but with the witness instance protected from scale-in
    (a restarted manager that launched one instance too many retires another, never the witness)."""
    witness = next(w for w in WITNESSES if w.startswith("instance-"))

    def place(name: str) -> tuple[list[str], list[str]]:
        return [], ["instance.scale_in_protected=true"] if name == witness else []

    try:
        state = localcluster.up(Path(args.run_dir), args.instances, "sim", 0, None, args.set, timeout_s=args.timeout,
                                place=place, proxies=args.proxies)
    except localcluster.ClusterError as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 1
    print(f"soak: cluster up, proxies at {' '.join(state.urls)}; {witness} is scale-in protected")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--run-dir", required=True)
    r.add_argument("--duration", type=float, default=3600)
    r.add_argument("--out", required=True)
    r.add_argument("--concurrency", type=int, default=8)
    r.add_argument("--sessions", type=int, default=0, help="conversations (prompt_cache_key), spread over the "
                   "concurrent clients: each request is the next turn of one (its prompt the last one, its answer and "
                   "a new message); 0: independent prompts")
    r.add_argument("--max-requests", type=int, default=0, help="bound on requests sent (default: 4 per second)")
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--chaos-min", type=float, default=20)
    r.add_argument("--chaos-max", type=float, default=60)
    r.add_argument("--settle-timeout", type=float, default=120)
    r.add_argument("--warmup", type=float, default=900, help="seconds before memory is measured (at most a quarter"
                   " of the duration)")
    r.add_argument("--manager-chaos-s", type=float, default=None,
                   help="kill and restart the manager only this long into the soak (default: half the warm-up, so"
                   " that the last manager has warmed up too: a fresh one's descriptors rise for minutes as peers and"
                   " clients connect), then it lives on as a witness whose memory is measured")
    r.add_argument("--check-memory", action=argparse.BooleanOptionalAction, default=True,
                   help="fail when a witness's RSS grew 10%% or more after the warm-up, or its descriptors 10%%")
    u = sub.add_parser("up")
    u.add_argument("--run-dir", required=True)
    u.add_argument("--instances", type=int, default=4)
    u.add_argument("--proxies", type=int, default=2)
    u.add_argument("--timeout", type=float, default=120)
    u.add_argument("--set", action="append", default=[], help="section.key=value for every daemon")
    c = sub.add_parser("check-stopped")
    c.add_argument("--out", required=True)
    pl = sub.add_parser("plot")
    pl.add_argument("--out", required=True)
    pl.add_argument("--png", required=True)
    args = ap.parse_args()
    if args.cmd == "plot":
        return plot(args)
    if args.cmd == "up":
        return up(args)
    if args.cmd == "run":
        args.max_requests = args.max_requests or max(1, int(args.duration * 4))
        return run(args)
    return check_stopped(args)


if __name__ == "__main__":
    sys.exit(main())
