#!/usr/bin/env bash
# Set up (scripts/install.sh) and run the whole test suite. Extra arguments go to one pytest run as they are
# (`bash scripts/test.sh tests/unit/test_policy.py -k dispatch`).
#
# With none, the suite runs in three parts; all three run even when one fails, and the exit status is the
# first non-zero one:
#   1. tests/unit/: the tests that start no daemon and no engine, on every core (pytest-xdist; a module marked
#      xdist_group runs whole on one worker), beside part 2 at a lower priority (they fill the time the daemons
#      leave idle); LLUMNIX_UNIT_BESIDE=0 runs them first instead, alone;
#   2. tests/e2e/ (they start daemons or engines; marked e2e) in two streams side by side: stream 1, one pytest run
#      that takes its modules one at a time, the modules with vLLM engines or network namespaces (HEAVY below: two
#      vLLM clusters at once would want more than two cores); stream 2, the other modules on two pytest-xdist
#      workers, each taking whole modules (--dist loadfile). Each pytest process starts its clusters' daemons from
#      a fork server (tests/conftest.py; LLUMNIX_TEST_FORKSERVER=0: each afresh). Stream 1 prints when it ends,
#      stream 2 as it goes;
#   3. the e2e tests marked alone (they measure real time), with nothing beside them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1
PYTEST=(.venv/bin/python -m pytest -q)
if [ $# -gt 0 ]; then
  exec "${PYTEST[@]}" "$@"
fi
HEAVY=(tests/e2e/test_e2e_vllm.py tests/e2e/test_e2e_vllm_migration.py tests/e2e/test_e2e_vllm_migration_aborts.py tests/e2e/test_e2e_vllm_tp.py tests/e2e/test_vllm_engine.py
       tests/e2e/test_vllm_real_model.py tests/e2e/test_vllm_tier.py tests/e2e/test_vllm_waiting_tokens.py tests/e2e/test_e2e_vllm_tier.py
       tests/e2e/test_bench_serve.py tests/e2e/test_multihost.py tests/e2e/test_netns.py)
e2e=(tests/e2e/test_*.py)
heavy=() light=()
for m in "${e2e[@]}"; do
  if [[ " ${HEAVY[*]} " == *" $m "* ]]; then heavy+=("$m"); else light+=("$m"); fi
done
workers=$(nproc 2>/dev/null || echo 2)
[ "$workers" -ge 2 ] || workers=2
rc=0
keep() { [ "$rc" != 0 ] || rc=$1; }
tmp=$(mktemp -d)
one="" unit=""
DFL=()
if env --default-signal=INT true 2>/dev/null; then DFL=(env --default-signal=INT); fi
# A command started with & by a script ignores SIGINT, and Python then never raises KeyboardInterrupt: those below
# get SIGINT's default back (env --default-signal, coreutils 8.31), so that the trap's SIGINT stops them with their
# fixtures' teardown (which stops their daemons). On the way out (Ctrl-C, a failure) the trap interrupts stream 1's
# pytest and the whole process group of the unit run (a session of its own, which a terminal's Ctrl-C does not
# reach; pytest-xdist's workers are in it).
trap '[ -z "$one" ] || kill -INT "$one" 2>/dev/null; [ -z "$unit" ] || kill -INT -- -"$unit" 2>/dev/null || true
      rm -rf "$tmp"' EXIT
# Part 1 runs beside part 2 at a lower priority, in a session of its own (where the kernel groups a session's tasks
# for scheduling, autogroup, that group is niced too): it takes the cores while the daemons wait (paced steps,
# sleeps between polls, I/O) and mostly yields them while they run. Nice 10, not 19: its tests that wait a few
# seconds for a condition still get their share. Its output comes after part 2's.
# A test waiting for the cores is not hung: the per-test limit is 900 s here, not 300. On 2 cores the whole run
# once took 14:18 this way (26 CPU-minutes; before the fork server and the two light workers, 16:31 and 30
# CPU-minutes), and 15:25 (29 CPU-minutes) at stop 61, with more tests: the run is CPU-bound, so what shortens it
# is CPU saved, not more streams. LLUMNIX_UNIT_BESIDE=0 runs the unit tests first, alone.
if [ "${LLUMNIX_UNIT_BESIDE:-1}" = 0 ]; then
  echo "== tests without daemons, on $workers workers" >&2
  "${PYTEST[@]}" -n "$workers" --dist loadgroup -m "not e2e" tests/unit || keep $?
else
  echo "== tests without daemons, on $workers workers, beside the tests with daemons at nice 10" >&2
  setsid -w bash -c 'echo 10 > /proc/self/autogroup 2>/dev/null; exec nice -n 10 "$@"' unit \
    "${DFL[@]}" "${PYTEST[@]}" -o timeout=900 -n "$workers" --dist loadgroup -m "not e2e" tests/unit > "$tmp/unit.log" 2>&1 &
  unit=$!
fi
echo "== tests with daemons or engines: ${#heavy[@]} modules (stream 1) beside ${#light[@]} (stream 2)" >&2
"${DFL[@]}" "${PYTEST[@]}" --basetemp="$tmp/1" --durations=15 -m "e2e and not alone" "${heavy[@]}" > "$tmp/stream1.log" 2>&1 &
one=$!
"${PYTEST[@]}" --basetemp="$tmp/2" --durations=15 -n 2 --dist loadfile -m "e2e and not alone" "${light[@]}" || keep $?
s1=0
wait "$one" || s1=$?
one=""
echo "== stream 1 (${heavy[*]#tests/e2e/})" >&2
cat "$tmp/stream1.log"
keep "$s1"
if [ -n "$unit" ]; then
  u=0
  wait "$unit" || u=$?
  unit=""
  echo "== tests without daemons" >&2
  cat "$tmp/unit.log"
  keep "$u"
fi
echo "== tests that measure real time, alone" >&2
one=""
mapfile -t alone < <(grep -l -E 'pytest\.mark\.alone' "${e2e[@]}")
"${PYTEST[@]}" --basetemp="$tmp/3" --durations=5 -m "e2e and alone" "${alone[@]}" || keep $?
exit "$rc"
