"""llumnixctl/lab/procs.py's stop: SIGTERM, then SIGKILL for what ignores it, one deadline for all, reaped."""

from __future__ import annotations

import subprocess
import sys
import time

from llumnixctl.lab.procs import stop

CHILD = ("import signal, sys, time\n"
         "if sys.argv[1] == 'stubborn': signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
         "print('ready', flush=True)\ntime.sleep(60)\n")


def test_stop_terms_then_kills_what_ignores_it_within_one_deadline():
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, kind], stdout=subprocess.PIPE, text=True)
             for kind in ("stubborn", "polite", "stubborn")]
    for p in procs:
        assert p.stdout.readline() == "ready\n"  # its handler is in place
    t0 = time.monotonic()
    stop(procs, grace_s=1.0)
    took = time.monotonic() - t0
    assert [p.returncode for p in procs] == [-9, -15, -9]
    assert took < 6, took  # one deadline for all, not one per process
    for p in procs:
        p.stdout.close()
