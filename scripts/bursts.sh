#!/usr/bin/env bash
# Reproduce the bursts study (a reviewer's question; no paper figure): Gamma arrivals with CV 4 and 8,
# migrations in flight and KV bytes per second at the peak, with and without the migration caps, and latency
# with the virtual-time simulator (llumnixctl/experiments/sim/simulate.py: the daemons' own manager, policies and sim engine;
# a sim instance approximating LLaMA-7B on an A10, llumnixctl/experiments/figs/common.py). No GPU needed.
#
#   bash scripts/bursts.sh [OUT_DIR] [-- extra args]   -> OUT_DIR/bursts.json, OUT_DIR/bursts.png (default: ./results)
#
# Takes about 1-1.5 minutes on a 2-core machine (simulations run on every core). Extra arguments go to
# python -m llumnixctl.experiments.figs.bursts (--quick, --requests N, --instances N, ...).
set -euo pipefail
source "$(dirname "$0")/figure-env.sh"  # the repository, $out (default results/), .venv with matplotlib
"$venv/bin/python" -m llumnixctl.experiments.figs.bursts --out "$out" "$@"
