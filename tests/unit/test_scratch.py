"""The lab's scratch directories (llumnixctl/lab/scratch.py): gone when the process exits, however it exits,
unless kept for the logs that explain a failure (``keep``, or ``kept_if`` the named error)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import contextlib
from llumnixctl.lab.scratch import keep, kept_if, scratch_dir
gone, kept = scratch_dir("t-gone-"), scratch_dir("t-kept-")
(gone / "cluster.log").write_text("x")
(kept / "manager-1.log").write_text("why it failed")
keep(kept)
failed, other = scratch_dir("t-failed-"), scratch_dir("t-other-")
with contextlib.suppress(ValueError), kept_if(failed, ValueError):
    raise ValueError("the cluster did not start")
with contextlib.suppress(KeyError), kept_if(other, ValueError):
    raise KeyError("not the error named")
print(gone, kept, failed, other, flush=True)
raise KeyboardInterrupt  # as SIGTERM ends a lab command outside its finally blocks
"""


def test_a_scratch_directory_is_removed_at_exit_and_a_kept_one_stays(tmp_path):
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TMPDIR": str(tmp_path)})
    assert res.returncode != 0 and "KeyboardInterrupt" in res.stderr, res.stderr
    gone, kept, failed, other = (Path(p) for p in res.stdout.split())
    assert gone.parent == tmp_path and not gone.exists() and not other.exists()
    assert (kept / "manager-1.log").read_text() == "why it failed"
    assert failed.is_dir()
