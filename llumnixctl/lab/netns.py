"""Several "hosts" on one machine: network namespaces on a private bridge, for multi-host tests and benchmarks.

::

    from llumnixctl.lab.netns import Lab

    with Lab(["ctl", "i0", "i1"]) as lab:           # 198.18.0.1, .2, .3 (198.18.0.0/15: benchmarking)
        lab.address("i0")                           # "198.18.0.2"
        subprocess.Popen(lab.prefix("i0") + argv)    # a process on "host" i0 (ip netns exec NS ...)
        lab.shape("i0", rate="10gbit", delay_ms=0.5) # tc on i0's link, both directions
        lab.run_in("ctl", fn, arg)                  # fn(arg) in a thread inside ctl's namespace

Layout: a bridge namespace holding only the bridge ``br0`` and one veth end per host (``v0``, ``v1``, ...);
each host namespace holds the other end as ``eth0`` with its address, and loopback up. Nothing is added to
the namespace the caller runs in (no address, route or link): the root namespace is untouched, and the
hosts reach only each other. Names are ``llx-<pid>-<random>-<name>``, unique per run, so concurrent labs
never clash. Everything is removed on leaving the ``with`` (exceptions and KeyboardInterrupt included)
and, for a lab never closed, at interpreter exit (atexit): processes still running inside the lab's
namespaces are stopped first (SIGTERM, then SIGKILL), by the pids ``ip netns pids`` lists.

Needs root and iproute2 (``ip``, ``tc``); ``Lab.unavailable()`` says why a lab cannot be built here.
``shape`` uses tbf for the rate and netem for latency; ``Lab.can_delay()`` is False on kernels built
without sch_netem (then ``shape(delay_ms>0)`` raises LabError).
"""

from __future__ import annotations

import atexit
import ctypes
import ipaddress
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
from typing import Any, Callable

ALLOWED = ipaddress.ip_network("198.18.0.0/15")  # RFC 2544: reserved for benchmarking, never routed
CLONE_NEWNET = 0x40000000
NETNS_DIR = "/var/run/netns"
PREFIX = "llx"

_open_labs: set["Lab"] = set()


class LabError(RuntimeError):
    pass


def _ip(*args: str, check: bool = True, timeout: float = 15.0) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise LabError(f"{' '.join(args)}: {(proc.stderr or proc.stdout).strip()}")
    return proc


