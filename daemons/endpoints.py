"""ZeroMQ endpoints, checked where they enter a daemon: from a setting (at start, the error names the
setting and where it came from) and from a peer's message (daemons/wire.py: the frame does not decode, and
is dropped and logged like any malformed one).

ZeroMQ's ``connect`` raises on an endpoint it cannot parse (``127.0.0.1:7299`` without ``tcp://``, ``""``,
``tcp://x``), and a daemon calls it inside tasks it cannot live without: one bad address, by typo or on
purpose, must never reach it. What passes here is ``tcp://HOST:PORT`` (HOST a name, an IPv4 address or a
bracketed IPv6 one; ``*`` and port 0 only to bind), ``ipc://PATH`` or ``inproc://NAME``.
"""

from __future__ import annotations

import re

MAX_LENGTH = 255
_HOST = re.compile(r"[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.%A-Za-z]+\]")


def problem(address: str, bind: bool = False) -> str:
    """Why ``address`` is not an endpoint a daemon can bind (``bind``) or connect to; "" if it is one."""
    if not isinstance(address, str):
        return "is not a string"
    if len(address) > MAX_LENGTH:
        return f"is longer than {MAX_LENGTH} characters"
    scheme, sep, rest = address.partition("://")
    if not sep:
        return "is not a ZeroMQ endpoint (expected tcp://HOST:PORT)"
    if scheme in ("ipc", "inproc"):
        return "" if rest and not any(c.isspace() for c in rest) else f"names no {scheme} endpoint after {scheme}://"
    if scheme != "tcp":
        return f"has the transport {scheme!r} (expected tcp://HOST:PORT, ipc://PATH or inproc://NAME)"
    rest = rest.rpartition(";")[2]  # tcp://SOURCE;HOST:PORT connects from SOURCE: the peer is what follows
    host, colon, port = rest.rpartition(":")
    if not colon or not host:
        return "needs a host and a port (tcp://HOST:PORT)"
    if not port.isdigit() or not (0 if bind else 1) <= int(port) <= 65535:
        return f"has no valid port ({port!r}; 1-65535{', or 0 for any free one' if bind else ''})"
    if host == "*":
        return "" if bind else "cannot be connected to (* only binds, on every interface)"
    if not _HOST.fullmatch(host):
        return f"has no valid host ({host!r})"
    return ""


def check(address: str, what: str, bind: bool = False, empty_ok: bool = False) -> None:
    """Raise ValueError naming ``what`` unless ``address`` is an endpoint (or empty, with ``empty_ok``)."""
    if empty_ok and address == "":
        return
    why = problem(address, bind)
    if why:
        raise ValueError(f"{what} {address[:80]!r} {why}")
