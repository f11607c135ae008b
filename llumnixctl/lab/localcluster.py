"""A local cluster: the daemons as background processes, their pids and logs in a run directory.

``cluster.json`` in the run directory records every process with its start time, so ``down`` stops
exactly the processes ``up`` started (and the instances added to it later), never a process that reused a
pid. The manager of such a cluster launches instances with ``llumnixctl local-instance`` (``add`` and
auto-scaling), which records them in ``cluster.json`` too, under a lock. ``stop`` (and so ``down``) reads
``cluster.json`` again under that lock: it stops what was recorded since ``up`` as well.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Callable

import psutil

from daemons.config import load_config
from llumnixctl.admin import AdminClient, ManagerUnreachable
from llumnixctl.lab import forkserver
from llumnixctl.lab.ports import distinct_ports, free_port
# The run directory's record is the operator commands' too; its names stay reachable here.
from llumnixctl.rundir import STATE_FILE, ClusterState, Proc, boot_start, default_run_dir  # noqa: F401


class ClusterError(Exception):
    pass


def spawn(run_dir: Path, name: str, argv: list[str]) -> Proc:
    """Start ``argv`` in a session of its own, its output in ``<run_dir>/<name>.log``: with Popen, or forked by
    this process's fork server where it has one and ``argv`` is a daemon module of this interpreter
    (llumnixctl/lab/forkserver.py; the test suite's, which saves the daemons' start-up imports)."""
    log_path = run_dir / f"{name}.log"
    with open(log_path, "ab") as log:
        pid = _forked(argv, log.fileno())
        if pid is None:
            pid = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True).pid
    return Proc(name, pid, psutil.Process(pid).create_time(), str(log_path), argv, boot_start(pid) or 0.0)


def _forked(argv: list[str], log_fd: int) -> int | None:
    """The pid of ``argv`` forked by this process's fork server, or None where there is none to ask, it does not
    serve this argv or this thread's namespaces, or it failed (the caller starts it with Popen; a failure is said)."""
    path = forkserver.server()
    served = forkserver.served_module(argv) if path else None
    if served is None:
        return None
    try:
        with open(os.devnull, "rb") as null:
            return forkserver.fork(path, served[0], served[1], null.fileno(), log_fd, log_fd)
    except forkserver.ForkServerError as exc:
        print(f"llumnixctl: {exc}; starting {served[0]} with a new interpreter", file=sys.stderr)
        return None


