#!/usr/bin/env python3
"""Write Prometheus file_sd targets for a Llumnix cluster's instances, from `llumnixctl status --json`.

    targets.py OUT.json [--every SECONDS] [--llumnixctl PATH] [-- llumnixctl options, e.g. --manager tcp://...]

Each live instance with a metrics address becomes one target. The file is replaced atomically and only when
its content changes, so Prometheus (file_sd_configs) rereads it as instances come and go. With --every, it
repeats until interrupted; a manager that does not answer leaves the last file as it was.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time


def targets(status: dict) -> list[dict]:
    addresses = sorted(i["metrics_address"] for i in status.get("instances", [])
                       if i.get("metrics_address") and i.get("state") != "dead")
    return [{"targets": addresses, "labels": {}}] if addresses else []


def write(path: str, groups: list[dict]) -> bool:
    """Replace ``path`` with ``groups`` if they differ from what it holds; True if it was written."""
    text = json.dumps(groups, indent=2) + "\n"
    try:
        with open(path) as f:
            if f.read() == text:
                return False
    except OSError:
        pass
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return True


def status(llumnixctl: list[str], extra: list[str]) -> dict:
    res = subprocess.run([*llumnixctl, "status", "--json", *extra], capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise RuntimeError(res.stderr.strip() or f"llumnixctl status exited {res.returncode}")
    return json.loads(res.stdout)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the file_sd JSON file to write")
    parser.add_argument("--every", type=float, default=0.0, help="repeat every SECONDS (default: once)")
    parser.add_argument("--llumnixctl", default=shutil.which("llumnixctl") or "",
                        help="the llumnixctl command (default: from PATH; else python -m llumnixctl.main)")
    args = parser.parse_args(argv)
    ctl = [args.llumnixctl] if args.llumnixctl else [sys.executable, "-m", "llumnixctl.main"]
    while True:
        try:
            groups = targets(status(ctl, extra))
        except (RuntimeError, ValueError, OSError, subprocess.TimeoutExpired) as exc:
            print(f"targets.py: {exc}", file=sys.stderr)
            if not args.every:
                return 1
        else:
            if write(args.out, groups):
                print(f"targets.py: {args.out}: {sum(len(g['targets']) for g in groups)} instance(s)", file=sys.stderr)
        if not args.every:
            return 0
        time.sleep(args.every)


if __name__ == "__main__":
    sys.exit(main())
