#!/usr/bin/env bash
# Set up, start a local cluster (manager, 2 sim instances, proxy on :8000), send it a streamed chat
# request with the official openai client, and show `llumnixctl status`. The cluster keeps running.
set -euo pipefail
cd "$(dirname "$0")/.."
LLUMNIX_EXTRAS=${LLUMNIX_EXTRAS:-test} bash scripts/install.sh  # the sim engine needs no vLLM
RUN_DIR=${LLUMNIX_RUN_DIR:-$PWD/.llumnix-run}
PORT=${PORT:-8000}
ctl() { .venv/bin/llumnixctl "$@"; }

if [ -f "$RUN_DIR/cluster.json" ]; then
  ctl down --run-dir "$RUN_DIR" >/dev/null 2>&1 || true
fi
ctl up --instances 2 --backend sim --port "$PORT" --run-dir "$RUN_DIR"

echo
echo "== a streamed chat request through the proxy (openai client) =="
.venv/bin/python - "$PORT" <<'PY'
import sys
from openai import OpenAI

client = OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="unused")
stream = client.chat.completions.create(
    model="llumnix-sim",
    messages=[{"role": "user", "content": "Tell me about live migration of KV caches."}],
    max_tokens=24,
    stream=True,
    stream_options={"include_usage": True},
)
request_id = None
for chunk in stream:
    request_id = chunk.id
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
    if chunk.usage:
        print(f"\n[request {request_id}: {chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens]")
PY

echo
echo "== llumnixctl status =="
ctl status --run-dir "$RUN_DIR"
echo
echo "The cluster keeps running (the sim engine: no model, a latency model and real KV-shaped tensors)."
echo "  API:  http://127.0.0.1:$PORT/v1    stop: .venv/bin/llumnixctl down --run-dir $RUN_DIR"
