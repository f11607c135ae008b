#!/usr/bin/env bash
# Run a command while busy processes take the CPUs: how the suite is checked for flakes under load.
#
#   bash scripts/hog.sh [-n HOGS] [-t MAX_SECONDS] -- COMMAND...
#
# HOGS busy Python processes (default: one per core) run at the same priority as the command, each for at
# most MAX_SECONDS (default 3600), and are stopped by pid when the command ends (also when it fails or is
# interrupted). The exit status is the command's.
set -euo pipefail
hogs=$(nproc 2>/dev/null || echo 2)
max_s=3600
while [ $# -gt 0 ]; do
  case "$1" in
    -n) hogs=$2; shift 2 ;;
    -t) max_s=$2; shift 2 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || { echo "usage: $0 [-n HOGS] [-t MAX_SECONDS] -- COMMAND..." >&2; exit 2; }
pids=()
stop() { [ ${#pids[@]} -eq 0 ] || kill "${pids[@]}" 2>/dev/null || true; }
trap stop EXIT INT TERM
for _ in $(seq "$hogs"); do
  python3 -c "
import time
end = time.monotonic() + $max_s
while time.monotonic() < end:
    sum(i * i for i in range(10000))
" &
  pids+=($!)
done
echo "hog.sh: $hogs busy processes (pids ${pids[*]}), at most ${max_s}s" >&2
rc=0
"$@" || rc=$?
exit "$rc"
