#!/usr/bin/env bash
# Reproduce the Llumnix paper's Fig 10 (live migration vs blocking copy vs recomputation, per sequence
# length) on this machine: two vLLM instances on a generated KV-heavy model (or MODEL=/path/to/checkpoint).
#
#   bash scripts/fig10.sh [OUT_DIR]        -> OUT_DIR/fig10.json, OUT_DIR/fig10.png (default: ./fig10)
#
# Environment: LENGTHS (default 256,512,1024,2048,4096,8192), BACKEND (vllm or sim), MODEL.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-fig10}"
mkdir -p "$out"
venv="${LLUMNIX_VENV:-.venv}"
if [ ! -x "$venv/bin/llumnixctl" ]; then
    LLUMNIX_EXTRAS="${LLUMNIX_EXTRAS:-test,vllm}" bash scripts/install.sh
fi
if ! "$venv/bin/python" -c "import matplotlib" 2>/dev/null; then
    "$venv/bin/python" -m pip install --quiet "matplotlib>=3.8"
fi
# --budget-s 0: every length, however long it takes (the benchmark's default budget skips what exceeds 4 minutes)
args=(bench migration --backend "${BACKEND:-vllm}" --lengths "${LENGTHS:-256,512,1024,2048,4096,8192}" --json --budget-s 0)
if [ -n "${MODEL:-}" ]; then
    args+=(--model "$MODEL")
fi
HF_HUB_OFFLINE=1 "$venv/bin/llumnixctl" "${args[@]}" > "$out/fig10.json"
"$venv/bin/python" scripts/plot_fig10.py "$out/fig10.json" "$out/fig10.png"
echo "wrote $out/fig10.json and $out/fig10.png"
