"""Who may speak on the cluster's sockets, and what listens where.

Cluster sockets (the manager's, each instance's request socket, each proxy's token socket) use ZeroMQ
CURVE when ``security.keys_dir`` is set: traffic is encrypted, and a ZAP handler in every daemon admits
only the public keys in ``keys_dir/public``, each with the role its file name starts with (``instance``,
``proxy``, ``operator``, ``reader``; ``manager`` is the manager's own). Each server socket admits only the
roles that have business there, and the manager checks each message's verb against its sender's role.
Without keys, a daemon listens only on loopback unless ``security.trusted_network`` says otherwise.
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path


def host_of(address: str) -> str:
    """The host part of a ZeroMQ address (``tcp://H:P``), a ``host:port`` pair or a bare host."""
    if address.startswith(("ipc://", "inproc://")):
        return "localhost"
    rest = address.split("://", 1)[-1]
    if rest.startswith("["):  # [::1]:7100
        return rest[1:rest.find("]")]
    host, sep, port = rest.rpartition(":")
    return host if sep and (port.isdigit() or port == "*") else rest


def is_loopback(address: str) -> bool:
    """True when ``address`` (a ZeroMQ address, host:port or host) can only be reached from this machine."""
    host = host_of(address)
    if host in ("localhost", ""):
        return host == "localhost"
    if host == "*":
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:  # a host name or an interface name: loopback only if every address it resolves to is
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def read_token(path: str) -> str:
    """The bearer token in ``path`` (first line, stripped); empty path = no token. Raises ValueError."""
    if not path:
        return ""
    try:
        token = Path(path).read_text().strip().splitlines()[0].strip() if Path(path).read_text().strip() else ""
    except OSError as exc:
        raise ValueError(f"cannot read the token file {path}: {exc.strerror}") from None
    if not token:
        raise ValueError(f"the token file {path} is empty")
    return token
