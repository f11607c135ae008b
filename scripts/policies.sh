#!/usr/bin/env bash
# Compare dispatch and scheduling policies (rr, infaas++, llumnix) on generated traces, the Llumnix paper's
# serving experiment on a local sim cluster: once with Poisson arrivals, once with bursty Gamma arrivals.
#
#   bash scripts/policies.sh [OUT_DIR]   -> OUT_DIR/policies-poisson.json, OUT_DIR/policies-gamma.json
#                                           (default: ./policies), and the tables on stdout
#
# Environment: CV (Gamma coefficient of variation, default 3), RATE, REQUESTS, POLICIES, INSTANCES,
# HIGH_FRACTION, SEED; BENCH_ARGS for any other `llumnixctl bench policies` options (e.g. "--set k=v").
# About 2 minutes per policy and trace with the defaults (12 in all).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-policies}"
mkdir -p "$out"
venv="${LLUMNIX_VENV:-.venv}"
if [ ! -x "$venv/bin/llumnixctl" ]; then
    LLUMNIX_EXTRAS="${LLUMNIX_EXTRAS:-test}" bash scripts/install.sh  # the sim engine needs no vLLM
fi
args=(bench policies --json --budget-s 0)  # the whole trace for every policy (the default budget cuts it)
[ -n "${RATE:-}" ] && args+=(--rate "$RATE")
[ -n "${REQUESTS:-}" ] && args+=(--requests "$REQUESTS")
[ -n "${POLICIES:-}" ] && args+=(--policies "$POLICIES")
[ -n "${INSTANCES:-}" ] && args+=(--instances "$INSTANCES")
[ -n "${HIGH_FRACTION:-}" ] && args+=(--high-fraction "$HIGH_FRACTION")
[ -n "${SEED:-}" ] && args+=(--seed "$SEED")
# shellcheck disable=SC2206  # BENCH_ARGS is split on purpose
extra=(${BENCH_ARGS:-})
export HF_HUB_OFFLINE=1
for arrival in poisson gamma; do
    file="$out/policies-$arrival.json"
    "$venv/bin/llumnixctl" "${args[@]}" --arrival "$arrival" --cv "${CV:-3}" "${extra[@]}" > "$file.tmp"
    mv "$file.tmp" "$file"
    "$venv/bin/python" -c 'import json, sys; from llumnixctl.experiments.bench.policies import print_tables; print_tables(json.load(open(sys.argv[1])))' "$file"
done
echo "wrote $out/policies-poisson.json and $out/policies-gamma.json"
