#!/usr/bin/env bash
# Soak a local sim cluster (4 instances, 2 proxies): bounded streamed load for DURATION_S seconds (default
# 3600) with random migrations, drains, kill -9 of instances (auto-scaling replaces them; min = max, and
# i0 has instance.scale_in_protected, so no scale-in ever stops the never-killed instance i0), and kill -9 and
# restart of the second proxy and (in the first half of the warm-up only) of the manager, each every ~20-60 s; every
# stream checked token by token; every daemon's RSS, descriptors and sockets sampled every 15 s; then the
# leaked KV blocks and every aborted migration's reason. Writes OUT_DIR/soak.json and OUT_DIR/rss.png
# (default: a new /tmp/llumnix-soak.* directory) and prints a summary; exits non-zero if a request was lost,
# a block leaked, an aborted migration has no explanation, the witnesses' RSS (proxy, instance i0, and the
# manager that lives on after the warm-up) grew 10% or more after the warm-up, or a process outlived
# `llumnixctl down`.
#
#   scripts/soak.sh [DURATION_S] [OUT_DIR]
#
# Environment: SOAK_CONCURRENCY (streams at once, default 8), SOAK_SEED (default 1), SOAK_WARMUP_S (seconds
# before memory is measured, default 900, at most a quarter of the duration), SOAK_SESSIONS (default 0: independent
# prompts; N: N conversations, each request the next turn of one under its prompt_cache_key, on instances with a
# prefix cache of 1024 blocks, a host KV tier of 2 MiB (512 blocks) and retention: a session soak).
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${1:-3600}
OUT=${2:-$(mktemp -d /tmp/llumnix-soak.XXXXXX)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
RUN_DIR="$OUT/run"
PY=.venv/bin/python
CTL=.venv/bin/llumnixctl
export HF_HUB_OFFLINE=1

stopped=0
stop_cluster() {
    if [[ $stopped == 0 && -f "$RUN_DIR/cluster.json" ]]; then
        stopped=1
        echo "soak: stopping the cluster ($RUN_DIR)"
        timeout 120 "$CTL" down --run-dir "$RUN_DIR" || echo "soak: llumnixctl down failed" >&2
    fi
}
driver=""
on_signal() {
    echo "soak: interrupted" >&2
    [[ -n $driver ]] && kill "$driver" 2>/dev/null
    exit 130  # the EXIT trap stops the cluster
}
trap stop_cluster EXIT
trap on_signal INT TERM HUP

echo "soak: ${DURATION}s, output in $OUT"
SESSIONS=${SOAK_SESSIONS:-0}
session_sets=()
if [[ $SESSIONS != 0 ]]; then
    session_sets=(--set sim.prefix_caching=true --set sim.num_blocks=1024 --set kv_tier.host_mb=2)
fi
timeout 180 "$PY" scripts/soak.py up --instances 4 --proxies 2 --run-dir "$RUN_DIR" "${session_sets[@]}" \
    --set manager.heartbeat_interval_s=0.2 --set sim.time_scale=0.1 --set instance.min_step_s=0.02 \
    --set instance.shutdown_grace_s=2 \
    --set scaling.policy=llumnix --set scaling.min_instances=4 --set scaling.max_instances=4 \
    --set scaling.launch_timeout_s=30 --set scaling.cooldown_s=5 --set scaling.sustain_s=10

rc=0
# In the background, so that a signal reaches our trap at once (bash runs traps only between commands).
timeout $(( ${DURATION%.*} + 900 )) "$PY" scripts/soak.py run --run-dir "$RUN_DIR" --duration "$DURATION" \
    --out "$OUT/soak.json" --concurrency "${SOAK_CONCURRENCY:-8}" --seed "${SOAK_SEED:-1}" \
    --warmup "${SOAK_WARMUP_S:-900}" --sessions "$SESSIONS" &
driver=$!
wait "$driver" || rc=$?
driver=""

stop_cluster
if [[ -f "$OUT/soak.json" ]]; then
    "$PY" scripts/soak.py check-stopped --out "$OUT/soak.json" || rc=$(( rc ? rc : 1 ))
    "$PY" scripts/soak.py plot --out "$OUT/soak.json" --png "$OUT/rss.png" || echo "soak: no plot" >&2
else
    echo "soak: no report was written" >&2
    rc=$(( rc ? rc : 1 ))
fi
echo "soak: report in $OUT/soak.json"
exit "$rc"
