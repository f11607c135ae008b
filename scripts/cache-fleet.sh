#!/usr/bin/env bash
# Cache-aware dispatch in a fleet (issue #24), in virtual time (llumnixctl.experiments.sim.simulate with
# sim.prefix_caching: the daemons' own manager, prefix index, policies and sim engine; an estimated
# LLaMA-7B-on-A10 instance, llumnixctl/experiments/figs/common.py PAPER_LIKE): llumnix-cache vs llumnix vs
# infaas++ vs an oracle at 16 and 64 instances on shared-prefix and multi-turn traces, the hotspot case, and
# the never-worse sweep on unique prompts.
#
#   bash scripts/cache-fleet.sh [OUT_DIR] [-- ARGS...]   -> OUT_DIR/cache-fleet.json, .png (default: ./results)
#
# ARGS go to python -m llumnixctl.experiments.figs.cache (--quick, --parts fleet,sweep,hotspot, --fleet 16,64,
# --rates ..., --mt-rates ..., --requests N). The whole run takes about an hour on a 2-core machine; 16
# instances alone (--fleet 16) about 15 minutes.
set -euo pipefail
source "$(dirname "$0")/figure-env.sh"  # the repository, $out (default results/), .venv with matplotlib
"$venv/bin/python" -m llumnixctl.experiments.figs.cache --out "$out" "$@"
echo "wrote $out/cache-fleet.json and $out/cache-fleet.png"