def parse_rate(rate: str | int | float | None) -> int:
    """Bits per second of a tc-style rate: ``"10gbit"``, ``"500mbit"``, ``"100kbit"``, ``"1e9"`` or a number
    (bit/s). None, ``""`` and 0 mean no limit (returns 0)."""
    if rate is None or rate == "" or rate == 0:
        return 0
    if isinstance(rate, (int, float)):
        return int(rate)
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*(|bit|kbit|mbit|gbit|tbit)\s*", rate.lower())
    if not m:
        raise LabError(f"rate {rate!r}: expected e.g. 10gbit, 500mbit or bits per second")
    scale = {"": 1, "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}[m.group(2)]
    return int(float(m.group(1)) * scale)


def enter_netns(path: str) -> None:
    """Move the calling thread into the network namespace at ``path`` (``/var/run/netns/NAME``): setns(2)
    through libc, since Python 3.11 has no os.setns. Only this thread moves; threads it starts afterwards
    (a new zmq.Context's I/O threads, say) are born inside."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise LabError(f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


class Lab:
    """Hosts as network namespaces on one bridge; see the module docstring. Use as a context manager.

    ``names``: the hosts, in order; host k gets the (k+1)-th address of ``subnet`` (a subnet of
    198.18.0.0/15). ``mtu``: of every link (1500 like a plain Ethernet; 9000 for a jumbo-frame cluster).
    """

    def __init__(self, names: list[str], subnet: str = "198.18.0.0/24", mtu: int = 1500):
        if not names or len(set(names)) != len(names):
            raise LabError(f"host names must be unique and not empty: {names!r}")
        for n in names:
            if not re.fullmatch(r"[A-Za-z0-9_]{1,20}", n):
                raise LabError(f"host name {n!r}: letters, digits and _ only (at most 20)")
        net = ipaddress.ip_network(subnet)
        if not (isinstance(net, ipaddress.IPv4Network) and net.subnet_of(ALLOWED)):
            raise LabError(f"subnet {subnet}: a lab uses only addresses of {ALLOWED} (reserved for benchmarking)")
        hosts = list(net.hosts())
        if len(hosts) < len(names):
            raise LabError(f"subnet {subnet} has {len(hosts)} addresses for {len(names)} hosts")
        self.names = list(names)
        self.subnet = net
        self.mtu = mtu
        self.run_id = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self.bridge_ns = f"{self.run_id}-br"
        self._addr = {n: str(hosts[i]) for i, n in enumerate(names)}
        self._veth = {n: f"v{i}" for i, n in enumerate(names)}  # the bridge's end, in the bridge namespace
        self._made: list[str] = []  # namespaces created so far, in order
        self._spawned: list[subprocess.Popen] = []  # processes started inside by spawn()
        self._lock = threading.Lock()
        self._delay: bool | None = None

    # ------------------------------------------------------------------ lifecycle

    @staticmethod
    def unavailable() -> str | None:
        """Why no lab can be built here (not root, no iproute2), or None."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                return f"iproute2's {tool} is not installed"
        return None

    def __enter__(self) -> "Lab":
        why = self.unavailable()
        if why:
            raise LabError(why)
        _open_labs.add(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _build(self) -> None:
        br = self.bridge_ns
        self._add_ns(br)
        _ip("ip", "-n", br, "link", "set", "lo", "up")
        _ip("ip", "-n", br, "link", "add", "br0", "type", "bridge")
        _ip("ip", "-n", br, "link", "set", "br0", "mtu", str(self.mtu), "up")
        for n in self.names:
            ns = self.netns(n)
            self._add_ns(ns)
            v = self._veth[n]
            # Both ends are created straight into their namespaces: nothing passes through ours.
            _ip("ip", "-n", br, "link", "add", v, "mtu", str(self.mtu), "type", "veth",
                "peer", "name", "eth0", "mtu", str(self.mtu), "netns", ns)
            _ip("ip", "-n", br, "link", "set", v, "master", "br0", "up")
            _ip("ip", "-n", ns, "link", "set", "lo", "up")
            _ip("ip", "-n", ns, "addr", "add", f"{self._addr[n]}/{self.subnet.prefixlen}", "dev", "eth0")
            _ip("ip", "-n", ns, "link", "set", "eth0", "up")

    def _add_ns(self, ns: str) -> None:
        _ip("ip", "netns", "add", ns)
        self._made.append(ns)

    def close(self) -> None:
        """Stop what still runs in the lab's namespaces, then delete them (their links go with them).
        Idempotent; bounded (a few seconds per stubborn process at most)."""
        with self._lock:
            made, self._made = self._made, []
            spawned, self._spawned = self._spawned, []
        _open_labs.discard(self)
        if not made:
            return
        # What we spawned, through its Popen (so that its exit status is kept), running inside or not yet
        # (`ip netns exec` enters the namespace only once it runs: one started just before close is not among
        # the namespace's pids yet) ...
        running = [p for p in spawned if p.poll() is None]
        for proc in running:
            proc.terminate()
        # ... and whatever else runs inside.
        ours = {p.pid for p in spawned}
        pids: list[int] = []
        for ns in made:
            out = _ip("ip", "netns", "pids", ns, check=False)
            pids += [int(p) for p in out.stdout.split() if p.isdigit() and int(p) != os.getpid() and int(p) not in ours]
        _terminate(pids)
        for proc in running:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        for ns in reversed(made):
            _ip("ip", "netns", "del", ns, check=False)

    # ------------------------------------------------------------------ where things are

    def netns(self, name: str) -> str:
        """The namespace name of host ``name`` (for ``ip netns exec``, ``ip -n``, ``tc -n``)."""
        self._known(name)
        return f"{self.run_id}-{name}"

    def address(self, name: str) -> str:
        """The IPv4 address of host ``name``."""
        self._known(name)
        return self._addr[name]

    def prefix(self, name: str) -> list[str]:
        """argv prefix that runs a command on host ``name``: ``["ip", "netns", "exec", NS]``."""
        return ["ip", "netns", "exec", self.netns(name)]

    def spawn(self, name: str, argv: list[str], **popen: Any) -> subprocess.Popen:
        """subprocess.Popen(prefix(name) + argv, **popen); stopped when the lab closes, if still running."""
        proc = subprocess.Popen(self.prefix(name) + list(argv), **popen)
        with self._lock:
            self._spawned.append(proc)
        return proc

    def describe(self) -> dict:
        """Plain data a child process can use (JSON): host -> {"netns", "address"}, and the subnet."""
        return {"subnet": str(self.subnet),
                "hosts": {n: {"netns": self.netns(n), "address": self._addr[n]} for n in self.names}}

    def _known(self, name: str) -> None:
        if name not in self._addr:
            raise LabError(f"no host {name!r} in this lab (hosts: {', '.join(self.names)})")

    # ------------------------------------------------------------------ running Python inside

    def run_in(self, name: str, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> Any:
        """``fn(*args)`` in a new thread that first entered host ``name``'s namespace: sockets it makes
        (and threads it starts) are on that host. Returns fn's result or raises its exception;
        ``timeout_s``: raises TimeoutError if fn has not returned by then (the thread is left to finish)."""
        path = os.path.join(NETNS_DIR, self.netns(name))
        box: dict[str, Any] = {}

        def body() -> None:
            try:
                enter_netns(path)
                box["value"] = fn(*args)
            except BaseException as exc:  # handed to the caller
                box["error"] = exc

        t = threading.Thread(target=body, name=f"netns-{name}", daemon=True)
        t.start()
        t.join(timeout_s)
        if t.is_alive():
            raise TimeoutError(f"{getattr(fn, '__name__', fn)!s} in {name} did not return within {timeout_s:g}s")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    # ------------------------------------------------------------------ shaping

    def can_delay(self) -> bool:
        """Whether this kernel has netem (added latency); probed once on the bridge namespace's loopback."""
        if self._delay is None:
            br = self.bridge_ns
            ok = _ip("tc", "-n", br, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms", check=False)
            self._delay = ok.returncode == 0
            if self._delay:
                _ip("tc", "-n", br, "qdisc", "del", "dev", "lo", "root", check=False)
        return self._delay

    def shape(self, name: str, rate: str | int | None = "10gbit", delay_ms: float = 0.0) -> None:
        """Limit host ``name``'s link in both directions: ``rate`` (tbf; None/0: no limit) and ``delay_ms``
        of added one-way latency each way (netem; so a round trip to an unshaped host grows by 2 x
        delay_ms, to another host shaped alike by 4 x). Egress is shaped on the host's eth0, ingress on
        the bridge's end of its veth. Replaces an earlier shape of this host."""
        bps = parse_rate(rate)
        if delay_ms < 0:
            raise LabError(f"delay_ms must be >= 0, got {delay_ms}")
        if delay_ms > 0 and not self.can_delay():
            raise LabError("this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM): latency cannot be added")
        self.unshape(name)
        for ns, dev in ((self.netns(name), "eth0"), (self.bridge_ns, self._veth[name])):
            self._shape_dev(ns, dev, bps, delay_ms)

    def unshape(self, name: str) -> None:
        """Remove what ``shape`` put on host ``name``'s link."""
        for ns, dev in ((self.netns(name), "eth0"), (self.bridge_ns, self._veth[name])):
            _ip("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)

    def _shape_dev(self, ns: str, dev: str, bps: int, delay_ms: float) -> None:
        tc = ["tc", "-n", ns, "qdisc", "add", "dev", dev]
        if bps:
            # Bucket: 2 ms at the rate, at least 64 KiB (a GSO super-packet) plus an MTU: large enough
            # that timer granularity does not lower the rate, small enough that bursts stay short.
            burst = max(bps // 8 // 500, 65536 + self.mtu)
            _ip(*tc, "root", "handle", "1:", "tbf", "rate", f"{bps}bit", "burst", str(burst), "latency", "20ms")
            if delay_ms:
                _ip(*tc, "parent", "1:1", "handle", "10:", "netem", "delay", f"{delay_ms}ms", "limit", "100000")
        elif delay_ms:
            _ip(*tc, "root", "handle", "10:", "netem", "delay", f"{delay_ms}ms", "limit", "100000")

    def throughput(self, src: str, dst: str, nbytes: int = 64 << 20, timeout_s: float = 30.0) -> float:
        """Bits per second of one TCP stream pushing ``nbytes`` from host ``src`` to host ``dst`` (what the
        link gives a single connection, shaping and this machine's CPUs included). Bounded by ``timeout_s``."""
        server = self.run_in(dst, _listen, self.address(dst), timeout_s=5)
        sink = threading.Thread(target=_sink, args=(server, timeout_s), daemon=True)
        try:
            sink.start()
            got, secs = self.run_in(src, _push, self.address(dst), server.getsockname()[1], nbytes, timeout_s,
                                    timeout_s=timeout_s + 5)
        finally:
            sink.join(timeout_s)
            server.close()
        if got != nbytes:
            raise LabError(f"throughput {src} -> {dst}: sent {nbytes} bytes, {got} arrived")
        return nbytes * 8 / secs

    def shaping(self, name: str) -> str:
        """The qdiscs on host ``name``'s link (``tc qdisc show``, both ends): for the record."""
        out = []
        for ns, dev in ((self.netns(name), "eth0"), (self.bridge_ns, self._veth[name])):
            out.append(_ip("tc", "-n", ns, "qdisc", "show", "dev", dev, check=False).stdout.strip())
        return "\n".join(out)


def _listen(host: str) -> socket.socket:
    s = socket.socket()
    s.bind((host, 0))
    s.listen(1)
    return s


def _sink(server: socket.socket, timeout_s: float) -> None:
    """Accept one connection, read it to the end, answer with the byte count."""
    server.settimeout(timeout_s)
    try:
        conn, _ = server.accept()
    except OSError:
        return
    with conn:
        conn.settimeout(timeout_s)
        got = 0
        try:
            while data := conn.recv(1 << 20):
                got += len(data)
            conn.sendall(str(got).encode())
        except OSError:
            pass


def _push(host: str, port: int, nbytes: int, timeout_s: float) -> tuple[int, float]:
    """Send ``nbytes`` to a _sink; returns (bytes it counted, seconds until it answered)."""
    with socket.create_connection((host, port), timeout=timeout_s) as c:
        chunk = memoryview(b"\0" * (1 << 20))
        t0 = time.perf_counter()
        left = nbytes
        while left > 0:
            n = min(left, len(chunk))
            c.sendall(chunk[:n])
            left -= n
        c.shutdown(socket.SHUT_WR)
        answer = c.recv(64)
        return int(answer or b"0"), time.perf_counter() - t0


def _terminate(pids: list[int], grace_s: float = 5.0) -> None:
    """SIGTERM ``pids`` (processes inside a lab's own namespaces), SIGKILL what is left after ``grace_s``."""
    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        try:  # a zombie (exited, not yet reaped by its parent) counts as gone
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
        except OSError:
            return False

    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        left = [p for p in pids if alive(p)]
        for p in left:
            try:
                os.kill(p, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait
        while left and time.monotonic() < deadline:
            for p in left:
                try:
                    os.waitpid(p, os.WNOHANG)  # our own child: reap it
                except ChildProcessError:
                    pass
            time.sleep(0.05)
            left = [p for p in left if alive(p)]
        if not left:
            return


@atexit.register
def _close_all() -> None:
    for lab in list(_open_labs):
        lab.close()
