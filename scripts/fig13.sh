#!/usr/bin/env bash
# Reproduce the Llumnix paper's Fig 13 (priorities: high-priority requests' TTFT/TPOT/E2E, mean and P99, with and
# without headroom for high priority, llumnix vs INFaaS++, 10% high priority; and the normal requests' cost)
# with the virtual-time simulator (llumnixctl/simulate.py: the daemons' own manager, policies and sim engine;
# a sim instance approximating LLaMA-7B on an A10, llumnixctl/figs/common.py). No GPU needed.
#
#   bash scripts/fig13.sh [OUT_DIR] [-- extra args]   -> OUT_DIR/fig13.json, OUT_DIR/fig13.png (default: ./results)
#
# Takes about 1-2.5 minutes on a 2-core machine (simulations run on every core). Extra arguments go to
# python -m llumnixctl.figs.fig13 (--quick, --requests N, --instances N, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-results}"
shift || true
[ "${1:-}" = "--" ] && shift
mkdir -p "$out"
venv="${LLUMNIX_VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
    LLUMNIX_EXTRAS="${LLUMNIX_EXTRAS:-test}" bash scripts/install.sh
fi
if ! "$venv/bin/python" -c "import matplotlib" 2>/dev/null; then
    "$venv/bin/python" -m pip install --quiet "matplotlib>=3.8"
fi
"$venv/bin/python" -m llumnixctl.figs.fig13 --out "$out" "$@"
