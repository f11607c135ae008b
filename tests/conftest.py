"""Fixtures that start real daemons on loopback and always stop them.

Every process the test run starts carries ``LLUMNIX_TEST_RUN=<this run's id>`` in its environment (set
here at configure time, inherited by daemons, launchers and ``llumnixctl``); at the end of the run, any
such process still running is reported, killed (by pid) and fails the run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from llumnixctl.admin import AdminClient
from llumnixctl.lab import localcluster

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# typer (0.2x) sets PYDANTIC_DISABLE_PLUGINS while it builds a command and deletes it after: ``cli`` below runs
# llumnixctl in this process, and a test thread reading os.environ meanwhile (httpx reads the proxy variables on
# every request) then fails with KeyError. Present from the start, the variable is only ever overwritten.
os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "1")

# Property tests run beside daemons that load both cores: time is no measure of a strategy there.
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("suite", suppress_health_check=[HealthCheck.too_slow], deadline=None)
settings.load_profile("suite")

# Fast clusters for tests: short heartbeats, steps at a tenth of the default latency model.
FAST = ["manager.heartbeat_interval_s=0.2", "sim.time_scale=0.1", "instance.shutdown_grace_s=1"]
# How long a test cluster may take to come up. A sim cluster starts in ~5 s on a quiet machine, but in CI (two test
# streams on 2 cores, on a busy host) a passing run took 55 s and a failing one passed 60 s with every daemon
# running: a slow start is not a broken one. A start that never completes still fails, saying why
# (localcluster names what the proxies count and what the manager sees).
UP_TIMEOUT_S = 180


class Cluster:
    def __init__(self, state: localcluster.ClusterState, run_dir: Path):
        self.state = state
        self.run_dir = run_dir
        self.url = state.url
        self.manager = state.manager_address

    def stop(self, timeout_s: float = 10) -> list[localcluster.Proc]:
        """Stop every process of the cluster: those of ``up``, those that ``add`` or auto-scaling recorded
        in cluster.json since, and those registered here. What the fixtures do at teardown; idempotent."""
        return localcluster.stop(self.state, timeout_s=timeout_s)

    def register(self, proc, name: str | None = None, log: str = "") -> localcluster.Proc:
        """Make a process started by hand (a daemon restarted after kill -9, say) one of this cluster's, so
        that stop() and `llumnixctl down` stop it: by pid and start time, never by name. ``proc`` is a
        localcluster.Proc, a psutil.Process, a subprocess.Popen or a pid. A dead entry of the same name
        is replaced, so proc(name) is the new process."""
        if not isinstance(proc, localcluster.Proc):
            live = psutil.Process(proc if isinstance(proc, int) else proc.pid)
            with live.oneshot():
                proc = localcluster.Proc(name or live.name(), live.pid, live.create_time(), log, live.cmdline(),
                                         localcluster.boot_start(live.pid) or 0.0)
        localcluster.record(self.run_dir, self.state, [proc])
        return proc

    def spawn(self, name: str, argv: list[str]) -> localcluster.Proc:
        """Start a process as localcluster does (log in the run dir, own session) and register it."""
        return self.register(localcluster.spawn(self.run_dir, name, argv))

    def admin(self) -> AdminClient:
        return AdminClient(self.manager, timeout_s=3)

    def status(self) -> dict:
        res = cli("status", "--json", "--run-dir", str(self.run_dir))  # in-process: tests poll it
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)

    def proc(self, name: str) -> localcluster.Proc:
        return [p for p in self.state.procs if p.name == name][-1]  # the newest of that name

    def openai(self, **kw):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kw)

    def logs(self) -> str:
        return "\n".join(f"--- {p.log}\n" + Path(p.log).read_text(errors="replace")[-3000:]
                         for p in self.state.procs if p.log and Path(p.log).exists())


@pytest.fixture
def start_cluster(tmp_path_factory):
    """start_cluster(instances=2, sets=[...]) -> Cluster; every cluster is stopped at teardown."""
    started: list[Cluster] = []

    def start(instances: int = 2, sets: list[str] | None = None) -> Cluster:
        run_dir = tmp_path_factory.mktemp("run")
        state = localcluster.up(run_dir, instances, "sim", 0, None, FAST + (sets or []), timeout_s=UP_TIMEOUT_S)
        cluster = Cluster(state, run_dir)
        started.append(cluster)
        return cluster

    start.started = started  # what a failure report reads the daemons' warnings from
    yield start
    for cluster in started:
        cluster.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One shared 2-instance cluster for tests that do not disturb it."""
    run_dir = tmp_path_factory.mktemp("shared")
    shared = Cluster(localcluster.up(run_dir, 2, "sim", 0, None, FAST, timeout_s=UP_TIMEOUT_S), run_dir)
    try:
        yield shared
    finally:
        shared.stop()


