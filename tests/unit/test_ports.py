"""Free ports for local daemons (llumnixctl/lab/ports.py): a port handed out is not handed out again, by any
caller of this user on the machine, while its daemon may still be starting.

The callers here are threads, each opening the reservations file on its own, as separate processes do: the
file lock (flock) excludes them from each other just as it excludes processes. The range is narrowed so that
without the reservations the same port would come out many times.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from llumnixctl.lab import ports

RANGE = 2100  # ports LOW .. LOW + RANGE: 320 picks from it would repeat one about 24 times without reservations


@pytest.fixture
def narrow(tmp_path, monkeypatch):
    monkeypatch.setattr(ports, "reservations_path", lambda: tmp_path / "reserved")
    monkeypatch.setattr(ports, "ephemeral_start", lambda: ports.LOW + RANGE)
    return tmp_path / "reserved"


def test_callers_at_once_never_get_the_same_port(narrow):
    got: list[int] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def pick():
        start.wait()
        mine = [ports.free_port() for _ in range(40)]
        with lock:
            got.extend(mine)

    threads = [threading.Thread(target=pick) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(got) == 320 and len(set(got)) == 320
    assert all(ports.LOW <= p < ports.LOW + RANGE for p in got)
    assert set(json.loads(narrow.read_text())) == {str(p) for p in got}


def test_a_reservation_lapses_and_a_bad_file_is_started_again(narrow):
    now = time.time()
    everything = {str(p): now for p in range(ports.LOW, ports.LOW + RANGE)}
    del everything[str(ports.LOW + 7)]
    narrow.write_text(json.dumps(everything))
    assert ports.free_port() == ports.LOW + 7  # the only one not held
    lapsed = {str(p): now - ports.RESERVE_S - 1 for p in range(ports.LOW, ports.LOW + RANGE)}
    narrow.write_text(json.dumps(lapsed))
    port = ports.free_port()
    assert json.loads(narrow.read_text()).keys() == {str(port)}  # the lapsed ones were dropped
    narrow.write_text('{"12001": 1')  # torn
    port = ports.free_port()
    assert json.loads(narrow.read_text()).keys() == {str(port)}


def test_without_a_usable_file_ports_are_still_handed_out(tmp_path, monkeypatch):
    monkeypatch.setattr(ports, "reservations_path", lambda: tmp_path / "missing-dir" / "reserved")
    assert ports.LOW <= ports.free_port() < ports.ephemeral_start()
