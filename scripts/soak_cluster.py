"""What the soak (scripts/soak.py) does to its cluster and how it looks at it: operator commands, the
manager's status, the wait for a settled cluster, and the chaos thread that kills, restarts, migrates and
drains on its own timers (--chaos-min/--chaos-max), keeping the witnesses alive (the first proxy and
instance i0 always; the manager once the first half of the warm-up is over).
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

from llumnixctl.admin import AdminClient, ManagerUnreachable
from llumnixctl.lab import localcluster
from llumnixctl.main import status_json
from soak_report import WITNESSES


def now_s(t0: float) -> str:
    return f"{time.monotonic() - t0:7.1f}s"


def wall(t: float) -> str:
    """Wall-clock time as the daemons' log lines write it (to the millisecond), for matching them."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f",{int(t * 1000) % 1000:03d}"



def procs(run_dir: Path) -> list[localcluster.Proc]:
    state = localcluster.ClusterState.load(run_dir)
    return [] if state is None else state.procs



def status(manager: str) -> dict | None:
    client = AdminClient(manager, timeout_s=3)
    try:
        return status_json(client.status(), manager)
    except ManagerUnreachable:
        return None
    finally:
        client.close()



def ctl(run_dir: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-m", "llumnixctl.main", *args, "--run-dir", str(run_dir)],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(args, 124, "", f"timed out after {timeout:g}s")



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
