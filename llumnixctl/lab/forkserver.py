"""A fork server for local daemons: one interpreter that has already imported torch and the daemons' modules
forks each daemon a local cluster starts, instead of a fresh ``python -m daemons.<name>`` that imports them
again (2 CPU-seconds per sim instance, nearly all of it torch; a test run starts a hundred and more).

Opt-in, per process: after ``use(path)``, ``localcluster.spawn`` in this process has the server at ``path`` fork
an argv of the form ``[sys.executable, "-m", <a daemon module>, ...]`` when the calling thread is in the server's
namespaces (a test that moved into a lab's network namespace gets Popen). Anything else, an argv prefix such as
``ip netns exec`` included, starts with Popen as before; so do the processes this one starts (``llumnixctl``
commands, a manager's instance launcher): the setting is not inherited. The test suite uses one per pytest process
(tests/conftest.py).

What a forked daemon gets is what ``python -m`` would give it: its own session, stdin/stdout/stderr from the
caller's descriptors (sent over the socket, SCM_RIGHTS), the caller's environment and working directory,
``sys.argv``, a fresh ``random`` seed, default signal handlers, and a normal interpreter exit (threads joined,
atexit handlers run). What differs: it is the server's child, not the caller's (the server reaps it: its exit
status is not the caller's to read, and ``localcluster.stop_strays`` does not see it; a test that needs either
turns the server off), and its ``/proc/<pid>/cmdline`` is the server's (its name, ``comm``, is
``llumnix-instance``, ``-manager`` or ``-proxy``). The caller gets its pid; stop it by pid as any other.

An instance of the vLLM backend (``instance.backend=vllm`` among its arguments) is forked from a server that has
imported vLLM as the engine does (``vllm_internals.preload``, once, on the first such request): 7 CPU-seconds
that each vLLM instance does not spend.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import signal
import socket
import struct
import sys
from pathlib import Path

# What the daemons import (their ``-m`` modules themselves are left out: a module found in sys.modules before
# ``runpy`` executes it draws a warning, and a package's __main__ runs its daemon on import).
PRELOAD = ("torch", "daemons.instance.daemon", "daemons.manager.daemon", "daemons.proxy.app")
SERVED = ("daemons.instance", "daemons.manager", "daemons.proxy.app")
_MAX_FRAME = 1 << 20
# A first vLLM instance's request waits for the server's import of vLLM: 7 CPU-seconds, minutes on a loaded host.
WARM_TIMEOUT_S = 300.0


class ForkServerError(Exception):
    pass


# ==================================================================== the caller's side

_server: str | None = None
_NAMESPACES = ("net", "mnt", "pid", "uts", "ipc", "user")


def use(path: str | None) -> str | None:
    """This process's spawns go through the server at ``path`` from now on (None: none do); the previous path."""
    global _server
    previous, _server = _server, path
    return previous


def server() -> str | None:
    return _server


def served_module(argv: list[str]) -> tuple[str, list[str]] | None:
    """(module, its arguments) when ``argv`` runs a daemon module with this interpreter, else None."""
    if len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" and argv[2] in SERVED:
        return argv[2], list(argv[3:])
    return None


def fork(path: str, module: str, args: list[str], stdin: int, stdout: int, stderr: int,
         timeout_s: float = 30.0) -> int | None:
    """Have the server at ``path`` run ``python -m module *args`` with these descriptors, this process's
    environment and working directory; returns the daemon's pid, or None when the calling thread is not in
    the server's namespaces (its child would not be where the caller is). ForkServerError when it cannot.
    The first vLLM instance waits while the server imports vLLM: its ``timeout_s`` is longer."""
    warm = warm_for(module, args)
    if warm:
        timeout_s = max(timeout_s, WARM_TIMEOUT_S)
    request = json.dumps({"module": module, "args": args, "env": dict(os.environ), "cwd": os.getcwd(),
                          "warm": warm}).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(path)
            server_pid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          struct.calcsize("3i")))[0]
            if not _same_namespaces(server_pid):
                return None
            socket.send_fds(s, [struct.pack("!I", len(request)) + request], [stdin, stdout, stderr])
            reply = json.loads(_read_frame(s))
    except (OSError, ValueError) as exc:
        raise ForkServerError(f"fork server at {path}: {exc}") from None
    if "pid" not in reply:
        raise ForkServerError(f"fork server at {path}: {reply.get('error', reply)}")
    return int(reply["pid"])


