#!/usr/bin/env bash
# Reproduce the Llumnix paper's Fig 14 and Fig 15 (auto-scaling: instance-seconds against P99 latency, llumnix vs
# INFaaS++ under the same freeness-based scaling rule, on a low-high-low trace, sweeping the scaling thresholds)
# with the virtual-time simulator (llumnixctl/experiments/sim/simulate.py: the daemons' own manager, policies and sim engine;
# a sim instance approximating LLaMA-7B on an A10, llumnixctl/experiments/figs/common.py). No GPU needed.
#
#   bash scripts/fig14.sh [OUT_DIR] [-- extra args]   -> OUT_DIR/fig14.json, OUT_DIR/fig14.png (default: ./results)
#                                                     and OUT_DIR/fig14-gentle.json/.png (a milder step: 10 -> 24 req/s)
#
# Takes about 2-4 minutes (both traces) on a 2-core machine (simulations run on every core). Extra arguments go to
# python -m llumnixctl.experiments.figs.fig14 (--quick, --requests N, --instances N, ...).
set -euo pipefail
source "$(dirname "$0")/figure-env.sh"  # the repository, $out (default results/), .venv with matplotlib
"$venv/bin/python" -m llumnixctl.experiments.figs.fig14 --out "$out" "$@"
"$venv/bin/python" -m llumnixctl.experiments.figs.fig14 --out "$out" --rates 10,24 --name fig14-gentle "$@"
