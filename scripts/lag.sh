#!/usr/bin/env bash
# Reproduce the Llumnix paper's information-lag study (a reviewer's question: P99 TTFT and herding as the
# load-report lag grows, with and without counting in-flight dispatches) in virtual time
# (llumnixctl.experiments.sim.simulate: the daemons' own manager, policy and sim engine; an estimated LLaMA-7B-on-A10
# instance, llumnixctl/experiments/figs/common.py PAPER_LIKE), the paper's numbers written beside ours.
#
#   bash scripts/lag.sh [OUT_DIR] [ARGS...]   -> OUT_DIR/lag.json, OUT_DIR/lag.png (default: ./results)
#
# ARGS go to python -m llumnixctl.experiments.figs.lag (--quick, --requests N, --instances N).
# Takes about 3 minutes on an idle 2-core machine (10 simulations of 1,500 requests, on every core).
set -euo pipefail
source "$(dirname "$0")/figure-env.sh"  # the repository, $out (default results/), .venv with matplotlib
"$venv/bin/python" -m llumnixctl.experiments.figs.lag --out "$out" "$@"
echo "wrote $out/lag.json and $out/lag.png"
