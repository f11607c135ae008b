#!/usr/bin/env bash
# Reproduce the Llumnix paper's Fig 12 (memory fragmentation: how often a queue head fits the cluster's free
# memory but no single instance; llumnix vs INFaaS++ over a Fig 11 style load) in virtual time
# (llumnixctl.experiments.sim.simulate: the daemons' own manager, policy and sim engine; an estimated LLaMA-7B-on-A10
# instance, llumnixctl/experiments/figs/common.py PAPER_LIKE), the paper's numbers written beside ours.
#
#   bash scripts/fig12.sh [OUT_DIR] [ARGS...]   -> OUT_DIR/fig12.json, OUT_DIR/fig12.png (default: ./results)
#
# ARGS go to python -m llumnixctl.experiments.figs.fig12 (--quick, --requests N, --instances N).
# Takes seconds when OUT_DIR/fig11.json is there (it reads the fragmentation samples of the Fig 11 runs:
# run scripts/fig11.sh first); else (or with --own-runs) about 2 minutes on an idle 2-core machine.
set -euo pipefail
source "$(dirname "$0")/figure-env.sh"  # the repository, $out (default results/), .venv with matplotlib
"$venv/bin/python" -m llumnixctl.experiments.figs.fig12 --out "$out" "$@"
echo "wrote $out/fig12.json and $out/fig12.png"
