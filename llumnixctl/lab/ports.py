"""TCP ports for the daemons of a local cluster (llumnixctl/lab/localcluster.py) and the benchmarks: free ones,
chosen where no outgoing connection takes them first, and never handed out twice at once on one machine.

A port is chosen seconds before the daemon told to listen on it binds it, and nothing holds it meanwhile: two
processes choosing at once (two test streams, a soak beside a benchmark) could both be handed the same free
port, and the slower daemon would find it in use (it happened: "cannot serve HTTP on 127.0.0.1:31813: Address
already in use", a proxy of one test stream against a daemon of the other). So every port handed out is
recorded, under an exclusive lock, in a file that every process of this user on the machine reads
(``$TMPDIR/llumnix-ports-UID``), and none is handed out again for ``RESERVE_S`` seconds.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import random
import socket
import tempfile
import time
from pathlib import Path

log = logging.getLogger("llumnix.ports")

RESERVE_S = 300.0  # a port handed out is handed out again (by any process of this user) only after this long
LOW = 10000  # the lowest port chosen


def reservations_path() -> Path:
    return Path(tempfile.gettempdir()) / f"llumnix-ports-{os.getuid()}"


@contextlib.contextmanager
def _reserved():
    """The ports handed out in the last ``RESERVE_S`` seconds ({port: when}), under an exclusive lock held
    until the block ends; what the block leaves in the dict is written back. Where the file cannot be used
    (another user's, a read-only directory), an empty dict that is not kept: ports are then chosen as before."""
    try:
        f = open(reservations_path(), "a+", encoding="utf-8")
    except OSError as exc:
        log.debug("port reservations unavailable: %s", exc)
        yield {}
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        try:
            held = {int(k): float(v) for k, v in json.loads(f.read() or "{}").items()}
        except (ValueError, TypeError, AttributeError):
            held = {}  # a torn or foreign file: start again
        now = time.time()
        held = {port: at for port, at in held.items() if now - RESERVE_S < at <= now + 1}
        yield held
        f.seek(0)
        f.truncate()
        f.write(json.dumps(held))


def ephemeral_start() -> int:
    """The first port the kernel hands out as the source port of an outgoing connection."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` (on loopback where ``host`` is not an address of this namespace).

    Chosen below the kernel's ephemeral range where it can: a port from that range (what binding port 0
    gives) can be taken, before the daemon that is told to listen on it starts, as the source port of any
    outgoing connection on the machine ("Address already in use")."""
    top = ephemeral_start()
    rng = random.Random()
    with _reserved() as held:
        unheld = [p for p in range(LOW, top) if p not in held] if top > LOW + 2000 else []
        for port in rng.sample(unheld, min(256, len(unheld))):
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    try:
                        s.bind(("127.0.0.1", port))
                    except OSError:
                        continue
            held[port] = time.time()
            return port
    with socket.socket() as s:
        try:
            s.bind((host, 0))
        except OSError:
            s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def distinct_ports(host: str, ports: list[int], n: int) -> list[int]:
    """``ports`` plus free ports up to ``n`` in all, no two alike (where the reservations file cannot be used,
    free_port may hand out a port twice)."""
    ports = list(ports)
    while len(ports) < n:
        candidate = free_port(host)
        if candidate not in ports:
            ports.append(candidate)
    return ports