def ctl(*args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llumnixctl.main", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def cli(*args: str) -> subprocess.CompletedProcess:
    """llumnixctl in this process (no interpreter start-up: seconds saved per call on a loaded machine);
    the same exit status, stdout and stderr as ``ctl``."""
    from typer.testing import CliRunner

    from llumnixctl.main import app

    res = CliRunner().invoke(app, list(args), prog_name="llumnixctl")
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return subprocess.CompletedProcess(["llumnixctl", *args], res.exit_code, res.stdout, res.stderr)


def ctl_json(*args: str) -> dict:
    """A cluster verb's JSON, run in this process (``cli``): the tests call it often."""
    res = cli(*args, "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


# ------------------------------------------------------------------ daemons forked, not started afresh


@pytest.fixture(scope="session", autouse=True)
def _fork_server(request):
    """Where the session has e2e tests, a fork server (llumnixctl/lab/forkserver.py) that has imported torch and
    the daemons starts the daemons of local clusters: a sim instance then costs a fork, not 2 CPU-seconds of
    imports (the suite starts well over a hundred; on 2 cores that was minutes of the run). Only this process's
    spawns use it (``llumnixctl`` commands the tests run start their daemons as operators' do).
    LLUMNIX_TEST_FORKSERVER=0 starts every daemon with a new interpreter; a test that reads a daemon's exit
    status, or needs it to be this process's child, asks for ``no_fork_server``."""
    from llumnixctl.lab import forkserver, procs

    if (os.environ.get("LLUMNIX_TEST_FORKSERVER", "1") == "0"
            or not any(item.get_closest_marker("e2e") for item in request.session.items)):
        yield None
        return
    import tempfile

    folder = tempfile.mkdtemp(prefix="llumnix-fork-")  # short: a unix socket's path is at most 107 bytes
    path = os.path.join(folder, "server.sock")
    server = subprocess.Popen([sys.executable, "-m", "llumnixctl.lab.forkserver", path], stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        ready = server.stdout.readline().strip() == "ready"  # after its imports: seconds
        if ready:
            forkserver.use(path)
        else:
            import warnings

            warnings.warn(f"the fork server did not start (exit status {server.poll()}): daemons start afresh")
        yield path if ready else None
    finally:
        forkserver.use(None)
        procs.stop([server], grace_s=10)
        server.stdout.close()
        Path(path).unlink(missing_ok=True)
        os.rmdir(folder)


@pytest.fixture
def no_fork_server():
    """This test's daemons start with a new interpreter, as this process's children: their exit status is its
    to read, and ``localcluster.stop_strays`` sees them."""
    from llumnixctl.lab import forkserver

    previous = forkserver.use(None)
    yield
    forkserver.use(previous)


# ------------------------------------------------------------------ the folder says which kind a test is

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    """tests/e2e/ holds the tests that start daemons or engines (they carry the e2e mark, which scripts/test.sh
    selects on), tests/unit/ the rest: a test whose mark and folder disagree is a collection error."""
    wrong = []
    for item in items:
        folder = Path(str(item.path)).resolve().parent
        marked = item.get_closest_marker("e2e") is not None
        if folder == _HERE / "e2e" and not marked or folder == _HERE / "unit" and marked:
            wrong.append(item.nodeid)
    if wrong:
        raise pytest.UsageError("the e2e mark and the folder disagree (tests/e2e/ is marked e2e, tests/unit/ is not): "
                                + ", ".join(wrong[:10]))


# ------------------------------------------------------------------ daemons only in e2e modules

_REAL_POPEN_INIT = subprocess.Popen.__init__


@pytest.fixture(autouse=True)
def _daemons_only_where_marked(request, monkeypatch):
    """scripts/test.sh runs the modules without the e2e mark side by side on every core and the e2e ones one
    at a time: a test that starts a daemon must carry the mark (its module then runs alone), or it fails."""
    if request.node.get_closest_marker("e2e") is not None:
        yield
        return
    daemons: list[str] = []

    def init(self, args, *a, **kw):
        argv = [str(x) for x in args] if isinstance(args, (list, tuple)) else [str(args)]
        if any(x.startswith("daemons.") or x == "local-instance" for x in argv):
            daemons.append(" ".join(argv)[:200])
        _REAL_POPEN_INIT(self, args, *a, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", init)
    yield
    assert not daemons, f"started daemons without pytest.mark.e2e on the test or its module: {daemons}"


# ------------------------------------------------------------------ what the daemons said, when a test fails

DAEMON_LOG_LINES = 60


def daemon_warnings(run_dir: Path, limit: int = DAEMON_LOG_LINES) -> str:
    """The WARNING and ERROR lines of every daemon log in ``run_dir`` (one cluster's), oldest first, at most
    ``limit`` of them (the last): what a failure report needs to tell a death, a stall or a refusal apart."""
    found: list[tuple[str, str]] = []
    for path in sorted(Path(run_dir).glob("*.log")):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if " WARNING " in line or " ERROR " in line or line.startswith("Traceback"):
                found.append((line[:23], f"{path.stem}| {line[:400]}"))
    found.sort(key=lambda t: t[0])
    return "\n".join(line for _, line in found[-limit:])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        seen = set()
        clusters = []
        for value in getattr(item, "funcargs", {}).values():
            clusters += getattr(value, "started", None) or [value]  # start_cluster: the clusters it started
        for value in clusters:
            run_dir = getattr(value, "run_dir", None)
            # Duck-typed: tests import tests.conftest, pytest loads this file as conftest (two Cluster classes).
            if run_dir is not None and hasattr(value, "state") and run_dir not in seen:
                seen.add(run_dir)
                text = daemon_warnings(run_dir)
                if text:
                    report.sections.append((f"daemon warnings ({Path(run_dir).name})", text))
    return report


# ------------------------------------------------------------------ no process outlives the test run

RUN_MARKER = "LLUMNIX_TEST_RUN"


_marker_key = pytest.StashKey[str]()


def pytest_configure(config):
    # A fresh id per pytest process (never one inherited from an outer run): only its own processes count.
    os.environ[RUN_MARKER] = config.stash.setdefault(_marker_key, uuid.uuid4().hex)


def _marked(marker: str) -> list[psutil.Process]:
    """Running processes (not zombies, not this one) whose environment carries ``marker``."""
    found = []
    needle = f"{RUN_MARKER}={marker}"
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            with open(f"/proc/{p.pid}/environ", "rb") as f:
                if needle.encode() in f.read().split(b"\0"):
                    found.append(p)
        except (psutil.Error, OSError):
            continue  # gone meanwhile, or not ours to read
    return found


def _still_running(procs: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in procs if p.is_running() and not localcluster.gone(p)]


def _leftovers(marker: str) -> list[psutil.Process]:
    """Marked processes that are still running after a grace period: a launcher whose cluster was just
    stopped exits by itself within a second or so; a leaked daemon does not."""
    grace_s = float(os.environ.get("LLUMNIX_TEST_LEFTOVER_GRACE_S", "3"))
    deadline = time.monotonic() + grace_s
    left = _marked(marker)
    while left and time.monotonic() < deadline:
        psutil.wait_procs(left, timeout=0.1)  # reaps our own children
        left = _still_running(left)
    return _marked(marker) if left else []


def _kill(procs: list[psutil.Process], term_wait_s: float = 3.0) -> None:
    """SIGTERM these processes (psutil refuses a pid that was reused), SIGKILL what is left after a moment."""
    for sig, wait_s in ((signal.SIGTERM, term_wait_s), (signal.SIGKILL, 2.0)):
        for p in procs:
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass
        deadline = time.monotonic() + wait_s
        while procs and time.monotonic() < deadline:
            psutil.wait_procs(procs, timeout=0.1)
            procs = _still_running(procs)
        if not procs:
            return


def _describe(p: psutil.Process) -> str:
    try:
        return f"pid {p.pid}: {' '.join(p.cmdline())[:300]}"
    except psutil.Error:
        return f"pid {p.pid}: (gone)"


@pytest.hookimpl(wrapper=True, trylast=True)  # inner wrapper: after fixture teardown, before the summary
def pytest_sessionfinish(session, exitstatus):
    try:
        return (yield)  # the runner tears down the remaining fixtures here (also after -x or Ctrl-C)
    finally:
        _check_no_process_left(session)


def _check_no_process_left(session) -> None:
    marker = session.config.stash.get(_marker_key, None)
    if marker is None:
        return
    try:
        left = _leftovers(marker)
        lines = [_describe(p) for p in left]
        _kill(left)
    except KeyboardInterrupt:  # Ctrl-C while waiting: no more waiting, but still kill them, and do not crash
        left, lines = [], []
        try:
            left = _marked(marker)
            lines = [_describe(p) for p in left]
            for p in left:
                try:
                    p.kill()
                except psutil.Error:
                    pass
        except KeyboardInterrupt:
            pass
    if not left:
        return
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    header = f"{len(left)} process(es) started by the test run were still running (killed now):"
    if tr is not None:
        tr.write_sep("=", "processes left behind", red=True, bold=True)
        tr.write_line(header, red=True)
        for line in lines:
            tr.write_line("  " + line)
    else:
        print(header, *("  " + line for line in lines), sep="\n", file=sys.stderr)
    if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