def _tail(path: str, lines: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def daemon_argv(name: str) -> list[str]:
    """Run a daemon with this interpreter, so a cluster works from a venv that is not on PATH."""
    module = {"manager": "daemons.manager", "instance": "daemons.instance", "proxy": "daemons.proxy.app"}[name]
    return [sys.executable, "-m", module]


Placement = Callable[[str], "tuple[list[str], list[str]]"]


def proxy_names(proxies: int) -> list[str]:
    """The proxies of a local cluster: ``proxy`` (the one at ``url``), then ``proxy-1``, ``proxy-2``, ..."""
    return ["proxy"] + [f"proxy-{k}" for k in range(1, proxies)]


def up(run_dir: Path, instances: int, backend: str, port: int, config: str | None, sets: list[str],
       timeout_s: float = 60.0, *, place: Placement | None = None, manager_host: str = "127.0.0.1",
       proxies: int = 1, roles: list[str] | None = None) -> ClusterState:
    """Start the manager, ``instances`` instances (i0, i1, ...) and ``proxies`` proxies; wait until every
    proxy's /health counts every instance alive.

    The first proxy listens on ``port`` (its URL is ``url``); the others (``proxy-1``, ...) on free ports of
    the same host, each with its own token address (``proxy.token_address`` binds port 0 unless set: with
    a fixed port in ``sets`` only one proxy could bind it). ``urls`` lists every proxy's URL. ``roles``: the
    instances' roles (instance.role), in order (those past its end: mixed).

    ``place`` (optional) maps a daemon's name (``manager``, ``proxy``, ``instance-i0``, ...) to (argv prefix,
    extra ``--set`` settings): e.g. ``(lab.prefix("i0"), ["instance.request_address=tcp://198.18.0.2:0",
    "migration.kv_host=198.18.0.2"])`` runs that instance on another "host" (llumnixctl.lab.netns). The extra
    settings come after ``sets``. ``manager_host``: the address in ``manager.address`` (every daemon and this
    function reach the manager there). The proxy is waited for at its own ``proxy.host`` (extra settings
    included), so the caller must be able to reach the manager and the proxy: run it in their namespace.
    Instances added later (``add``, auto-scaling) get no placement."""
    if proxies < 1:
        raise ClusterError(f"a cluster needs at least one proxy (got {proxies})")
    token_address = load_config(config, sets).proxy.token_address
    if proxies > 1 and not token_address.endswith(":0"):
        raise ClusterError(f"{proxies} proxies cannot share proxy.token_address={token_address}: leave it at "
                           "port 0 (each proxy binds a free port)")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ClusterError(f"cannot use {run_dir} as the run directory: {exc.strerror}") from None
    old = ClusterState.load(run_dir)
    if old is not None and old.live():
        pids = ", ".join(str(p.pid) for p in old.live())
        raise ClusterError(f"a cluster from {run_dir} is already running (pids {pids}); run `llumnixctl down` first")
    placed: dict[str, tuple[list[str], list[str]]] = {}

    def where(name: str) -> tuple[list[str], list[str]]:
        """(argv prefix, extra settings) of a daemon: its placement, if any."""
        if place is None:
            return [], []
        if name not in placed:
            prefix, extra = place(name)
            placed[name] = (list(prefix), list(extra))
        return placed[name]

    def as_args(extra: list[str]) -> list[str]:
        return [a for s in extra for a in ("--set", s)]

    http_host = load_config(config, sets + where("proxy")[1]).proxy.host if place is not None else "127.0.0.1"
    if http_host in ("", "0.0.0.0", "::"):
        http_host = "127.0.0.1"
    if port:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no conflict
            try:
                s.bind((http_host, port))
            except OSError as exc:
                if exc.errno != errno.EADDRNOTAVAIL:  # not an address of ours: the proxy's namespace checks
                    raise ClusterError(f"port {port} on {http_host} is in use; pick another with --port") from None
    else:
        port = free_port(http_host)
    manager_address = f"tcp://{manager_host}:{free_port(manager_host)}"
    common = (["--config", config] if config else []) + [a for s in sets for a in ("--set", s)]
    common += ["--set", f"manager.address={manager_address}"]
    if not load_config(config, sets).scaling.launcher:  # add and auto-scaling start instances of this cluster
        common += ["--set", f"scaling.launcher={json.dumps(launcher_command(run_dir))}"]
    url_host = f"[{http_host}]" if ":" in http_host else http_host
    ports = distinct_ports(http_host, [port], proxies)
    urls = [f"http://{url_host}:{p}" for p in ports]
    state = ClusterState(manager_address, urls[0], backend, config, args=common, run_dir=str(run_dir), urls=urls)

    def fail(why: str, proc: Proc | None = None, also: list[Proc] = ()) -> ClusterError:
        stop(state)
        detail = "".join(f"\n--- last lines of {p.log} ---\n{_tail(p.log)}" for p in [*also, *([proc] if proc else [])])
        return ClusterError(why + detail)

    try:
        prefix, extra = where("manager")
        mgr = spawn(run_dir, "manager", prefix + daemon_argv("manager") + common + ["--set", "manager.metrics_port=0",
                                                                                 "--set", "manager.bind="] + as_args(extra))
        state.procs.append(mgr)
        state.save(run_dir)
        client = AdminClient.for_settings(manager_address, config, sets, timeout_s=0.5)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.status()
                break
            except ManagerUnreachable:
                if mgr.process() is None:
                    raise fail("llumnix-manager exited during start-up", mgr) from None
                if time.monotonic() > deadline:
                    raise fail(f"llumnix-manager did not answer within {timeout_s:g}s", mgr) from None
        for i in range(instances):
            prefix, extra = where(f"instance-i{i}")
            role = ["--set", f"instance.role={roles[i]}"] if roles and i < len(roles) else []
            argv = prefix + daemon_argv("instance") + common + ["--set", f"instance.id=i{i}", "--set",
                                                            f"instance.backend={backend}"] + role + as_args(extra)
            state.procs.append(spawn(run_dir, f"instance-i{i}", argv))
        for name, proxy_port in zip(proxy_names(proxies), ports):
            prefix, extra = where(name)
            state.procs.append(spawn(run_dir, name, prefix + daemon_argv("proxy") + common
                                      + ["--set", f"proxy.port={proxy_port}"] + as_args(extra)))
        ours = list(state.procs)
        record(run_dir, state, [])  # keeps what a launch (auto-scaling from the start) recorded meanwhile
        while True:
            for p in ours:
                if p.process() is None:
                    raise fail(f"{p.name} exited during start-up", p)
            if all(_healthy(u, instances) for u in state.urls):
                break
            if time.monotonic() > deadline:
                why = _not_up(state, client, instances)
                raise fail(f"the cluster did not come up within {timeout_s:g}s (see logs in {run_dir}): {why}",
                           state.procs[-1], also=[mgr, *(p for p in ours if p.name.startswith("instance-"))])
            time.sleep(0.1)
        client.close()
    except KeyboardInterrupt:
        stop(state)
        stop_strays(state)
        raise
    return state


DAEMON_MODULES = ("daemons.manager", "daemons.instance", "daemons.proxy.app")


def stop_strays(state: ClusterState, timeout_s: float = 10.0) -> list[int]:
    """Stop the daemons this process started that ``state`` does not hold: an interrupt (Ctrl-C, or the SIGTERM
    of ``timeout``) that lands in ``spawn`` after the child was started, before its Proc was recorded, leaves
    one. The pids it stopped."""
    known = {p.pid for p in state.procs}
    strays = []
    for child in psutil.Process().children():
        try:
            argv = child.cmdline()
        except psutil.Error:
            continue
        if child.pid not in known and any(m in argv for m in DAEMON_MODULES):
            strays.append(child)
    for child in strays:
        try:
            child.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(strays, timeout=timeout_s)
    for child in alive:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=timeout_s)
    return [c.pid for c in strays]


