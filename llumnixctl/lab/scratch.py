"""The scratch directories of the lab's commands (benchmarks, checks: a cluster's run directory, a generated
model). Each command removes its own in a finally block; what ends the command outside one (a Ctrl-C or
SIGTERM while its cluster starts: ``timeout 900 llumnixctl bench ...``) still leaves nothing in the temporary
directory, as the process exits. A command whose error names a log in its directory keeps it (``keep``)."""

from __future__ import annotations

import atexit
import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

_removals: dict[Path, Callable[[], None]] = {}


def scratch_dir(prefix: str) -> Path:
    """A new directory (mkdtemp: this user's only) that is removed at the latest when the process exits."""
    path = Path(tempfile.mkdtemp(prefix=prefix))

    def remove() -> None:
        shutil.rmtree(path, ignore_errors=True)

    _removals[path] = remove
    atexit.register(remove)
    return path


def keep(path: Path) -> None:
    """Leave ``path`` (from ``scratch_dir``) where it is when the process exits: the logs that explain a failure."""
    remove = _removals.pop(Path(path), None)
    if remove is not None:
        atexit.unregister(remove)


@contextlib.contextmanager
def kept_if(path: Path, *errors: type[BaseException]) -> Iterator[None]:
    """Within: one of ``errors`` (any Exception if none given) keeps ``path`` (``keep``) as it propagates; for a
    step whose error points at the logs there (a cluster that did not start)."""
    try:
        yield
    except errors or (Exception,):
        keep(path)
        raise
