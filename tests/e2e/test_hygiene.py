"""Test hygiene: the fixtures stop every process of a cluster, and no process outlives the test run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from llumnixctl.lab import localcluster
from llumnixctl.lab.ports import reservations_path
from tests.conftest import RUN_MARKER, ctl_json
from tests.streams import wait_for

pytestmark = pytest.mark.e2e


def test_teardown_stops_launched_and_registered_processes(start_cluster):
    c = start_cluster(instances=1)
    assert ctl_json("add", "--run-dir", str(c.run_dir))["added"] == ["i1"]  # through the manager's launcher
    assert "instance-i1" not in [p.name for p in c.state.procs]  # what `up` returned does not know it

    # An instance restarted by hand after kill -9, registered with the cluster by pid and start time.
    old = c.proc("instance-i0")
    os.kill(old.pid, signal.SIGKILL)
    wait_for(lambda: old.process() is None, 5, "the killed instance did not go")
    log = Path(old.log)
    started_before = log.read_text().count("serving on")
    new = c.spawn("instance-i0", old.argv)  # appends to the same log
    assert c.proc("instance-i0") is new and new.pid != old.pid
    wait_for(lambda: log.read_text().count("serving on") > started_before, 20, "the restarted instance did not start")
    assert new.process() is not None

    recorded = localcluster.ClusterState.load(c.run_dir).procs
    assert sorted(p.name for p in recorded) == ["instance-i0", "instance-i1", "manager", "proxy"]
    assert new.pid in [p.pid for p in recorded]
    assert all(p.process() is not None for p in recorded)

    stopped = c.stop()  # what the fixture does at teardown
    assert sorted(p.pid for p in stopped) == sorted(p.pid for p in recorded)
    for p in recorded:  # gone: no such pid, a zombie, or a pid reused by another process
        assert p.process() is None, f"{p.name} (pid {p.pid}) still runs"
    assert not (c.run_dir / localcluster.STATE_FILE).exists()
    assert c.stop() == []  # the fixture's own teardown after this: nothing left, no error


LEAKY = '''
import subprocess, pytest

def test_leaks():
    subprocess.Popen(["sleep", "60"])  # never stopped
    {after}
'''


TIDY_BUT_STOPPED = '''
import subprocess, pytest

@pytest.fixture(scope="module")
def sleeper():
    p = subprocess.Popen(["sleep", "60"])
    yield p
    p.kill()
    p.wait()

def test_stops_the_run(sleeper):
    {how}

def test_never_runs(sleeper):
    pass
'''


def _inner_run(tmp_path, source: str, *args: str) -> subprocess.CompletedProcess:
    """pytest on one test file with this conftest as a plugin (its own run marker and end-of-run check).
    No other plugin is loaded (the installed ones, schemathesis's above all, made the run's start take 20 s
    under a CPU hog and once past 60 s); the timeout only bounds a hang."""
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(source))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), *args, str(tmp_path / "test_inner.py")],
                          capture_output=True, text=True, timeout=300, cwd=os.getcwd(),
                          env={**os.environ, "LLUMNIX_TEST_LEFTOVER_GRACE_S": "0.2",
                               "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})


@pytest.mark.parametrize("how, rc", [("assert False", 1), ("raise KeyboardInterrupt", 2)], ids=["x", "interrupted"])
def test_the_check_runs_after_fixture_teardown(tmp_path, how, rc):
    # A run stopped early (-x, Ctrl-C) may leave fixtures to be torn down in pytest's session finish: the
    # check must come after that, or the module's processes would count as left behind.
    res = _inner_run(tmp_path, TIDY_BUT_STOPPED.format(how=how), "-x")
    out = res.stdout + res.stderr
    assert res.returncode == rc, out
    assert "left behind" not in out and "INTERNALERROR" not in out, out


@pytest.mark.parametrize("after, rc", [("pass", 1), ("raise KeyboardInterrupt", 2)], ids=["passing", "interrupted"])
def test_a_process_left_running_fails_the_run_and_is_killed(tmp_path, after, rc):
    res = _inner_run(tmp_path, LEAKY.format(after=after), "-x")
    out = res.stdout + res.stderr
    assert res.returncode == rc, out
    assert "processes left behind" in out and "sleep 60" in out, out
    assert "INTERNALERROR" not in out and "Traceback" not in out, out
    pid = int(out.split("pid ")[1].split(":")[0])
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_benchmark_sent_sigterm_stops_the_cluster_it_started(tmp_path):
    """``timeout 900 llumnixctl bench ...`` sends SIGTERM: the benchmark leaves as on Ctrl-C, and the daemons it
    started (each in a session of its own, so the signal reaches only the benchmark) are stopped, not orphaned.
    Nor is its run directory left in the temporary directory: the signal comes while the cluster starts, before
    the benchmark's own finally block (each CI run left one llumnix-bench-mig-* in /tmp)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    bench = psutil.Popen([sys.executable, "-m", "llumnixctl.main", "bench", "migration", "--backend", "sim",
                          "--lengths", "256", "--repeat", "50", "--decode-tokens", "20000"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "TMPDIR": str(scratch)})
    daemons: list[psutil.Process] = []
    try:
        def cluster_up() -> bool:
            daemons[:] = [k for k in bench.children(recursive=True) if "daemons." in " ".join(k.cmdline())]
            return len(daemons) == 4 or bench.poll() is not None  # manager, two instances, proxy

        wait_for(cluster_up, 60, "the benchmark's cluster did not start")
        assert bench.poll() is None, bench.stderr.read()
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) != 0
        _, alive = psutil.wait_procs(daemons, timeout=30)
        assert not alive, [(k.pid, k.cmdline()[2:3]) for k in alive]
        kept = {reservations_path().name}  # the ports handed out lately: meant to stay
        assert sorted(p.name for p in scratch.iterdir() if p.name not in kept) == []
    finally:
        for k in [bench, *daemons]:
            try:
                k.kill()
            except psutil.Error:
                pass


def test_the_run_marker_is_set():
    assert os.environ.get(RUN_MARKER)


def test_an_interrupt_between_a_daemons_start_and_its_record_stops_that_daemon_too(tmp_path, monkeypatch,
                                                                                    no_fork_server):
    """The SIGTERM (or Ctrl-C) that reaches ``llumnixctl up`` or a benchmark just after a daemon was started,
    before ``spawn`` returned its record, used to leave that daemon running (the hog-loaded CI met it with the
    proxy): ``up`` stops every daemon it started, recorded or not."""
    real = localcluster.spawn
    started: list[int] = []

    def interrupted(run_dir, name, argv):
        proc = real(run_dir, name, argv)
        started.append(proc.pid)
        if name == "proxy":
            raise KeyboardInterrupt  # the proxy runs; its record never reaches the cluster's state
        return proc

    monkeypatch.setattr(localcluster, "spawn", interrupted)
    with pytest.raises(KeyboardInterrupt):
        localcluster.up(tmp_path, 1, "sim", 0, None, [], timeout_s=60)
    assert len(started) == 3  # manager, instance, proxy
    _, alive = psutil.wait_procs([psutil.Process(p) for p in started if psutil.pid_exists(p)], timeout=30)
    assert not alive, [(k.pid, k.cmdline()[2:3]) for k in alive]
    assert not [c for c in psutil.Process().children() if c.pid in started]
