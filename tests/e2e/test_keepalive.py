"""The proxy keeps an idle HTTP connection open longer than clients keep theirs (proxy.keep_alive_s): a
server that closes an idle connection just as the client sends its next request on it fails that request
(seen as httpx.ReadError on a chat session's next turn with uvicorn's default of 5 s, httpx's own expiry)."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import pytest

pytestmark = pytest.mark.e2e

HEALTH = b"GET /health HTTP/1.1\r\nHost: proxy\r\n\r\n"


def _answer(sock: socket.socket) -> bytes:
    """One whole response (headers, then the body by its Content-Length), nothing after it."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, "the proxy closed the connection"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(length - len(body))
        assert chunk, "the proxy closed the connection mid-body"
        body += chunk
    assert len(body) == length
    return data


def test_an_idle_connection_outlives_the_clients_own_keepalive(cluster):
    u = urlsplit(cluster.url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as sock:
        sock.sendall(HEALTH)
        assert _answer(sock).startswith(b"HTTP/1.1 200")
        sock.settimeout(6.5)  # idle past httpx's 5 s: the server must not close first
        with pytest.raises(socket.timeout):
            sock.recv(1)
        sock.settimeout(10)
        sock.sendall(HEALTH)
        assert _answer(sock).startswith(b"HTTP/1.1 200")


def test_keep_alive_s_closes_an_idle_connection(start_cluster):
    c = start_cluster(1, ["proxy.keep_alive_s=0.5"])
    u = urlsplit(c.url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as sock:
        sock.sendall(HEALTH)
        assert _answer(sock).startswith(b"HTTP/1.1 200")
        assert sock.recv(1) == b""  # closed by the proxy after half a second (the 10 s timeout would raise)
