"""The lab's scratch directories (llumnixctl/lab/scratch.py): gone when the process exits, however it exits,
unless kept for the logs that explain a failure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import sys
from llumnixctl.lab.scratch import keep, scratch_dir
gone, kept = scratch_dir("t-gone-"), scratch_dir("t-kept-")
(gone / "cluster.log").write_text("x")
(kept / "manager-1.log").write_text("why it failed")
keep(kept)
print(gone, kept, flush=True)
raise KeyboardInterrupt  # as SIGTERM ends a lab command outside its finally blocks
"""


def test_a_scratch_directory_is_removed_at_exit_and_a_kept_one_stays(tmp_path):
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TMPDIR": str(tmp_path)})
    assert res.returncode != 0 and "KeyboardInterrupt" in res.stderr, res.stderr
    gone, kept = (Path(p) for p in res.stdout.split())
    assert gone.parent == tmp_path and not gone.exists()
    assert (kept / "manager-1.log").read_text() == "why it failed"
