"""The scratch directories of the lab's commands (benchmarks, checks: a cluster's run directory, a generated
model). Each command removes its own in a finally block; what ends the command outside one (a Ctrl-C or
SIGTERM while its cluster starts: ``timeout 900 llumnixctl bench ...``) still leaves nothing in the temporary
directory, as the process exits."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path


def scratch_dir(prefix: str) -> Path:
    """A new directory (mkdtemp: this user's only) that is removed at the latest when the process exits."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
