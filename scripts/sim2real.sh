#!/usr/bin/env bash
# Sim-to-real: the same trace through real daemons (4 sim instances, real time) and through
# `llumnixctl simulate`, with the simulator given this machine's fixed costs from a probe run first.
#
#   bash scripts/sim2real.sh [OUT_DIR]     -> OUT_DIR/sim2real.json (default: results/); about 2 minutes
#
# Environment: REQUESTS (default 400), RATE (default 6 requests/s), INSTANCES (default 4).
# Exit status 1 when they do not agree within the bar (mean TTFT within 10%, P99 TTFT within 20%).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-results}"
mkdir -p "$out"
venv="${LLUMNIX_VENV:-.venv}"
if [ ! -x "$venv/bin/llumnixctl" ]; then
    LLUMNIX_EXTRAS="${LLUMNIX_EXTRAS:-test}" bash scripts/install.sh
fi
HF_HUB_OFFLINE=1 "$venv/bin/python" -m llumnixctl.experiments.sim.sim2real --instances "${INSTANCES:-4}" \
    --requests "${REQUESTS:-400}" --rate "${RATE:-6}" --out "$out/sim2real.json" > /dev/null && status=0 || status=$?
"$venv/bin/python" - "$out/sim2real.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for k in ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_e2el_ms", "p99_e2el_ms"):
    print(f"{k:14} real {d['real'][k]:9.1f}  simulated {d['simulated'][k]:9.1f}  ({d['relative_difference'][k]:+.1%})")
print("agree:", d["agree"], "-", d["bar"])
f = d.get("fits")
if f:
    pct = lambda v: "-" if v is None else f"{v:.1%}"
    print(f"step-time fits vs the model the sim runs ({f['simulated']['model']}), median relative error: "
          f"simulated {pct(f['simulated']['median_relative_error'])}, real {pct(f['real']['median_relative_error'])}"
          f" (the real instances' include this machine's per-step cost)")
    print("fits agree:", f["simulated"]["agree"], "-", f["bar"])
PY
echo "wrote $out/sim2real.json"
exit "$status"
