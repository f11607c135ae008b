#!/usr/bin/env bash
# Reproduce the Llumnix paper's Fig 13 (priorities: high-priority requests' TTFT/TPOT/E2E, mean and P99, with and
# without headroom for high priority, llumnix vs INFaaS++, 10% high priority; and the normal requests' cost)
# with the virtual-time simulator (llumnixctl/experiments/sim/simulate.py: the daemons' own manager, policies and sim engine;
# a sim instance approximating LLaMA-7B on an A10, llumnixctl/experiments/figs/common.py). No GPU needed.
#
#   bash scripts/fig13.sh [OUT_DIR] [-- extra args]   -> OUT_DIR/fig13.json, OUT_DIR/fig13.png (default: ./results)
#
# Takes about 1-2.5 minutes on a 2-core machine (simulations run on every core). Extra arguments go to
# python -m llumnixctl.experiments.figs.fig13 (--quick, --requests N, --instances N, ...).
set -euo pipefail
source "$(dirname "$0")/figure-env.sh"  # the repository, $out (default results/), .venv with matplotlib
"$venv/bin/python" -m llumnixctl.experiments.figs.fig13 --out "$out" "$@"