def warm_for(module: str, args: list[str]) -> str | None:
    """What the server should have imported before it forks this daemon: "vllm" for an instance whose arguments
    set the vLLM backend (as local clusters start them), else None. A hint: an instance whose backend comes from
    a file imports vLLM itself, as after Popen."""
    return "vllm" if module == "daemons.instance" and "instance.backend=vllm" in args else None


def _same_namespaces(pid: int) -> bool:
    """Whether the calling thread (a lab moves single threads: llumnixctl/lab/netns.py) shares ``pid``'s namespaces."""
    try:
        return all(os.readlink(f"/proc/thread-self/ns/{ns}") == os.readlink(f"/proc/{pid}/ns/{ns}")
                   for ns in _NAMESPACES)
    except OSError:
        return False


def _read_frame(s: socket.socket) -> bytes:
    head = _read_exact(s, 4)
    (n,) = struct.unpack("!I", head)
    if n > _MAX_FRAME:
        raise ValueError(f"a frame of {n} bytes")
    return _read_exact(s, n)


def _read_exact(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ValueError("the connection closed mid-frame")
        data += chunk
    return data


# ==================================================================== the server


def serve(path: str) -> None:
    """Import what the daemons need, listen on ``path``, print ``ready``, and fork a daemon per request until
    SIGTERM. Never returns in a forked daemon: its SystemExit unwinds out of here as a normal exit."""
    for name in PRELOAD:
        importlib.import_module(name)
    sys.modules.pop("daemons.proxy.app", None)  # runpy executes it afresh as __main__ (see PRELOAD)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the daemons: no zombies to wait for
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server_pid = os.getpid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        listener.listen(16)
        print("ready", flush=True)
        while True:
            conn, _ = listener.accept()
            with conn:
                _one(listener, conn)
    finally:
        if os.getpid() == server_pid:
            listener.close()
            Path(path).unlink(missing_ok=True)


def _one(listener: socket.socket, conn: socket.socket) -> None:
    """Serve one request: fork, reply with the pid (in the server), or run the daemon (in the child)."""
    fds: list[int] = []
    try:
        conn.settimeout(10)
        msg, fds, _, _ = socket.recv_fds(conn, 4 + _MAX_FRAME, 3)
        (n,) = struct.unpack("!I", msg[:4])
        if n > _MAX_FRAME:
            raise ValueError(f"a request of {n} bytes")
        body = msg[4:] + _read_exact(conn, max(n - len(msg) + 4, 0))
        request = json.loads(body)
        module, args, env, cwd = request["module"], list(request["args"]), dict(request["env"]), request["cwd"]
        if module not in SERVED or len(fds) != 3:
            raise ValueError(f"not a daemon this server runs: {module!r} with {len(fds)} descriptors")
        _warm(request.get("warm"))
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        for fd in fds:
            os.close(fd)
        _reply(conn, {"error": str(exc)})
        return
    if pid == 0:
        listener.close()
        conn.close()
        _become(module, args, env, cwd, fds)  # raises SystemExit (or what the daemon raised)
    for fd in fds:
        os.close(fd)
    _reply(conn, {"pid": pid})


_warmed: set[str] = set()


def _warm(what: str | None) -> None:
    """Import what ``what`` names (see ``warm_for``) in the server, once; where that fails (no vLLM here), the
    daemon imports it itself and says why."""
    if what != "vllm" or what in _warmed:
        return
    _warmed.add(what)
    try:
        from daemons.engine.vllm_internals import preload

        preload()
    except Exception as exc:  # noqa: BLE001: the daemon's own import reports it
        print(f"fork server: vLLM not preloaded ({exc})", file=sys.stderr, flush=True)


def _reply(conn: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    try:
        conn.sendall(struct.pack("!I", len(data)) + data)
    except OSError:
        pass  # the caller gave up; a daemon it never learnt of still runs, as after a Popen it lost


def _become(module: str, args: list[str], env: dict, cwd: str, fds: list[int]) -> None:
    """In the forked child: become ``python -m module *args`` and run it to its end."""
    import runpy

    os.setsid()
    try:  # its name in ps and top (its cmdline stays the server's)
        with open("/proc/self/comm", "w") as comm:
            comm.write("llumnix-" + module.split(".")[1])
    except OSError:
        pass
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    os.closerange(3, 1 << 16)  # the received descriptors, the server's stdout pipe: nothing of the server's
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    random.seed()
    sys.argv = [module] + args
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    sys.exit(0)


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m llumnixctl.lab.forkserver SOCKET_PATH")
    serve(sys.argv[1])


if __name__ == "__main__":
    main()
