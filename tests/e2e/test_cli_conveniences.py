"""What operators expect of the commands: --version, shell completion, status --watch, describe,
$LLUMNIX_MANAGER and /etc/llumnix/llumnix.toml as defaults, the daemons' man pages in section 8."""

from __future__ import annotations

import importlib.metadata
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from daemons import config as config_module
from daemons.config import ConfigError, load_config
from llumnixctl import common
from tests.conftest import ctl, ctl_json
from tests.streams import Stream

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
VERSION = importlib.metadata.version("llumnix-toolkit")
DAEMONS = ("llumnix-manager", "llumnix-instance", "llumnix-proxy")


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class Lines:
    """A child's stdout (or ``stream``) read line by line on a thread, so a test can wait for lines with a
    deadline."""

    def __init__(self, proc: subprocess.Popen, stream=None):
        self.proc = proc
        self.stream = stream if stream is not None else proc.stdout
        self.lines: queue.Queue[str] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.stream:
            self.lines.put(line)

    def next(self, timeout: float = 30) -> str:
        return self.lines.get(timeout=timeout)

    def rest(self, timeout: float = 30) -> str:
        """Every line not taken yet, up to the end of the stream (the child has exited)."""
        self.reader.join(timeout)
        return "".join(self.lines.queue)


def _interruptible() -> None:
    """(In the child) Ctrl-C as at a terminal: a suite that a non-interactive shell started in the background
    inherits SIGINT ignored, and a Python started so never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def ctl_popen(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "llumnixctl.main", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
                            preexec_fn=_interruptible)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> int:
    """Stop a child by its pid (SIGKILL if it does not go within 30 s: this VM can stall for seconds); its exit
    status."""
    if proc.poll() is None:
        os.kill(proc.pid, sig)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return proc.returncode


# ------------------------------------------------------------------ --version


@pytest.mark.parametrize("prog", ("llumnixctl", *DAEMONS))
def test_version_prints_the_package_version_and_exits_0(prog):
    res = subprocess.run([str(BIN / prog), "--version"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"{prog} {VERSION}\n"
    help_ = subprocess.run([str(BIN / prog), "--help"], capture_output=True, text=True, timeout=60)
    assert help_.returncode == 0 and "--version" in help_.stdout


def test_version_of_llumnixctl_run_as_a_module():
    res = ctl("--version")
    assert res.returncode == 0 and res.stdout == f"llumnixctl {VERSION}\n"


def test_daemon_flags_still_work_beside_version():
    res = subprocess.run([str(BIN / "llumnix-manager"), "--set", "manager.nope=1"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and "unknown key manager.nope" in res.stderr


# ------------------------------------------------------------------ shell completion


def test_shell_completion_is_offered_and_completes_commands():
    res = ctl("--help")
    assert "--install-completion" in res.stdout and "--show-completion" in res.stdout
    # what the installed bash completion function runs
    env = {"_LLUMNIXCTL_COMPLETE": "complete_bash", "COMP_WORDS": "llumnixctl desc", "COMP_CWORD": "1"}
    res = subprocess.run([str(BIN / "llumnixctl")], capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    assert res.returncode == 0 and res.stdout.split() == ["describe"], res
    env = {"_LLUMNIXCTL_COMPLETE": "complete_bash", "COMP_WORDS": "llumnixctl status --wa", "COMP_CWORD": "2"}
    res = subprocess.run([str(BIN / "llumnixctl")], capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    assert res.stdout.split() == ["--watch"], res


# ------------------------------------------------------------------ status --watch


def test_status_watch_json_prints_one_object_per_interval(cluster):
    once = ctl_json("status", "--run-dir", str(cluster.run_dir))
    proc = ctl_popen("status", "--watch", "--json", "--interval", "0.2", "--run-dir", str(cluster.run_dir))
    try:
        lines = Lines(proc)
        first, second = json.loads(lines.next()), json.loads(lines.next())
        assert set(first) == set(once) and set(first["totals"]) == set(once["totals"])
        assert [i["id"] for i in first["instances"]] == ["i0", "i1"]
        assert second["manager"]["uptime_s"] > first["manager"]["uptime_s"]
        assert proc.poll() is None  # bounded by nothing but Ctrl-C
    finally:
        code = stop(proc, signal.SIGINT)
    assert code == 0, proc.stderr.read()


def test_status_watch_live_view_refreshes_until_ctrl_c(cluster):
    # FORCE_COLOR makes rich treat the pipe as a terminal: the rich.live view, redrawn in place
    proc = ctl_popen("status", "--watch", "--interval", "0.2", "--run-dir", str(cluster.run_dir),
                     env={"FORCE_COLOR": "1", "COLUMNS": "200"})
    try:
        out = ""
        deadline = time.monotonic() + 60
        while out.count("FREENESS") < 3 and time.monotonic() < deadline:
            out += os.read(proc.stdout.fileno(), 65536).decode(errors="replace")
        assert out.count("FREENESS") >= 3 and "i1" in out and "Ctrl-C to stop" in out
    finally:
        code = stop(proc, signal.SIGINT)
    err = proc.stderr.read()
    assert code == 0 and "Traceback" not in err, err


def test_status_watch_goes_on_while_the_manager_does_not_answer(start_cluster):
    c = start_cluster(instances=1)
    proc = ctl_popen("status", "--watch", "--json", "--interval", "0.2", "--timeout", "0.3", "--run-dir", str(c.run_dir))
    manager = c.proc("manager").process()
    lines, errors = Lines(proc), Lines(proc, proc.stderr)
    said: list[str] = []
    try:
        before = json.loads(lines.next(timeout=60))["manager"]["uptime_s"]
        manager.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            # the watch says twice that the manager does not answer, and goes on
            while sum("did not answer" in x for x in said) < 2:
                said.append(errors.next(timeout=30))
        finally:
            manager.send_signal(signal.SIGCONT)
        stopped_for = time.monotonic() - stopped
        # Fresh lines again: answered after SIGCONT, so the manager's uptime has grown by the whole stop.
        deadline = time.monotonic() + 30
        while json.loads(lines.next(timeout=30))["manager"]["uptime_s"] < before + stopped_for:
            assert time.monotonic() < deadline
        assert proc.poll() is None
    finally:
        code = stop(proc, signal.SIGINT)
    err = "".join(said) + errors.rest()
    assert code == 0
    assert "did not answer" in err and "Traceback" not in err, err


# ------------------------------------------------------------------ describe


def test_describe_one_instance(cluster):
    from typer.testing import CliRunner

    from llumnixctl.main import app

    runner = CliRunner()  # in-process: the request (seconds of decoding) outlasts the calls on a loaded machine

    def describe(*args):
        res = runner.invoke(app, ["describe", *args, "--run-dir", str(cluster.run_dir)])
        assert res.exit_code == 0, res.output
        return res

    sent_at = time.monotonic()
    s = Stream(cluster.url, max_tokens=4000, ignore_eos=True)  # seconds of decoding at the tests' sim speed
    try:
        assert s.started.wait(30) and s.error is None, s.error
        rid = s.rid
        found, described = {}, {}
        for iid in ("i0", "i1"):
            d = json.loads(describe(iid, "--json").stdout)
            described[iid] = (d, time.monotonic() - sent_at)
            assert d["instance"]["id"] == iid and d["requests_answered"] is True
            reg = d["registered"]
            assert reg["backend"] == "sim" and reg["model"] == "llumnix-sim" and reg["max_model_len"] > 0
            assert reg["pid"] == d["instance"]["pid"] and reg["request_address"].startswith("tcp://")
            assert reg["metrics_address"].startswith("127.0.0.1:")
            assert set(d["migrations"]) == {"out", "in", "committed", "aborted", "ordered"}
            # The manager heard a report since the instance started (its age is no more than the process's).
            lived_s = time.time() - psutil.Process(d["instance"]["pid"]).create_time()
            assert 0 <= d["instance"]["last_report_age_s"] <= lived_s, (d["instance"], lived_s)
            found.update({r["id"]: (iid, r) for r in d["requests"]})
        iid, row = found[rid]
        assert row["instance"] == iid and row["state"] in ("running", "waiting")
        d, since_sent = described[iid]
        # A report that shows our request (the instance's only one) is newer than the request.
        if [r["id"] for r in d["requests"]] == [rid] and d["instance"]["running"] + d["instance"]["waiting"]:
            assert d["instance"]["last_report_age_s"] <= since_sent + 0.001, (d["instance"], since_sent)
        human = describe(iid)
        for word in (f"instance {iid}", "requests at", "last report", "virtual usage", "migrations", rid):
            assert word in human.stdout, human.stdout
    finally:
        s.stop_after = 0  # the client leaves; the proxy aborts the request
        s.join(30)


def test_describe_unknown_instance_is_one_line_and_exit_1(cluster):
    res = ctl("describe", "i9", "--run-dir", str(cluster.run_dir))
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == ["llumnixctl: no instance 'i9' in the cluster (instances: i0, i1)"]


# ------------------------------------------------------------------ defaults: $LLUMNIX_MANAGER, /etc/llumnix


def test_llumnix_manager_env_unreachable_is_one_line_naming_it(tmp_path):
    address = free_address()
    for cmd in ("status", "requests", "describe i0"):
        res = ctl(*cmd.split(), "--timeout", "0.5", env={"LLUMNIX_MANAGER": address})
        assert res.returncode == 1
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and address in lines[0] and "$LLUMNIX_MANAGER" in lines[0], res.stderr


def test_llumnix_manager_env_comes_right_after_the_flag(cluster, tmp_path):
    # the flag wins over the variable
    got = ctl("status", "--json", "--manager", cluster.manager, env={"LLUMNIX_MANAGER": free_address()})
    assert got.returncode == 0, got.stderr
    # the variable wins over --run-dir (not even read) and the address in --config (read for its keys only)
    empty = tmp_path / "no-cluster-here"
    other = tmp_path / "other.toml"
    other.write_text(f'[manager]\naddress = "{free_address()}"\n')
    got = ctl("status", "--json", "--run-dir", str(empty), "--config", str(other),
              env={"LLUMNIX_MANAGER": cluster.manager})
    assert got.returncode == 0, got.stderr
    assert [i["id"] for i in json.loads(got.stdout)["instances"]] == ["i0", "i1"]


@pytest.fixture
def system_config(tmp_path, monkeypatch):
    path = tmp_path / "etc" / "llumnix.toml"
    path.parent.mkdir()
    monkeypatch.setattr(config_module, "SYSTEM_CONFIG", str(path))
    monkeypatch.delenv("LLUMNIX_CONFIG", raising=False)
    monkeypatch.delenv("LLUMNIX_MANAGER", raising=False)
    monkeypatch.delenv("LLUMNIX_RUN_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # no default local cluster
    return path


def test_etc_config_is_the_default_when_it_exists(system_config, tmp_path, monkeypatch):
    assert config_module.SYSTEM_CONFIG == str(system_config)
    assert load_config().source == "defaults"  # no such file yet: defaults
    system_config.write_text('[manager]\naddress = "tcp://10.1.2.3:7100"\n[proxy]\nport = 9001\n')
    cfg = load_config()
    assert cfg.source == str(system_config) and cfg.proxy.port == 9001
    other = tmp_path / "other.toml"
    other.write_text("[proxy]\nport = 9002\n")
    assert load_config(other).proxy.port == 9002  # --config wins
    monkeypatch.setenv("LLUMNIX_CONFIG", str(other))
    assert load_config().proxy.port == 9002  # so does $LLUMNIX_CONFIG
    monkeypatch.delenv("LLUMNIX_CONFIG")
    # llumnixctl: manager.address of the file, and says where it came from
    assert common.manager_source(None, None, None) == ("tcp://10.1.2.3:7100", f"manager.address of {system_config}")
    monkeypatch.setenv("LLUMNIX_MANAGER", "tcp://10.9.9.9:7100")
    assert common.manager_source(None, None, None) == ("tcp://10.9.9.9:7100", "$LLUMNIX_MANAGER")
    assert common.manager_source("tcp://1.1.1.1:1", None, None)[0] == "tcp://1.1.1.1:1"


def test_config_that_cannot_be_read_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path}: cannot read the config file")):
        load_config(tmp_path)  # a directory


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_etc_config_is_one_line(system_config):
    system_config.write_text("[proxy]\nport = 9001\n")
    system_config.chmod(0)
    with pytest.raises(ConfigError, match=re.escape(f"{system_config}: cannot read the config file")):
        load_config()


# ------------------------------------------------------------------ man pages


def test_daemon_man_pages_are_in_section_8():
    for name in DAEMONS:
        page = ROOT / "man" / f"{name}.8"
        assert page.exists() and not (ROOT / "man" / f"{name}.1").exists()
        assert page.read_text().splitlines()[0].startswith(f".TH {name.upper()} 8 ")
    assert (ROOT / "man" / "llumnixctl.1").exists() and (ROOT / "man" / "llumnix.toml.5").exists()
    wrong = re.compile(r"llumnix(\\-|-)(manager|instance|proxy)(\\fR)? ?\(1\)")
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(docs) > 1
    for text in [p.read_text() for p in [*(ROOT / "man").iterdir(), *docs]]:
        assert not wrong.search(text)
