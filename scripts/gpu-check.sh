#!/usr/bin/env bash
# The GPU check, for a CUDA node (one GPU is enough: the two instances of each step share it). First what needs
# only CUDA torch: our KV copy path with the KV on the GPU (every vLLM KV layout, partial blocks, tensor-parallel
# shards, over real Gloo pairs: tests/unit/test_kv_devices.py and test_tp_transfer.py) and its speed
# (scripts/kv-bench.py). Then, with CUDA vLLM in the venv: our engine must give vLLM's own offline tokens and
# logprobs (engine-identity: tests/e2e/test_vllm_engine.py); live migration between two vLLM instances must
# stream exactly what an unmigrated run streams (llumnixctl check migration), also with tensor parallelism when
# two or more GPUs are visible and with prefix caching on; a saturating bursty trace must fail no request
# (bench steady); then the Fig 10 figures (bench migration), at TP 1 and, with two or more GPUs, at TP 2, with
# the TP2/TP1 downtime ratio per length.
#
#   bash scripts/gpu-check.sh [OUT_DIR]      (default OUT_DIR: gpu-check)
#
# Writes OUT_DIR/<step>.json (the step's JSON output, or pytest's report) and OUT_DIR/<step>.log (its standard
# error) per step, OUT_DIR/nvidia-smi.txt, and OUT_DIR/gpu-check.json: {"gpu": nvidia-smi -L lines, "torch",
# "vllm", "steps": {step: {"rc", "result"}}}. Prints one line per step; exits 1 when a step failed, when vLLM
# is missing (its steps are listed as not run), or when there is no GPU.
#
# Environment:
#   MODEL         checkpoint directory for every vLLM step (default: the tiny model for the checks and the
#                 kv-heavy one for the benchmark, generated into OUT_DIR/models by `llumnixctl model tiny`)
#   LLUMNIX_VENV  a venv with CUDA torch, CUDA vLLM and this toolkit (`pip install vllm`, then `pip install -e .`
#                 here; default .venv). This script installs nothing: scripts/install.sh would install CPU
#                 wheels. Without vLLM (a venv made with --system-site-packages over a CUDA torch, with pyzmq,
#                 msgspec and `pip install --no-deps -e .`) the KV steps run and the vLLM steps are not run.
#   TIMEOUT_S     seconds per step (default 900); a step past it gets SIGINT (its cluster is stopped), then
#                 SIGKILL a minute later
#   TOTAL_S       seconds for the whole check (default 3600): a step gets at most what is left; a step that
#                 would start with under a minute left is skipped (exit 124, "out of time")
#   LENGTHS       bench migration --lengths (default: the benchmark's own)
set -euo pipefail
cd "$(dirname "$0")/.."

die() {
    echo "gpu-check: $*" >&2
    exit 1
}

command -v nvidia-smi > /dev/null 2>&1 || die "no nvidia-smi on PATH: not a CUDA node (run this on a machine with an NVIDIA GPU and its driver)"
out="${1:-gpu-check}"
venv="${LLUMNIX_VENV:-.venv}"
timeout_s="${TIMEOUT_S:-900}"
deadline=$((SECONDS + ${TOTAL_S:-3600}))
mkdir -p "$out"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || die "nvidia-smi failed: $(tail -n 1 "$out/nvidia-smi.txt")"
gpu_lines="$(nvidia-smi -L 2> /dev/null | grep '^GPU ' || true)"
[ -n "$gpu_lines" ] || die "nvidia-smi lists no GPU (see $out/nvidia-smi.txt)"
echo "$gpu_lines"
[ -x "$venv/bin/python" ] || die "no $venv/bin/python: set LLUMNIX_VENV to a venv with CUDA torch, CUDA vLLM and this toolkit (pip install vllm; pip install -e .)"
py="$venv/bin/python"
"$py" -c "import torch; assert torch.cuda.is_available()" 2> "$out/torch.log" \
    || die "torch in $venv sees no CUDA GPU (see $out/torch.log): it needs CUDA torch and vLLM, not the CPU wheels"
torch_version="$("$py" -c "import torch; print(f'{torch.__version__} (CUDA {torch.version.cuda})')")"
vllm_version="$("$py" -c "import vllm; print(vllm.__version__)" 2>> "$out/torch.log")" || vllm_version=""
visible="$("$py" -c "import torch; print(torch.cuda.device_count())")"
echo "torch $torch_version, vllm ${vllm_version:-(none)}, $visible GPU(s) visible"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"

