"""Private directories for a process's ipc:// sockets: made for this user only (mkdtemp: mode 0700), swept when a
killed process left one behind. The tensor-parallel ranks' KV control lines (daemons/kv/rankctl.py) and vLLM's
own message-queue sockets (daemons/engine/vllm_internals.py) live in one each, so neither the engine nor the KV
transport needs the other to make them.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import tempfile
import time

PREFIX = "llumnix-kv-"
STALE_S = 60.0  # a directory of ours this old whose sockets no one listens on was left by a killed instance


def endpoint_dir() -> str:
    """A fresh directory for the ranks' sockets, entered by this user only (mkdtemp: mode 0700). Directories
    that killed instances left (no rank listens on their sockets any more) go first."""
    sweep_stale(tempfile.gettempdir())
    return tempfile.mkdtemp(prefix=PREFIX)


def sweep_stale(parent: str, now: float | None = None) -> list[str]:
    """Remove this user's endpoint directories under ``parent`` older than ``STALE_S`` on whose sockets no one
    listens (an instance killed with SIGKILL never removed its own); the removed ones."""
    now = time.time() if now is None else now
    removed = []
    for path in glob.glob(os.path.join(parent, PREFIX + "*")):
        try:
            st = os.stat(path)
            if st.st_uid != os.getuid() or now - st.st_mtime < STALE_S:
                continue
            if any(_listening(os.path.join(path, name)) for name in os.listdir(path)):
                continue
        except OSError:  # gone meanwhile, or not ours to read
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _listening(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except OSError:
            return False
    return True


def remove_endpoint_dir(path: str) -> None:
    if path and os.path.basename(path).startswith(PREFIX):
        shutil.rmtree(path, ignore_errors=True)
