# Sourced by the figure scripts (scripts/fig11.sh ... bursts.sh), with their arguments: goes to the
# repository, takes OUT_DIR (default results/) off the arguments (and a "--" after it), and makes sure
# .venv (scripts/install.sh) and matplotlib are there. Sets $out and $venv.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-results}"
shift || true
if [ "${1:-}" = "--" ]; then
    shift
fi
mkdir -p "$out"
venv="${LLUMNIX_VENV:-.venv}"
if [ ! -x "$venv/bin/llumnixctl" ]; then
    LLUMNIX_EXTRAS="${LLUMNIX_EXTRAS:-test}" bash scripts/install.sh
fi
if ! "$venv/bin/python" -c "import matplotlib" 2>/dev/null; then
    "$venv/bin/python" -m pip install --quiet "matplotlib>=3.8"
fi
