#!/usr/bin/env bash
# Create .venv and install the toolkit with its test extras. Idempotent: a second run only checks.
# torch is pinned to 2.13.0; where a local CPU wheel directory exists (/opt/wheels, or $LLUMNIX_WHEELS)
# pip takes it from there, so no CUDA build is ever downloaded on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
EXTRAS=${LLUMNIX_EXTRAS:-test}
WHEELS=${LLUMNIX_WHEELS:-/opt/wheels}

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
find_links=()
if [ -d "$WHEELS" ]; then
  find_links=(--find-links "$WHEELS")
fi
if ! .venv/bin/python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  echo "installing torch 2.13.0 ..." >&2
  cpu_wheel=$(ls "$WHEELS"/torch-2.13.0+cpu-*.whl 2>/dev/null | head -n1 || true)
  if [ -n "$cpu_wheel" ]; then
    "${PIP[@]}" install "${find_links[@]}" "$cpu_wheel"
  else
    "${PIP[@]}" install "${find_links[@]}" "torch==2.13.0"
  fi
fi
echo "installing llumnix-toolkit[$EXTRAS] ..." >&2
"${PIP[@]}" install "${find_links[@]}" -e ".[$EXTRAS]"
