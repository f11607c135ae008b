"""What every daemon shares at run time: logging, systemd notification, signals, metrics, sockets."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys

import zmq

_LEVEL_PRIORITY = {"DEBUG": 7, "INFO": 6, "WARNING": 4, "ERROR": 3, "CRITICAL": 2}


class _JournalFormatter(logging.Formatter):
    """Under systemd, prefix each line with its syslog priority (<6>) and let journald add the time."""

    def format(self, record: logging.LogRecord) -> str:
        return f"<{_LEVEL_PRIORITY.get(record.levelname, 6)}>{super().format(record)}"


def setup_logging(level: str, daemon: str) -> logging.Logger:
    """One line per event on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    if os.environ.get("JOURNAL_STREAM"):
        handler.setFormatter(_JournalFormatter(f"{daemon}: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {daemon}: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # uvicorn's own loggers would otherwise print a second format
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    logging.getLogger("uvicorn.access").setLevel("WARNING")
    return logging.getLogger(f"llumnix.{daemon}")


def sd_notify(state: str) -> None:
    """Tell systemd (Type=notify) about READY=1 / STOPPING=1; a no-op outside systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            s.sendall(state.encode())
    except OSError as exc:
        logging.getLogger("llumnix").warning("sd_notify(%s) failed: %s", state, exc)


def install_stop_signals(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


def start_metrics_server(port: int) -> str:
    """Serve Prometheus /metrics on 127.0.0.1:port (0 = any free port); returns 'host:port' or '' when off."""
    if port < 0:
        return ""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr="127.0.0.1")
    return f"127.0.0.1:{server.server_address[1]}"


def bind(sock: zmq.Socket, address: str) -> str:
    """Bind, resolving port 0 to a free port; returns the address actually bound."""
    if address.startswith("tcp://") and address.endswith(":0"):
        base = address[: -len(":0")]
        port = sock.bind_to_random_port(base)
        return f"{base}:{port}"
    sock.bind(address)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT) if address.startswith("tcp://") else address


def tune(sock: zmq.Socket) -> zmq.Socket:
    """Daemons never block on exit waiting for unsent frames to a dead peer."""
    sock.setsockopt(zmq.LINGER, 0)
    return sock
