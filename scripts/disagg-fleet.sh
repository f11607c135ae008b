#!/usr/bin/env bash
# Prefill/decode disaggregation in a fleet (issue #38), in virtual time (llumnixctl.experiments.sim.simulate: the
# daemons' own manager, policies, migrators and sim engine; roles, dispatch by disagg.decide, handovers at the
# first token and adaptive roles: llumnixctl/experiments/sim/disagg.py): 8 and 16 paper-like instances
# (llumnixctl/experiments/figs/common.py PAPER_LIKE), a conversation-like trace, loads 0.5x-2.5x capacity;
# adaptive roles vs every fixed prefill/decode split vs mixed llumnix and slo, against one TTFT and TPOT target.
#
#   bash scripts/disagg-fleet.sh [OUT_DIR] [-- ARGS...]   -> OUT_DIR/disagg-fleet.json, .png (default: ./results)
#
# ARGS go to python -m llumnixctl.experiments.figs.disagg_fleet (--quick, --sizes 8,16, --loads 0.5,1,1.5,2,2.5,
# --systems adaptive,fixed,llumnix,slo, --requests N (per 8 instances), --phase-s S (a phased trace),
# --handover-blocking, --processes N, --parts DIR, --collect DIR). With the defaults (400 requests per 8
# instances, 5 loads, 8 systems per size: 80 simulations) it takes about 10 minutes on 2 free cores; hold the
# shared heavy lock on a shared machine: flock /tmp/llumnix-heavy.lock bash scripts/disagg-fleet.sh
set -euo pipefail
source "$(dirname "$0")/figure-env.sh"  # the repository, $out (default results/), .venv with matplotlib
"$venv/bin/python" -m llumnixctl.experiments.figs.disagg_fleet --out "$out" "$@"
echo "wrote $out/disagg-fleet.json and $out/disagg-fleet.png"
