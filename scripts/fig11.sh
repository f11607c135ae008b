#!/usr/bin/env bash
# Reproduce the Llumnix paper's Fig 11 (16 instances: prefill, decode and end-to-end latency, mean and P99,
# and preemption loss; llumnix vs INFaaS++ vs round-robin over the paper's length mixes, Poisson and Gamma
# arrivals, rate swept) in virtual time
# (llumnixctl.simulate: the daemons' own manager, policy and sim engine; an estimated LLaMA-7B-on-A10
# instance, llumnixctl/figs/common.py PAPER_LIKE), the paper's numbers written beside ours.
#
#   bash scripts/fig11.sh [OUT_DIR] [ARGS...]   -> OUT_DIR/fig11.json, OUT_DIR/fig11.png (default: ./results)
#
# ARGS go to python -m llumnixctl.figs.fig11 (--quick, --requests N, --instances N).
# Takes about 6 minutes on an idle 2-core machine (33 simulations of 2,000 requests, on every core).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-results}"
shift || true
venv="${LLUMNIX_VENV:-.venv}"
if [ ! -x "$venv/bin/llumnixctl" ]; then
    LLUMNIX_EXTRAS="${LLUMNIX_EXTRAS:-test}" bash scripts/install.sh
fi
if ! "$venv/bin/python" -c "import matplotlib" 2>/dev/null; then
    "$venv/bin/python" -m pip install --quiet "matplotlib>=3.8"
fi
"$venv/bin/python" -m llumnixctl.figs.fig11 --out "$out" "$@"
echo "wrote $out/fig11.json and $out/fig11.png"
