#!/usr/bin/env bash
# Reproduce the Llumnix paper's Fig 11 (16 instances: prefill, decode and end-to-end latency, mean and P99,
# and preemption loss; llumnix vs INFaaS++ vs round-robin over the paper's length mixes, Poisson and Gamma
# arrivals, rate swept) in virtual time
# (llumnixctl.experiments.sim.simulate: the daemons' own manager, policy and sim engine; an estimated LLaMA-7B-on-A10
# instance, llumnixctl/experiments/figs/common.py PAPER_LIKE), the paper's numbers written beside ours.
#
#   bash scripts/fig11.sh [OUT_DIR] [ARGS...]   -> OUT_DIR/fig11.json, OUT_DIR/fig11.png (default: ./results)
#
# ARGS go to python -m llumnixctl.experiments.figs.fig11 (--quick, --requests N, --instances N).
# Takes about 8 minutes on an idle 2-core machine (33 simulations of 2,000 requests, on every core).
set -euo pipefail
source "$(dirname "$0")/figure-env.sh"  # the repository, $out (default results/), .venv with matplotlib
"$venv/bin/python" -m llumnixctl.experiments.figs.fig11 --out "$out" "$@"
echo "wrote $out/fig11.json and $out/fig11.png"