steps=()
run_step() {  # run_step NAME COMMAND...: stdout to OUT_DIR/NAME.json, stderr to OUT_DIR/NAME.log
    local name="$1" rc=0 left=$((deadline - SECONDS))
    shift
    steps+=("$name")
    if [ "$left" -lt 60 ]; then
        echo "llumnixctl: out of time (TOTAL_S): skipped" > "$out/$name.log"
        : > "$out/$name.json"
        echo 124 > "$out/$name.rc"
        return
    fi
    [ "$left" -lt "$timeout_s" ] || left="$timeout_s"
    echo "$name: $* ..."
    timeout -s INT -k 60 "$left" "$@" > "$out/$name.json" 2> "$out/$name.log" || rc=$?
    echo "$rc" > "$out/$name.rc"
}
step() {  # step NAME LLUMNIXCTL-ARGS...
    local name="$1"
    shift
    run_step "$name" "$venv/bin/llumnixctl" "$@"
}

# Our KV copy path on the GPU: no vLLM needed.
run_step kv-cuda env LLUMNIX_KV_TEST_DEVICE=cuda "$py" -m pytest -q -p no:cacheprovider -o addopts= \
    tests/unit/test_kv_devices.py tests/unit/test_tp_transfer.py
run_step kv-bench "$py" scripts/kv-bench.py --json --device cuda --layout all --tokens 256,1024,4096,8192

vllm_steps() {  # needs CUDA vLLM and llumnixctl in the venv
    if [ -n "${MODEL:-}" ]; then
        check_model=(--model "$MODEL")
        bench_model=(--model "$MODEL")
    else
        for size in tiny kv-heavy; do
            if [ ! -e "$out/models/$size/config.json" ]; then
                timeout "$timeout_s" "$venv/bin/llumnixctl" model tiny "$out/models/$size" --size "$size" --force >> "$out/models.log" 2>&1 \
                    || die "could not write the $size model into $out/models/$size (see $out/models.log)"
            fi
        done
        check_model=(--model "$out/models/tiny")
        bench_model=(--model "$out/models/kv-heavy")
    fi
    gpu_sets=(--set vllm.block_size=16 --set vllm.omp_threads=0 --set vllm.dtype=bfloat16)

    if "$py" -c "import pytest" 2> /dev/null && [ -f tests/e2e/test_vllm_engine.py ]; then
        run_step engine-identity "$py" -m pytest -q -p no:cacheprovider tests/e2e/test_vllm_engine.py \
            -k "match_offline or matches_offline"
    fi
    step check-migration check migration --json "${check_model[@]}" --set vllm.gpu_memory_utilization=0.4 "${gpu_sets[@]}"
    # The same with vLLM's prefix caching on: a destination that holds a request's prompt prefix takes those
    # blocks from its own cache, and the output must still be identical.
    step check-migration-prefix check migration --json "${check_model[@]}" --set vllm.gpu_memory_utilization=0.4 \
        --set vllm.enable_prefix_caching=true "${gpu_sets[@]}"
    if [ "$visible" -ge 2 ]; then  # two instances of 2 ranks on GPUs 0 and 1: two ranks per GPU
        step check-migration-tp2 check migration --json --tp 2 "${check_model[@]}" \
            --set vllm.gpu_memory_utilization=0.2 "${gpu_sets[@]}"
    fi
    # A saturating bursty trace on two instances sharing the GPU: no request may fail and no instance may be marked
    # dead (liveness by connection); the llumlets' heartbeat lateness and the proxy's refusals are in the JSON.
    step steady bench steady --json --rounds 1 --requests 300 --rate 16 --budget-s 0 "${check_model[@]}" \
        --set vllm.gpu_memory_utilization=0.4 "${gpu_sets[@]}"
    bench=(bench migration --json --budget-s 0 "${bench_model[@]}" --set vllm.gpu_memory_utilization=0.4 --set vllm.omp_threads=0)
    if [ -n "${LENGTHS:-}" ]; then
        bench+=(--lengths "$LENGTHS")
    fi
    step bench-migration "${bench[@]}"
    if [ "$visible" -ge 2 ]; then
        step bench-migration-tp2 "${bench[@]}" --set vllm.tensor_parallel_size=2
    fi
}