def launcher_command(run_dir: Path) -> str:
    """The scaling launcher of a local cluster: `llumnixctl local-instance {id}` with this interpreter."""
    return (f"{shlex.quote(sys.executable)} -m llumnixctl.main local-instance {{id}} "
            f"--run-dir {shlex.quote(str(run_dir.resolve()))}")


class _Locked:
    """An exclusive lock on the run directory's state, for read-modify-write of cluster.json."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "cluster.lock"

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        os.close(self.fd)  # releases the lock


def _union(*lists: list[Proc]) -> list[Proc]:
    """The processes of all lists, each once (by pid and start time), in order of appearance."""
    seen, out = set(), []
    for procs in lists:
        for p in procs:
            key = (p.pid, round(p.create_time, 2))
            if key not in seen:
                seen.add(key)
                out.append(p)
    return out


def record(run_dir: Path, state: ClusterState, procs: list[Proc]) -> None:
    """Record ``procs`` as processes of this cluster, in ``state`` and, under the lock, in ``cluster.json``
    (keeping what others recorded there), so that ``stop`` and ``down`` stop them too. A recorded process
    of the same name that is no longer running is forgotten (a restarted daemon replaces its old entry)."""
    names = {p.name for p in procs}

    def merged(old: list[Proc]) -> list[Proc]:
        kept = [p for p in old if p.name not in names or p.process() is not None]
        return _union(kept, procs)

    with _Locked(run_dir):
        current = ClusterState.load(run_dir)
        state.procs = merged(_union(state.procs, current.procs if current else []))
        state.save(run_dir)


def add_instance(run_dir: Path, state: ClusterState, instance_id: str, sets: list[str] | None = None,
                 timeout_s: float = 60.0) -> Proc:
    """Start one more instance of this cluster (its settings, then ``sets``) and wait until it is alive."""
    with _Locked(run_dir):
        current = ClusterState.load(run_dir)  # launches may run side by side
        if current is None:
            raise ClusterError(f"the cluster in {run_dir} is down (no {STATE_FILE})")
        state.procs = current.procs
        if any(p.name == f"instance-{instance_id}" and p.process() is not None for p in state.procs):
            raise ClusterError(f"instance {instance_id} of this cluster is already running")
        argv = daemon_argv("instance") + state.args + ["--set", f"instance.id={instance_id}", "--set",
                                                   f"instance.backend={state.backend}"]
        argv += [a for s in sets or [] for a in ("--set", s)]
        proc = spawn(run_dir, f"instance-{instance_id}", argv)
        state.procs = [p for p in state.procs if p.name != proc.name] + [proc]
        state.save(run_dir)
    client = AdminClient.for_args(state.manager_address, state.args, timeout_s=1.0)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if proc.process() is None:
                raise ClusterError(f"instance {instance_id} exited during start-up\n--- last lines of {proc.log} ---\n"
                                   f"{_tail(proc.log)}")
            try:
                if any(v.instance_id == instance_id and v.state == "alive" for v in client.status().instances):
                    return proc
            except ManagerUnreachable:
                pass
            if time.monotonic() > deadline:
                raise ClusterError(f"instance {instance_id} did not register within {timeout_s:g}s (see {proc.log})")
            time.sleep(0.1)
    finally:
        client.close()


def _not_up(state: ClusterState, client: AdminClient, instances: int) -> str:
    """Why a cluster is not up yet, in one line: what each proxy counts and what the manager sees."""
    parts = []
    for u in state.urls:
        try:
            with urllib.request.urlopen(u + "/health", timeout=2) as resp:
                body = resp.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            body = exc.read().decode(errors="replace")
        except (urllib.error.URLError, OSError) as exc:
            body = f"no answer ({exc})"
        parts.append(f"{u}/health says {body.strip()}")
    try:
        views = client.status().instances
        seen = ", ".join(f"{v.instance_id} {v.state}" for v in views) or "none"
        parts.append(f"the manager sees {len(views)} of {instances} instance(s): {seen}")
    except ManagerUnreachable as exc:
        parts.append(f"the manager does not answer ({exc})")
    return "; ".join(parts)


def _healthy(url: str, instances: int) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as resp:
            return json.loads(resp.read()).get("instances_alive", 0) >= instances
    except (urllib.error.URLError, OSError, ValueError):
        return False


def down(run_dir: Path, timeout_s: float = 15.0) -> list[Proc]:
    """Stop the cluster of ``run_dir`` and forget it (see ``stop``)."""
    with _Locked(run_dir):
        state = ClusterState.load(run_dir)
        if state is None:
            raise ClusterError(f"no local cluster in {run_dir} (nothing to stop)")
        return _stop_and_forget(state, run_dir, timeout_s)


def stop(state: ClusterState, timeout_s: float = 15.0) -> list[Proc]:
    """Stop every process of the cluster and forget it: those in ``state`` and, where it has a run
    directory, all recorded in its ``cluster.json`` (instances that ``add`` or auto-scaling started
    after ``up``), which is then removed. Under the state lock, so that an instance being launched
    meanwhile is either recorded first (and stopped here) or refused. Stopping a stopped cluster is a
    no-op. Returns the processes that were still running."""
    run_dir = Path(state.run_dir) if state.run_dir else None
    if run_dir is None or not run_dir.is_dir():
        return _stop_procs(state, timeout_s)
    with _Locked(run_dir):
        return _stop_and_forget(state, run_dir, timeout_s)


def _stop_and_forget(state: ClusterState, run_dir: Path, timeout_s: float) -> list[Proc]:
    recorded = ClusterState.load(run_dir)
    everything = replace(state, procs=_union(state.procs, recorded.procs if recorded else []))
    stopped = _stop_procs(everything, timeout_s)
    (run_dir / STATE_FILE).unlink(missing_ok=True)
    return stopped


def _stop_procs(state: ClusterState, timeout_s: float = 15.0) -> list[Proc]:
    """SIGTERM the proxy, then instances, then the manager; SIGKILL what outlives the timeout. Auto-scaling
    is switched off first: instances leaving would otherwise look like a cluster below its minimum. A manager
    that does not confirm it (too busy to answer, or not running) is stopped first instead, so that it launches
    nothing while the instances stop."""
    if not state.live():
        return []  # nothing to stop (and no manager to ask)
    client = AdminClient.for_args(state.manager_address, state.args, timeout_s=5.0)
    manager_rank = 2
    try:
        client.policy(scaling_policy="off")
    except (ManagerUnreachable, RuntimeError):
        manager_rank = -1
    finally:
        client.close()

    def rank(p: Proc) -> int:  # the proxy first, the manager last; instances and anything else between
        return {"proxy": 0, "manager": manager_rank}.get(p.name.split("-")[0], 1)

    stopped = []
    for group in (-1, 0, 1, 2):
        procs = [(p, p.process()) for p in state.procs if rank(p) == group]
        procs = [(p, live) for p, live in procs if live is not None]
        for _, live in procs:
            try:
                live.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        alive = _wait_gone([live for _, live in procs], timeout_s)
        for live in alive:
            try:
                live.kill()
            except psutil.NoSuchProcess:
                pass
        _wait_gone(alive, 5)
        stopped += [p for p, _ in procs]
    return stopped


def gone(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE  # exited; its parent (maybe not us) has yet to reap it
    except psutil.NoSuchProcess:
        return True


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait until each process exited; returns those still running after ``timeout_s``. Children of
    ours are reaped; a process that another one started counts as gone once it is a zombie (psutil's
    wait_procs would wait on such a zombie until the timeout)."""
    deadline = time.monotonic() + timeout_s
    left = list(procs)
    while left:
        _, left = psutil.wait_procs(left, timeout=0.05)  # reaps our own children
        left = [p for p in left if not gone(p)]
        if not left or time.monotonic() > deadline:
            break
    return left
