#!/usr/bin/env bash
# Set up (scripts/install.sh) and run the whole test suite. Extra arguments go to one pytest run as they are
# (`bash scripts/test.sh tests/test_policy.py -k dispatch`).
#
# With none, the suite runs in two parts: the tests that start no daemon and no engine (not marked e2e) run
# first on every core (pytest-xdist), then the tests marked e2e (they start daemons or engines, and their
# timing must not compete with other tests) run one at a time, from the modules that have any. Both parts
# run even when the first fails; the exit status is the first non-zero one.
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
echo "== tests with daemons or engines, one at a time (${#serial[@]} modules)" >&2
"${PYTEST[@]}" --durations=25 -m e2e "${serial[@]}" || { s=$?; [ "$rc" != 0 ] || rc=$s; }
exit "$rc"
