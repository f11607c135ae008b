#!/usr/bin/env bash
# Set up (scripts/install.sh) and run the whole test suite. Extra arguments go to one pytest run as they are
# (`bash scripts/test.sh tests/test_policy.py -k dispatch`).
#
# With none, the suite runs in three parts; all three run even when one fails, and the exit status is the
# first non-zero one:
#   1. the tests that start no daemon and no engine (not marked e2e), on every core (pytest-xdist);
#   2. the e2e tests (they start daemons or engines) on two workers, each module whole on one worker; the
#      modules with vLLM engines (or network namespaces) one after another on the same worker
#      (tests/conftest.py: SERIAL_GROUPS), the sim ones beside them;
#   3. the e2e tests marked alone (they measure real time), one at a time with nothing beside them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1
PYTEST=(.venv/bin/python -m pytest -q)
if [ $# -gt 0 ]; then
  exec "${PYTEST[@]}" "$@"
fi
mapfile -t serial < <(grep -l -E 'pytest\.mark\.e2e' tests/test_*.py)
workers=$(nproc 2>/dev/null || echo 2)
[ "$workers" -ge 2 ] || workers=2
rc=0
echo "== tests without daemons, on $workers workers" >&2
"${PYTEST[@]}" -n "$workers" -m "not e2e" tests/ || rc=$?
echo "== tests with daemons or engines, on 2 workers, each module whole (${#serial[@]} modules)" >&2
"${PYTEST[@]}" -n 2 --dist loadgroup --durations=25 -m "e2e and not alone" "${serial[@]}" || { s=$?; [ "$rc" != 0 ] || rc=$s; }
echo "== tests that measure real time, alone" >&2
"${PYTEST[@]}" --durations=5 -m "e2e and alone" "${serial[@]}" || { s=$?; [ "$rc" != 0 ] || rc=$s; }
exit "$rc"
