"""TCP ports for the daemons of a local cluster (llumnixctl/lab/localcluster.py) and the benchmarks: free ones,
chosen where no outgoing connection takes them first."""

from __future__ import annotations

import random
import socket
from pathlib import Path


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
    for _ in range(64) if top > 12000 else ():
        port = rng.randrange(10000, top)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port
    with socket.socket() as s:
        try:
            s.bind((host, 0))
        except OSError:
            s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def distinct_ports(host: str, ports: list[int], n: int) -> list[int]:
    """``ports`` plus free ports up to ``n`` in all, no two alike (free_port may hand out a port twice:
    nothing holds it between calls)."""
    ports = list(ports)
    while len(ports) < n:
        candidate = free_port(host)
        if candidate not in ports:
            ports.append(candidate)
    return ports
