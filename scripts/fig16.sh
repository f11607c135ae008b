#!/usr/bin/env bash
# Reproduce the Llumnix paper's Fig 16 (scheduling stall at 64 instances: the manager's wall time per
# dispatch and per pairing round, against the step time) in virtual time
# (llumnixctl.experiments.sim.simulate: the daemons' own manager, policy and sim engine; an estimated LLaMA-7B-on-A10
# instance, llumnixctl/experiments/figs/common.py PAPER_LIKE), the paper's numbers written beside ours.
#
#   bash scripts/fig16.sh [OUT_DIR] [ARGS...]   -> OUT_DIR/fig16.json, OUT_DIR/fig16.png (default: ./results)
#
# ARGS go to python -m llumnixctl.experiments.figs.fig16 (--quick, --requests N, --instances N).
# Takes about 1 minute on an idle 2-core machine (2 simulations: 64 instances x 4,000 requests, 16 x 1,000, on every core).
set -euo pipefail
source "$(dirname "$0")/figure-env.sh"  # the repository, $out (default results/), .venv with matplotlib
"$venv/bin/python" -m llumnixctl.experiments.figs.fig16 --out "$out" "$@"
echo "wrote $out/fig16.json and $out/fig16.png"
