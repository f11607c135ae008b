"""What every daemon shares at run time: logging, systemd notification, signals, metrics, sockets."""

from __future__ import annotations

import asyncio
import datetime
import gc
import json
import logging
import os
import signal
import socket
import sys

import zmq
import zmq.asyncio

_LEVEL_PRIORITY = {"DEBUG": 7, "INFO": 6, "WARNING": 4, "ERROR": 3, "CRITICAL": 2}

# What every LogRecord carries; anything else on a record came from the call's ``extra``.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}
_NOT_EXTRA = {"color_message"}  # uvicorn's ANSI-coloured copy of msg

_log_format = "text"  # set by daemons.cli.load_or_exit from the daemon's [section] log_format


def set_log_format(fmt: str) -> None:
    """The format ``setup_logging`` uses when it is not given one: ``text`` or ``json``."""
    global _log_format
    _log_format = fmt


class _JournalFormatter(logging.Formatter):
    """Under systemd, prefix each line with its syslog priority (<6>) and let journald add the time."""

    def format(self, record: logging.LogRecord) -> str:
        return f"<{_LEVEL_PRIORITY.get(record.levelname, 6)}>{super().format(record)}"


class _JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (ISO-8601 UTC), level, daemon, logger, msg, the call's ``extra`` fields,
    and exc / stack when there are any; under journald the line keeps its syslog priority prefix."""

    def __init__(self, daemon: str, journal: bool):
        super().__init__()
        self.daemon = daemon
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
        entry = {"ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                 "level": record.levelname.lower(), "daemon": self.daemon, "logger": record.name,
                 "msg": record.getMessage()}
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and key not in _NOT_EXTRA and not key.startswith("_"):
                entry[key if key not in entry else f"extra_{key}"] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        line = json.dumps(entry, default=str, ensure_ascii=False)  # newlines in values are escaped: one line
        return f"<{_LEVEL_PRIORITY.get(record.levelname, 6)}>{line}" if self.journal else line


def setup_logging(level: str, daemon: str, fmt: str | None = None) -> logging.Logger:
    """One line per event on stderr: text, or with ``fmt`` (default: the daemon's log_format) json."""
    fmt = fmt or _log_format
    journal = bool(os.environ.get("JOURNAL_STREAM"))
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter(daemon, journal))
        # an uncaught exception is one more JSON line, not a bare traceback among them
        sys.excepthook = lambda kind, exc, tb: logging.getLogger("llumnix").critical(
            "uncaught exception: %s", exc, exc_info=(kind, exc, tb))
        # vLLM (imported later, in-process) would give its loggers their own text handler; let them propagate
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    elif journal:
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


def lower_priority(increment: int) -> None:
    """Lower this process's CPU priority by ``increment`` (niceness), and its session's scheduling group's where the
    kernel groups a session's tasks (autogroup: there a process's own niceness weighs only against its own
    session's). Never fails: a kernel without autogroup, or a sandbox that hides /proc, keeps what it can."""
    if increment <= 0:
        return
    try:
        nice = os.nice(increment)
    except OSError as exc:
        logging.getLogger("llumnix").warning("could not lower this process's priority: %s", exc)
        return
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass  # no autogroup (or not writable): the process's niceness alone applies


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


def run(main) -> None:
    """Run a daemon's main coroutine, on uvloop where it is installed (it halves per-message overhead)."""
    # Per-token objects are short-lived and acyclic; the default gen-0 threshold (700) makes the cyclic
    # collector run every few hundred tokens and walk everything alive. Collect far less often.
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


def install_stop_signals(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


def start_metrics_server(port: int, host: str = "127.0.0.1", token: str = "") -> str:
    """Serve Prometheus /metrics on host:port (0 = any free port); returns 'host:port' or '' when off.

    With ``token``, a scrape must send ``Authorization: Bearer TOKEN`` (else 401)."""
    if port < 0:
        return ""
    import hmac
    import threading
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from prometheus_client import make_wsgi_app

    metrics_app = make_wsgi_app()
    expected = f"Bearer {token}".encode()

    def app(environ, start_response):
        if token and not hmac.compare_digest(environ.get("HTTP_AUTHORIZATION", "").encode(), expected):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
            return [b"a bearer token is required (security.metrics_token_file)\n"]
        return metrics_app(environ, start_response)

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args) -> None:  # scrapes are not worth a log line each
            pass

    try:
        server = make_server(host, port, app, Server, handler_class=Quiet)
    except OSError as exc:
        raise StartupError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    shown = f"[{host}]" if ":" in host else host
    return f"{shown}:{server.server_address[1]}"


class StartupError(Exception):
    """A daemon cannot start (address in use, bad address); the message is one line for the log."""