if [ -z "$vllm_version" ] || [ ! -x "$venv/bin/llumnixctl" ]; then
    why="vllm does not import in $venv (see $out/torch.log)"
    [ -n "$vllm_version" ] && why="no $venv/bin/llumnixctl (pip install -e . in the venv)"
    steps+=(vllm)
    echo "gpu-check: the vLLM steps did not run: $why" > "$out/vllm.log"
    : > "$out/vllm.json"
    echo 1 > "$out/vllm.rc"
else
    vllm_steps
fi

GPU_LINES="$gpu_lines" TORCH_VERSION="$torch_version" VLLM_VERSION="$vllm_version" \
    "$py" - "$out" "${steps[@]}" << 'EOF'
import json
import os
import sys
from pathlib import Path

out, names = Path(sys.argv[1]), sys.argv[2:]
steps = {}
for name in names:
    text = (out / f"{name}.json").read_text(errors="replace")
    try:
        result = json.loads(text)
    except ValueError:
        result = None
    steps[name] = {"rc": int((out / f"{name}.rc").read_text()), "result": result}
    rc, r = steps[name]["rc"], result
    said = text.strip().splitlines()[-1:] if result is None else []  # pytest's summary line
    if rc == 0 and name == "engine-identity":
        line = "ok: greedy and seeded tokens and logprobs equal vLLM's offline LLM"
    elif rc == 0 and name == "kv-cuda":
        line = f"ok: {said[0] if said else 'passed'}"
    elif rc == 0 and name == "kv-bench":
        line = "ok: " + "; ".join(
            f"{m['layout']}: chunk to host {m['load_gb_s']:.1f} GB/s, back {m['store_gb_s']:.1f} GB/s, "
            + ", ".join(f"{x['tokens']} tokens {x['whole_ms']:.0f} ms ({x['whole_gb_s']:.1f} GB/s), "
                        f"last stage {x['last_ms']:.2f} ms" for x in m["results"]) for m in r["layouts"])
    elif rc == 0 and name.startswith("check-"):
        moves = sum(q["migrations"] for q in r["requests"])
        worst = max(q["downtime_ms"] for q in r["requests"])
        line = f"ok: {len(r['requests'])} requests identical, {moves} migrations, downtime up to {worst:.2f} ms, {r['elapsed_s']:.0f} s"
    elif name == "vllm":
        line = "NOT RUN: " + (out / "vllm.log").read_text().strip().removeprefix("gpu-check: the vLLM steps did not run: ")
    elif rc == 0:
        line = "ok: " + ", ".join(f"{x['tokens']} tokens: downtime {x['downtime_ms']:.2f} ms" for x in r["results"])
    else:
        log = (out / f"{name}.log").read_text(errors="replace").strip().splitlines()
        why = next((x for x in reversed(log) if x.startswith("llumnixctl:")),
                   log[-1] if log else said[0] if said else "no output")
        line = f"FAILED (exit {rc}{', timed out' if rc in (124, 137) else ''}): {why[:300]}"
    print(f"{name}: {line}")
tp1, tp2 = (steps.get(n, {}).get("result") for n in ("bench-migration", "bench-migration-tp2"))
if tp1 and tp2:
    at1 = {x["tokens"]: x["downtime_ms"] for x in tp1["results"]}
    print("downtime  tokens   TP1 ms   TP2 ms   TP2/TP1")
    for x in tp2["results"]:
        if x["tokens"] in at1:
            a, b = at1[x["tokens"]], x["downtime_ms"]
            print(f"          {x['tokens']:>6} {a:>8.2f} {b:>8.2f}   {b / a if a else float('nan'):>6.2f}x")
record = {"gpu": os.environ["GPU_LINES"].splitlines(), "torch": os.environ["TORCH_VERSION"],
          "vllm": os.environ["VLLM_VERSION"] or None, "steps": steps}
(out / "gpu-check.json").write_text(json.dumps(record, indent=2) + "\n")
print(f"wrote {out / 'gpu-check.json'}")
EOF

for name in "${steps[@]}"; do
    [ "$(cat "$out/$name.rc")" = 0 ] || exit 1
done
