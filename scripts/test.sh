#!/usr/bin/env bash
# Set up (scripts/install.sh) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest -q "$@"