def bind(sock: zmq.Socket, address: str) -> str:
    """Bind, resolving port 0 to a free port; returns the address actually bound."""
    try:
        if address.startswith("tcp://") and address.endswith(":0"):
            base = address[: -len(":0")]
            port = sock.bind_to_random_port(base)
            return f"{base}:{port}"
        sock.bind(address)
    except zmq.ZMQError as exc:
        raise StartupError(f"cannot bind {address}: {exc}") from None
    return sock.getsockopt_string(zmq.LAST_ENDPOINT) if address.startswith("tcp://") else address


def connect(sock: zmq.Socket, address: str) -> None:
    try:
        sock.connect(address)
    except zmq.ZMQError as exc:
        raise StartupError(f"cannot connect to {address!r}: {exc} (expected e.g. tcp://127.0.0.1:7100)") from None


def sender(sock: zmq.Socket) -> zmq.Socket:
    """A plain (blocking-API) view of an asyncio socket, for receives drained without awaiting.

    Never *send* through it while a coroutine awaits a receive on the asyncio socket: ZeroMQ's notification
    is edge-triggered, and a send made behind the asyncio socket's back can consume the edge of a message
    that has just arrived, so the waiting receive never wakes. ``send_now`` on the asyncio socket itself
    is safe: it checks for waiting receivers after sending.
    """
    return zmq.Socket.shadow(sock.underlying)


async def receive(sock, multipart: bool = False, limit: int = 512, copy: bool = True):
    """Yield batches of received messages: one awaited receive, then whatever is already queued.

    Awaiting each message costs a future and an event-loop round trip; under load most messages are
    already waiting, so taking them with plain non-blocking receives roughly halves the CPU per message.
    ``copy=False`` yields zmq Frames (for their properties, such as the sender's CURVE User-Id).
    """
    plain = sender(sock)
    recv_now = plain.recv_multipart if multipart else plain.recv
    while True:
        batch = [await (sock.recv_multipart(copy=copy) if multipart else sock.recv(copy=copy))]
        while len(batch) < limit:
            try:
                batch.append(recv_now(zmq.NOBLOCK, copy=copy))
            except zmq.Again:
                break
        yield batch


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait until ``event`` is set or ``timeout`` passes; True if it is set.

    Not ``asyncio.wait_for(event.wait(), timeout)``: before Python 3.12 that returns normally when the
    event is set in the same loop iteration as the task is cancelled, swallowing the cancellation, and a
    loop built on it never stops (a daemon that hangs on SIGTERM).
    """
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        done, _ = await asyncio.wait({waiter}, timeout=timeout)
    finally:
        waiter.cancel()
    return bool(done)


async def first_failure(stop: asyncio.Event, tasks: list[asyncio.Task]) -> BaseException | None:
    """Wait until ``stop`` is set (None) or one of a daemon's essential ``tasks`` ends, which is a failure
    (its exception, or a RuntimeError if it returned): a daemon must not stay up deaf."""
    stopped = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if stop.is_set():  # tasks that watch ``stop`` may end in the same moment: that is a stop, not a failure
        return None
    for task in done:
        if task is stopped:
            continue
        if task.cancelled():
            return RuntimeError(f"task {task.get_name()} was cancelled")
        return task.exception() or RuntimeError(f"task {task.get_name()} ended")
    return None


def send_now(sock: zmq.Socket, frame: bytes | list[bytes]) -> bool:
    """Send without waiting; False when the peer's queue is full (or, with IMMEDIATE, absent).

    Takes a plain socket (send-only ones) or an asyncio socket (one that also receives): the asyncio
    socket tries the send at once and, if a receive is waiting, re-checks for input (see ``sender``).
    """
    multipart = isinstance(frame, list)
    if isinstance(sock, zmq.asyncio.Socket):
        fut = sock.send_multipart(frame, zmq.NOBLOCK) if multipart else sock.send(frame, zmq.NOBLOCK)
        if fut.done():
            return fut.exception() is None  # retrieving it also keeps asyncio from logging it
        return True
    try:
        if multipart:
            sock.send_multipart(frame, zmq.NOBLOCK)
        else:
            sock.send(frame, zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False


def exit_on_startup_error(prog: str, main) -> None:
    """Run a daemon (a coroutine, or a function that makes one); a StartupError becomes one log line and
    exit status 1."""
    try:
        run(main if asyncio.iscoroutine(main) else main())
    except StartupError as exc:
        logging.getLogger("llumnix").error("cannot start: %s", exc)  # the formatter names the daemon
        sys.exit(1)


def tune(sock: zmq.Socket) -> zmq.Socket:
    """Daemons never block on exit waiting for unsent frames to a dead peer."""
    sock.setsockopt(zmq.LINGER, 0)
    return sock
