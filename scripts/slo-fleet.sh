#!/usr/bin/env bash
# Serving to an SLO in a fleet (issue #37), in virtual time (llumnixctl.experiments.sim.simulate: the daemons'
# own manager, policies, admission and sim engine; an estimated LLaMA-7B-on-A10 instance,
# llumnixctl/experiments/figs/common.py PAPER_LIKE): 16 instances, the paper's L-L mix with bursty Gamma arrivals
# (cv 2), the load swept from 0.5x to 3x capacity; slo (dispatch_policy slo + admission by SLO) against
# queue-everything llumnix and infaas++, all measured against the same TTFT and TPOT targets.
#
#   bash scripts/slo-fleet.sh [OUT_DIR] [-- ARGS...]   -> OUT_DIR/slo-fleet.json, .png (default: ./results)
#
# ARGS go to python -m llumnixctl.experiments.figs.slo_fleet (--quick, --requests N, --loads 0.5,1,2,3,
# --systems slo,llumnix,infaas++, --processes N, --parts DIR to keep each simulation's row as it finishes,
# --collect DIR to make the figure from rows run in pieces). With the defaults (2,000 requests per simulation,
# six loads, three systems: 18 simulations of 1-4 minutes each) it takes about 20 minutes on 2 cores.
set -euo pipefail
source "$(dirname "$0")/figure-env.sh"  # the repository, $out (default results/), .venv with matplotlib
"$venv/bin/python" -m llumnixctl.experiments.figs.slo_fleet --out "$out" "$@"
echo "wrote $out/slo-fleet.json and $out/slo-fleet.png"
