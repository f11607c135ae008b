"""Daemon logs: text by default, one JSON object per line with log_format = "json", the syslog priority
prefix kept under journald."""

from __future__ import annotations

import datetime
import json
import logging
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from daemons import runtime

pytestmark = pytest.mark.e2e

MANAGER = [sys.executable, "-m", "daemons.manager", "--address", "tcp://127.0.0.1:0", "--metrics-port", "-1"]


class Daemon:
    """A daemon started here, its stderr read line by line on a thread; stopped by its pid."""

    def __init__(self, argv: list[str], env: dict | None = None):
        env = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.ended = False  # its stderr has been read to the end
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def until(self, needle: str, timeout: float = 60) -> list[str]:
        """Lines up to and including the first that contains ``needle``."""
        seen = []
        while True:
            line = self.lines.get(timeout=timeout)
            assert line is not None, f"exited ({self.proc.wait()}) before {needle!r}: {seen}"
            seen.append(line)
            if needle in line:
                return seen

    def stop(self) -> tuple[int, list[str]]:
        """SIGTERM by pid (SIGKILL after 15 s); the exit status and the lines it wrote meanwhile."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        rest = []
        while not self.ended and (line := self.lines.get(timeout=10)) is not None:
            rest.append(line)
        self.ended = True
        return self.proc.returncode, rest


@pytest.fixture
def daemons():
    started: list[Daemon] = []

    def start(argv: list[str], env: dict | None = None) -> Daemon:
        started.append(Daemon(argv, env))
        return started[-1]

    yield start
    for d in started:
        d.stop()


def check_entry(line: str, daemon: str) -> dict:
    entry = json.loads(line)
    assert {"ts", "level", "daemon", "logger", "msg"} <= set(entry), entry
    assert entry["daemon"] == daemon and entry["level"] in ("debug", "info", "warning", "error", "critical")
    ts = datetime.datetime.fromisoformat(entry["ts"].replace("Z", "+00:00"))
    assert entry["ts"].endswith("Z") and ts.utcoffset() == datetime.timedelta(0)
    assert abs((datetime.datetime.now(datetime.timezone.utc) - ts).total_seconds()) < 600
    return entry


def test_manager_logs_json_lines(daemons):
    d = daemons(MANAGER + ["--set", "manager.log_format=json"], env={"JOURNAL_STREAM": None})
    first = [check_entry(line, "llumnix-manager") for line in d.until("serving on")]
    assert first[-1]["logger"] == "llumnix.manager" and first[-1]["level"] == "info"
    assert re.search(r"serving on tcp://127\.0\.0\.1:\d+", first[-1]["msg"])
    _code, rest = d.stop()  # its SIGTERM handler is in place before that line (not checked: runtime.first_failure
    # can take SIGTERM for a failed task, exit 1)
    entries = [check_entry(line, "llumnix-manager") for line in rest]
    assert entries and entries[-1]["msg"] == "stopping"


def test_json_lines_keep_the_syslog_priority_under_journald(daemons):
    d = daemons(MANAGER + ["--set", "manager.log_format=json"], env={"JOURNAL_STREAM": "8:1234"})
    lines = d.until("serving on")
    for line in lines:
        m = re.fullmatch(r"<(\d)>(\{.*\})", line)
        assert m, line
        entry = check_entry(m.group(2), "llumnix-manager")
        assert int(m.group(1)) == {"info": 6, "warning": 4, "error": 3}[entry["level"]]


def test_text_is_the_default_and_the_format_is_per_daemon(daemons):
    # instance.log_format does not change the manager's lines
    d = daemons(MANAGER + ["--set", "instance.log_format=json"], env={"JOURNAL_STREAM": None})
    line = d.until("serving on")[-1]
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO llumnix-manager: serving on tcp://", line), line


def test_bad_log_format_is_one_line_and_exit_2():
    res = subprocess.run(MANAGER + ["--set", "manager.log_format=xml"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "manager.log_format must be one of text, json" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_startup_error_is_a_json_line(daemons):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        d = daemons([sys.executable, "-m", "daemons.manager", "--address", f"tcp://127.0.0.1:{port}",
                     "--metrics-port", "-1", "--set", "manager.log_format=json"], env={"JOURNAL_STREAM": None})
        d.proc.wait(60)  # it exits by itself
        code, lines = d.stop()
    assert code == 1
    entries = [check_entry(line, "llumnix-manager") for line in lines]
    assert entries[-1]["level"] == "error" and "cannot start" in entries[-1]["msg"] and str(port) in entries[-1]["msg"]


def test_formatter_carries_extra_fields_and_exceptions_on_one_line():
    fmt = runtime._JsonFormatter("llumnix-instance", journal=False)
    log = logging.getLogger("llumnix.test")
    record = log.makeRecord(log.name, logging.WARNING, __file__, 1, "request %s moved", ("r1",), None,
                            extra={"request_id": "r1", "blocks": 3, "path": Path("/x"), "ts": "clash"})
    entry = json.loads(fmt.format(record))
    assert entry["msg"] == "request r1 moved" and entry["level"] == "warning" and entry["logger"] == "llumnix.test"
    assert entry["request_id"] == "r1" and entry["blocks"] == 3 and entry["path"] == "/x"
    assert entry["extra_ts"] == "clash" and entry["ts"].endswith("Z")  # an extra never hides a core field
    try:
        1 / 0
    except ZeroDivisionError:
        record = log.makeRecord(log.name, logging.ERROR, __file__, 1, "failed\non two lines", (), sys.exc_info())
    line = fmt.format(record)
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["msg"] == "failed\non two lines" and "ZeroDivisionError" in entry["exc"]
    assert runtime._JsonFormatter("llumnix-proxy", journal=True).format(record).startswith("<3>{")


def test_every_daemon_of_a_cluster_logs_json(start_cluster):
    import httpx

    sets = ["manager.log_format=json", "instance.log_format=json", "proxy.log_format=json"]
    c = start_cluster(instances=1, sets=sets)
    r = httpx.post(c.url + "/v1/completions", json={"model": "llumnix-sim", "prompt": "hi", "max_tokens": 3,
                                                   "ignore_eos": True}, timeout=30)
    assert r.status_code == 200
    c.stop()
    names = {"manager": "llumnix-manager", "instance-i0": "llumnix-instance", "proxy": "llumnix-proxy"}
    for p in c.state.procs:
        lines = Path(p.log).read_text().splitlines()
        assert lines, p.name
        loggers = {check_entry(line, names[p.name])["logger"] for line in lines}
        if p.name == "proxy":
            assert "uvicorn.error" in loggers  # uvicorn's own lines are JSON too
            access = [json.loads(line) for line in lines if json.loads(line)["logger"] == "llumnix.access"]
            assert access and access[-1]["completion_tokens"] == 3 and access[-1]["request_id"]  # its extra fields
