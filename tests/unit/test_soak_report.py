"""The soak's report (scripts/soak.py): every aborted migration read back from the instances' logs, as the
instance writes them, with what explains it; the witnesses' growth measured after the warm-up only."""

from __future__ import annotations

import importlib.util
import logging
import time
from pathlib import Path

import pytest

from daemons import runtime
from daemons.migration.move import OUTCOME_LOG

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak_report_script", ROOT / "scripts" / "soak_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def instance_log(lines: list[tuple]) -> str:
    """What an instance's stderr holds after these migration outcomes: the records formatted by the formatter
    the daemon's own log set-up installs (text format), without touching any logger another test may have set."""
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    try:
        runtime.setup_logging("info", "llumnix-instance", "text")
        formatter = root.handlers[0].formatter
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
    out = []
    for rid, dst, ended, reason in lines:
        for msg, args in ((OUTCOME_LOG, (rid, dst, ended, f" ({reason})" if reason else "", 2, 10, 0.5, 0.0, 12.5)),
                          ("some other line about %s", (rid,))):
            record = logging.LogRecord("llumnix.migration.move", logging.INFO, __file__, 0, msg, args, None)
            out.append(formatter.format(record))
    return "\n".join(out) + "\n"


def test_every_aborted_migration_is_listed_with_what_explains_it(soak, tmp_path, monkeypatch):
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)  # the text format, as a local cluster's logs have it
    (tmp_path / "instance-i0.log").write_text(instance_log([
        ("cmpl-aa01", "i1", "committed", ""),
        ("cmpl-aa02", "i1", "aborted-src", "the request finished or was preempted on the source during pre-copy"),
        ("cmpl-aa03", "i2", "aborted-dst", "destination refused: no room for 40 blocks (it has 3 free)"),
        ("cmpl-aa04", "i3", "aborted-dst", "destination i3 was declared dead"),
    ]))
    (tmp_path / "instance-i1.log").write_text(instance_log([
        ("cmpl-bb01", "i2", "aborted-dst", "destination i2 did not answer stage 3 (wait (2) for it)"),
    ]))
    (tmp_path / "manager.log").write_text(instance_log([("cmpl-cc01", "i9", "aborted-dst", "x")]))  # not an instance
    kills = [(time.time() - 5, "i3"), (time.time() - 3600, "i2")]  # i2 died an hour ago: it explains nothing now
    report = soak.aborted_migrations(tmp_path, kills)
    assert report["count"] == 4
    by = {r["request"]: r for r in report["all"]}
    assert set(by) == {"cmpl-aa02", "cmpl-aa03", "cmpl-aa04", "cmpl-bb01"}
    assert by["cmpl-aa02"]["explained_by"] == "request_ended"
    assert by["cmpl-aa03"]["explained_by"] == "destination_refused"
    assert by["cmpl-aa04"]["explained_by"] == "destination_killed"
    assert by["cmpl-bb01"] == {**by["cmpl-bb01"], "source": "i1", "destination": "i2", "ended": "aborted-dst",
                               "reason": "destination i2 did not answer stage 3 (wait (2) for it)",
                               "explained_by": "unexplained"}
    assert report["unexplained"] == 1
    assert report["by_explanation"]["request_ended"] == {
        "the request finished or was preempted on the source during pre-copy": 1}


def test_a_witness_restarted_during_the_warm_up_is_measured_after_it(soak):
    rows = []
    for t in range(0, 1200, 15):
        pid = 1 if t < 300 else 2  # the manager, restarted during the warm-up only
        rows.append({"t": float(t), "name": "manager", "pid": pid, "rss_mb": 40.0 + (t >= 900) * 5.0,
                     "fds": 30, "sockets": 5})
        rows.append({"t": float(t), "name": "proxy", "pid": 7 if t < 700 else 8, "rss_mb": 60.0, "fds": 40,
                     "sockets": 9})
    grown = soak.growth(rows, warmup_s=600)
    assert grown["manager"]["pid"] == 2
    assert grown["manager"]["rss_mb"]["growth"] == pytest.approx(45 / 40 - 1, abs=1e-3)
    assert "rss_mb" not in grown["proxy"] and grown["proxy"]["pids"] == [7, 8]  # restarted after it: no witness
