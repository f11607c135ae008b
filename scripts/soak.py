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
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from daemons.engine.sim import sim_token_id  # noqa: E402
from llumnixctl.admin import AdminClient, ManagerUnreachable  # noqa: E402
from llumnixctl.lab import localcluster  # noqa: E402
from llumnixctl.main import status_json  # noqa: E402
from soak_report import WITNESSES, aborted_migrations, growth, plot, print_summary  # noqa: E402

VOCAB = 32000
REQUEST_DEADLINE_S = 300.0  # one stream, start to end, at most
SAMPLE_EVERY_S = 15.0


def now_s(t0: float) -> str:
    return f"{time.monotonic() - t0:7.1f}s"


def wall(t: float) -> str:
    """Wall-clock time as the daemons' log lines write it (to the millisecond), for matching them."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f",{int(t * 1000) % 1000:03d}"


# ---------------------------------------------------------------------- cluster views


def procs(run_dir: Path) -> list[localcluster.Proc]:
    state = localcluster.ClusterState.load(run_dir)
    return [] if state is None else state.procs


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


def status(manager: str) -> dict | None:
    client = AdminClient(manager, timeout_s=3)
    try:
        return status_json(client.status(), manager)
    except ManagerUnreachable:
        return None
    finally:
        client.close()


def proxy_metric(url: str, name: str) -> float:
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return float("nan")
    total = 0.0
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            if key == name or key.startswith(name + "{"):
                total += float(value)
    return total


def ctl(run_dir: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-m", "llumnixctl.main", *args, "--run-dir", str(run_dir)],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(args, 124, "", f"timed out after {timeout:g}s")


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


def one_stream(client: httpx.Client, url: str, rnd: random.Random, tally: Tally, chaos: "Chaos | None" = None,
               chosen_at: float | None = None) -> None:
    """One streamed request to ``url``, checked token by token. ``chosen_at``: since when a kill of that proxy
    explains a connection error (when the worker chose it as healthy, or last used its kept-alive connection to
    it, whichever is earlier): such a request is cut (sent again), not lost."""
    max_tokens = rnd.randint(20, 200)
    prompt = [rnd.randrange(3, VOCAB) for _ in range(rnd.randint(8, 300))]
    body = {"model": "llumnix-sim", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
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
    tally.add(error is None, len(ids), None if error is None else
              {"id": rid, "max_tokens": max_tokens, "got": len(ids), "error": str(error)[:300],
               "seconds": round(time.monotonic() - start, 2), "proxy": url, "at": wall(time.time())})


def worker(urls: list[str], seed: int, end: float, budget: threading.Semaphore, tally: Tally,
           chaos: "Chaos | None" = None) -> None:
    rnd = random.Random(seed)
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
                    one_stream(client, used, rnd, tally, chaos, min(chosen_at, last_used.get(used, chosen_at)))
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


class Chaos(threading.Thread):
    """Each kind of fault on its own timer, every 20-60 s (--chaos-min/--chaos-max)."""

    def __init__(self, run_dir: Path, manager: str, rnd: random.Random, end: float, lo: float, hi: float, t0: float,
                 manager_until: float | None = None):
        super().__init__(daemon=True)
        self.run_dir, self.manager, self.rnd, self.end, self.lo, self.hi, self.t0 = run_dir, manager, rnd, end, lo, hi, t0
        self.manager_until = end if manager_until is None else manager_until  # no manager kill after this
        self.kills: list[tuple[float, str]] = []  # (wall time, instance id) of each kill -9 of an instance
        self.stop = threading.Event()
        self.counts: dict[str, int] = {}
        self.events: list[str] = []
        self.drained: dict[str, float] = {}  # instance -> when to undrain it
        state = localcluster.ClusterState.load(run_dir)
        self.proxy_of = dict(zip(state.urls, localcluster.proxy_names(len(state.urls)))) if state else {}
        self.down_since: dict[str, tuple[float, float]] = {}  # proxy name -> (killed, back) monotonic
        self.lock = threading.Lock()

    def is_down(self, url: str) -> bool:
        """Killed and not yet healthy again."""
        with self.lock:
            killed, back = self.down_since.get(self.proxy_of.get(url), (0.0, 0.0))
        return killed > 0 and back == 0.0

    def proxy_was_down(self, url: str, since: float) -> bool:
        """Was the proxy at ``url`` killed after ``since`` (or is it down now)?"""
        name = self.proxy_of.get(url)
        with self.lock:
            killed, back = self.down_since.get(name, (0.0, 0.0))
        return killed >= since - 0.5 or back == 0.0 and killed > 0 or back > since

    def note(self, what: str) -> None:
        line = f"{now_s(self.t0)} [{wall(time.time())}] {' | '.join(what.splitlines())}"
        self.events.append(line)
        print("chaos", line, flush=True)

    def count(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def view(self) -> dict[str, dict]:
        st = status(self.manager)
        return {} if st is None else {i["id"]: i for i in st["instances"]}

    def live(self) -> dict[str, localcluster.Proc]:
        return {p.name.removeprefix("instance-"): p for p in procs(self.run_dir)
                if p.name.startswith("instance-") and p.process() is not None}

    def kill(self) -> None:
        live = self.live()
        if len(live) < 3:
            self.note(f"kill skipped: only {sorted(live)} run")
            return
        view = self.view()
        busy = sorted(i for i in live if view.get(i, {}).get("running"))
        victims = [i for i in busy or sorted(live) if f"instance-{i}" not in WITNESSES] or \
            [i for i in live if f"instance-{i}" not in WITNESSES]
        if not victims:
            self.note(f"kill skipped: only witnesses run ({sorted(live)})")
            return
        iid = self.rnd.choice(victims)
        proc = live[iid].process()
        if proc is not None:
            proc.kill()
            self.kills.append((time.time(), iid))
            self.count("kill")
            self.note(f"kill -9 {iid} (pid {live[iid].pid}, {view.get(iid, {}).get('running', '?')} running)")

    def restart(self, name: str) -> None:
        """kill -9 the daemon ``name`` of the cluster, then start it again with the same command line after
        1-5 s (the same address and port: clients and peers find it again)."""
        state = localcluster.ClusterState.load(self.run_dir)
        old = next((p for p in (state.procs if state else []) if p.name == name and p.process() is not None), None)
        if old is None:
            self.note(f"restart {name} skipped: not running")
            return
        proxy = name.startswith("proxy")
        with self.lock:
            if proxy:
                self.down_since[name] = (time.monotonic(), 0.0)
            old.process().kill()
        down_s = self.rnd.uniform(1.0, 5.0)
        self.note(f"kill -9 {name} (pid {old.pid}); back in {down_s:.1f}s")
        self.stop.wait(down_s)
        try:
            localcluster.gone(psutil.Process(old.pid))
        except psutil.Error:
            pass
        new = localcluster.spawn(self.run_dir, name, old.argv)
        localcluster.record(self.run_dir, state, [new])
        if proxy:  # down until it says it is healthy (as a load balancer's check would)
            url = next(u for u, n in self.proxy_of.items() if n == name)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and new.process() is not None:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        with self.lock:
            if proxy:
                self.down_since[name] = (self.down_since[name][0], time.monotonic())
        self.count(f"restart_{'proxy' if proxy else name}")
        self.note(f"started {name} again (pid {new.pid})")

    def kill_proxy(self) -> None:
        names = [n for n in self.proxy_of.values() if n not in WITNESSES]
        if not names:
            self.note("proxy restart skipped: the cluster has one proxy (the witness)")
            return
        self.restart(self.rnd.choice(names))

    def kill_manager(self) -> None:
        self.restart("manager")

    def migrate(self) -> None:
        view = self.view()
        srcs = sorted(i for i, v in view.items() if v["state"] == "alive" and v["running"])
        dsts = sorted(i for i, v in view.items() if v["state"] == "alive" and not v["draining"])
        if not srcs or len(dsts) < 2:
            self.note(f"migrate skipped: sources {srcs}, destinations {dsts}")
            return
        src = self.rnd.choice(srcs)
        dst = self.rnd.choice([d for d in dsts if d != src])
        n = self.rnd.randint(1, 3)
        res = ctl(self.run_dir, "migrate", "--from", src, "--to", dst, "--count", str(n), "--timeout", "60", timeout=90)
        self.count("migrate")
        self.note(f"migrate {n} {src} -> {dst}: rc {res.returncode}: {(res.stdout + res.stderr).strip()[:300]}")

    def drain(self) -> None:
        view = self.view()
        serving = sorted(i for i, v in view.items() if v["state"] == "alive" and not v["draining"])
        if len(serving) < 3 or self.drained:
            self.note(f"drain skipped: serving {serving}, drained {sorted(self.drained)}")
            return
        iid = self.rnd.choice(serving)
        res = ctl(self.run_dir, "drain", iid, timeout=30)
        self.note(f"drain {iid}: rc {res.returncode}: {(res.stdout + res.stderr).strip()[:300]}")
        if res.returncode == 0:
            self.count("drain")
            self.drained[iid] = time.monotonic() + self.rnd.uniform(5.0, 15.0)

    def undrain(self, iid: str) -> None:
        res = ctl(self.run_dir, "undrain", iid, timeout=30)
        gone = "unknown instance" in res.stderr or "is dead" in res.stderr
        if res.returncode == 0 or gone:
            self.drained.pop(iid, None)
            self.count("undrain")
        self.note(f"undrain {iid}: rc {res.returncode}: {(res.stdout + res.stderr).strip()[:300]}")

    def run(self) -> None:
        actions = {"kill": self.kill, "migrate": self.migrate, "drain": self.drain,
                   "kill_proxy": self.kill_proxy, "kill_manager": self.kill_manager}
        due = {k: time.monotonic() + self.rnd.uniform(self.lo, self.hi) * 0.5 for k in actions}
        while not self.stop.is_set() and time.monotonic() < self.end:
            now = time.monotonic()
            for iid, at in list(self.drained.items()):
                if now >= at:
                    self.undrain(iid)
            if "kill_manager" in due and now + 15 >= self.manager_until:
                del due["kill_manager"]
                if self.manager_until < self.end:
                    self.note("the manager is killed no more: from now on it is a witness")
            for kind, at in sorted(due.items(), key=lambda kv: kv[1]):
                if now >= at and now < self.end:
                    try:
                        actions[kind]()
                    except Exception as exc:  # noqa: BLE001 - a chaos step must not end the soak
                        self.note(f"{kind} failed: {exc!r}")
                    due[kind] = time.monotonic() + self.rnd.uniform(self.lo, self.hi)
            self.stop.wait(0.5)

    def finish(self, timeout_s: float = 60) -> None:
        """Undo the drains still in force (retried while the manager is slow; bounded)."""
        deadline = time.monotonic() + timeout_s
        while self.drained and time.monotonic() < deadline:
            for iid in list(self.drained):
                self.undrain(iid)
            if self.drained:
                time.sleep(1)


# ---------------------------------------------------------------------- run


def settle(manager: str, timeout_s: float) -> tuple[dict | None, float]:
    """Wait until every live instance is idle and holds no block; returns the last status and the wait."""
    start = time.monotonic()
    st = None
    while time.monotonic() - start < timeout_s:
        st = status(manager) or st
        if st is not None:
            alive = [i for i in st["instances"] if i["state"] == "alive"]
            busy = [i for i in alive if i["blocks_used"] or i["running"] or i["waiting"] or i["migrating_out"]
                    or i["migrating_in"]]
            if alive and not busy and not st["totals"]["launching"]:
                break
        time.sleep(1)
    return st, time.monotonic() - start


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
    workers = [threading.Thread(target=worker, args=(state.urls, args.seed * 1000 + k, end, budget, tally, chaos),
                                daemon=True) for k in range(args.concurrency)]
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
        "seed": args.seed, "concurrency": args.concurrency,
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
