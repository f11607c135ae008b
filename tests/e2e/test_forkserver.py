"""The fork server that starts the suite's daemons (llumnixctl/lab/forkserver.py): a forked daemon runs as
``python -m`` would run it, and a bad request is refused without harm to the server."""

import json
import os
import socket
import struct
import sys
from pathlib import Path

import psutil
import pytest

from llumnixctl.lab import forkserver, localcluster
from tests.streams import wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture
def server(_fork_server):
    if _fork_server is None:
        pytest.skip("the session runs without the fork server (LLUMNIX_TEST_FORKSERVER=0)")
    return _fork_server


def _stop(pid: int) -> None:
    live = psutil.Process(pid)
    live.terminate()
    wait_for(lambda: localcluster.gone(live), 20, "the forked daemon exits on SIGTERM")


def test_a_forked_daemon_runs_as_python_m_would(server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = localcluster.daemon_argv("manager") + ["--set", "manager.address=tcp://127.0.0.1:0",
                                                  "--set", "manager.metrics_port=0"]
    proc = localcluster.spawn(tmp_path, "manager", argv)
    log = Path(proc.log)
    try:
        wait_for(lambda: "serving on" in log.read_text(), 30, "the forked manager serves")
        live = psutil.Process(proc.pid)
        assert live.ppid() != os.getpid()  # the server forked it, not a new interpreter of ours
        assert os.getsid(proc.pid) == proc.pid  # a session of its own, as localcluster's Popen gives
        assert live.cwd() == str(tmp_path)
        assert os.readlink(f"/proc/{proc.pid}/fd/1") == os.readlink(f"/proc/{proc.pid}/fd/2") == str(log)
        assert "found in sys.modules" not in log.read_text()  # runpy ran the module afresh, no warning
    finally:
        _stop(proc.pid)
    assert "stopping" in log.read_text()


def test_the_callers_environment_reaches_the_daemon(server, tmp_path, monkeypatch):
    assert forkserver.server() == server
    p = tmp_path / "bad.toml"
    p.write_text("[proxy]\nprot = 1\n")
    monkeypatch.setenv("LLUMNIX_CONFIG", str(p))  # read when the daemon starts, from the caller's environment
    proc = localcluster.spawn(tmp_path, "proxy", localcluster.daemon_argv("proxy"))
    live = psutil.Process(proc.pid)
    wait_for(lambda: localcluster.gone(live), 30, "the proxy refuses the bad config and exits")
    text = Path(proc.log).read_text()
    assert "unknown key proxy.prot" in text and str(p) in text, text


def _ask(path: str, request: bytes, fds: list[int]) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        socket.send_fds(s, [struct.pack("!I", len(request)) + request], fds)
        return json.loads(forkserver._read_frame(s))


def test_a_bad_request_is_refused_and_the_server_goes_on(server, tmp_path):
    with open(os.devnull, "rb") as null:
        fds = [null.fileno()] * 3
        not_a_daemon = json.dumps({"module": "os", "args": [], "env": {}, "cwd": "/"}).encode()
        assert "not a daemon" in _ask(server, not_a_daemon, fds)["error"]
        assert "error" in _ask(server, b"{not json", fds)
        assert "error" in _ask(server, json.dumps({"module": "daemons.manager"}).encode(), fds)
    with pytest.raises(forkserver.ForkServerError):
        forkserver.fork(str(tmp_path / "nobody.sock"), "daemons.manager", [], 0, 1, 2, timeout_s=2)
    # Still serving: a real request after the bad ones gets a daemon.
    proc = localcluster.spawn(tmp_path, "manager", localcluster.daemon_argv("manager") + ["--help"])
    live = psutil.Process(proc.pid)
    wait_for(lambda: localcluster.gone(live), 30, "manager --help exits")
    assert "llumnix-manager" in Path(proc.log).read_text()


def test_argv_it_does_not_serve_starts_with_popen(server, tmp_path):
    assert forkserver.served_module([sys.executable, "-m", "daemons.instance", "--help"]) == (
        "daemons.instance", ["--help"])
    assert forkserver.served_module(["ip", "netns", "exec", "ns", sys.executable, "-m", "daemons.instance"]) is None
    assert forkserver.served_module(["/other/python", "-m", "daemons.instance"]) is None
    proc = localcluster.spawn(tmp_path, "shell", ["/bin/sh", "-c", "echo popen-$$; exec sleep 60"])
    try:
        wait_for(lambda: "popen-" in Path(proc.log).read_text(), 30, "the shell ran")
        assert Path(proc.log).read_text().strip() == f"popen-{proc.pid}"
        assert psutil.Process(proc.pid).ppid() == os.getpid()  # ours: Popen, not the server
    finally:
        _stop(proc.pid)


def test_a_thread_in_another_network_namespace_gets_popen(server, tmp_path):
    """The server's child would be in the server's namespace, not where the calling thread moved (a lab's
    "host", llumnixctl/lab/netns.py): such a spawn is a Popen, and the daemon binds its host's address."""
    from llumnixctl.lab.netns import Lab

    if Lab.unavailable():
        pytest.skip(Lab.unavailable())
    with Lab(["fs"], subnet="198.18.9.0/24") as lab:
        argv = localcluster.daemon_argv("manager") + ["--set", f"manager.address=tcp://{lab.address('fs')}:0",
                                                      "--set", "manager.metrics_port=-1", "--set", "security.trusted_network=true"]
        proc = lab.run_in("fs", localcluster.spawn, tmp_path, "manager", argv, timeout_s=60)
        try:
            wait_for(lambda: "serving on" in Path(proc.log).read_text(), 30, "the manager binds its host's address")
            assert psutil.Process(proc.pid).ppid() == os.getpid()
        finally:
            _stop(proc.pid)
