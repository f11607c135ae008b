#!/usr/bin/env bash
# Sim-to-real: the same trace through real daemons (sim instances, real time) and through
# `llumnixctl simulate`, with the simulator given this machine's fixed costs from a probe run first.
#
#   bash scripts/sim2real.sh [OUT_DIR]     -> OUT_DIR/sim2real.json (default: results/); about 2 minutes
#   CASE=pd bash scripts/sim2real.sh       -> OUT_DIR/sim2real-pd.json: 1 prefill + 2 decode instances; under a minute
#   CASE=slo bash scripts/sim2real.sh      -> OUT_DIR/sim2real-slo.json: admission by SLO, a burst; under a minute
#
# Environment: CASE (plain, pd or slo; default plain), REQUESTS, RATE (requests/s), INSTANCES; their defaults are
# the case's: plain 400 requests at 6/s on 4 instances, pd 40 at 1.5/s on 3, slo 60 at 20/s on 2 (after 8 at 1/s).
# Exit status 1 when they do not agree within the case's bar (plain: mean TTFT within 10%, P99 TTFT within 20%;
# pd: decode TPOT mean within 15%, handover order-to-commit mean within 50%, handovers committed within 10%;
# slo: admitted, refused and the admitted P99 TTFT each within 20%).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-results}"
mkdir -p "$out"
venv="${LLUMNIX_VENV:-.venv}"
if [ ! -x "$venv/bin/llumnixctl" ]; then
    LLUMNIX_EXTRAS="${LLUMNIX_EXTRAS:-test}" bash scripts/install.sh
fi
case="${CASE:-plain}"
args=(--case "$case")
if [ "$case" = plain ]; then
    file="$out/sim2real.json"
    args+=(--instances "${INSTANCES:-4}" --requests "${REQUESTS:-400}" --rate "${RATE:-6}")
else
    file="$out/sim2real-$case.json"
    [ -n "${INSTANCES:-}" ] && args+=(--instances "$INSTANCES")
    [ -n "${REQUESTS:-}" ] && args+=(--requests "$REQUESTS")
    [ -n "${RATE:-}" ] && args+=(--rate "$RATE")
fi
HF_HUB_OFFLINE=1 "$venv/bin/python" -m llumnixctl.experiments.sim.sim2real "${args[@]}" --out "$file" > /dev/null \
    && status=0 || status=$?
"$venv/bin/python" - "$file" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
num = lambda v, f: "-" if v is None else format(v, f)
pct = lambda v: "-" if v is None else f"{v:+.1%}"
case = d.get("case", "plain")
if case == "plain":
    for k in ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_e2el_ms", "p99_e2el_ms"):
        print(f"{k:14} real {d['real'][k]:9.1f}  simulated {d['simulated'][k]:9.1f}  ({d['relative_difference'][k]:+.1%})")
else:
    c = d[case]
    for k, v in c["relative_difference"].items():
        print(f"{k:14} real {num(c['real'].get(k), '9.1f'):>9}  simulated {num(c['simulated'].get(k), '9.1f'):>9}  ({pct(v)})")
print("agree:", d["agree"], "-", d["bar"])
f = d.get("fits")
if f:
    pct = lambda v: "-" if v is None else f"{v:.1%}"
    print(f"step-time fits vs the model the sim runs ({f['simulated']['model']}), median relative error: "
          f"simulated {pct(f['simulated']['median_relative_error'])}, real {pct(f['real']['median_relative_error'])}"
          f" (the real instances' include this machine's per-step cost)")
    print("fits agree:", f["simulated"]["agree"], "-", f["bar"])
PY
echo "wrote $file"
exit "$status"
