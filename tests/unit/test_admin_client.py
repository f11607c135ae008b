"""llumnixctl's admin client: why a manager did not answer, from the ZeroMQ handshake (no daemons here).

A client without keys that reaches a manager with CURVE keys must say so, not "did not answer". It learns it
from the handshake's events: usually the manager names the CURVE mechanism in its greeting (PROTOCOL), but
on a loaded host the manager may close the connection before the client reads that greeting (NO_DETAIL), on
every reconnect. Both must give the CURVE hint.
"""

from __future__ import annotations

import socket
import threading

import pytest
import zmq

from llumnixctl.admin import AdminClient, ManagerUnreachable

# What a ZMTP 3 peer sends first: the signature and the major version; then this peer hangs up.
SIGNATURE_THEN_CLOSE = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03"


@pytest.fixture
def closes_mid_handshake():
    """A TCP server on 127.0.0.1 that starts a ZMTP greeting and closes the connection, every time."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                conn.sendall(SIGNATURE_THEN_CLOSE)
                try:
                    conn.recv(64)
                except OSError:
                    pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield f"tcp://127.0.0.1:{srv.getsockname()[1]}"
    finally:
        stop.set()
        srv.close()
        t.join(5)


def test_a_connection_closed_in_the_handshake_gives_the_curve_hint(closes_mid_handshake):
    client = AdminClient(closes_mid_handshake, timeout_s=1.0)
    with pytest.raises(ManagerUnreachable) as exc:
        client.status()
    client.close()
    message = str(exc.value)
    assert exc.value.refused
    assert "closed our connection during the handshake" in message and "uses CURVE keys" in message, message
    assert "security.keys_dir" in message and closes_mid_handshake in message


def test_a_curve_server_refusing_the_mechanism_gives_the_curve_hint():
    ctx = zmq.Context()
    public, secret = zmq.curve_keypair()
    server = ctx.socket(zmq.ROUTER)
    server.linger = 0
    server.curve_secretkey, server.curve_publickey, server.curve_server = secret, public, True
    address = f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        client = AdminClient(address, timeout_s=1.0)
        with pytest.raises(ManagerUnreachable) as exc:
            client.status()
        client.close()
        assert exc.value.refused and "uses CURVE keys" in str(exc.value), str(exc.value)
    finally:
        server.close(0)
        ctx.term()


def test_nobody_listening_is_no_answer_not_a_refusal():
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = AdminClient(f"tcp://127.0.0.1:{port}", timeout_s=0.3)
    with pytest.raises(ManagerUnreachable) as exc:
        client.status()
    client.close()
    assert not exc.value.refused and "did not answer within 0.3s" in str(exc.value)
