"""JSON mode, JSON schema, vLLM's structured_outputs and tool calls: the same requests, sent with the official
``openai`` client to vLLM's own OpenAI server (``vllm.entrypoints.openai.api_server``) and to a llumnix cluster
of one vllm instance on the same checkpoint and engine settings, give the same outputs (greedy). Then the cost
of structured output on each: TTFT and decode tokens/s of streamed requests with and without a JSON schema.

    .venv/bin/python scripts/structured_vs_vllm.py [--model DIR] [--runs 8] [--json OUT]

Without --model it writes the tiny random-weight model (``llumnixctl model tiny``): a grammar constrains any
model, so validity and identity do not need real weights. Both servers run on 127.0.0.1 with float32 weights
(no AMX kernel question), block size 32, no prefix caching, JSON without free whitespace (xgrammar), and vLLM's
server with ``--tool-parser NAME`` given: ``--tool-call-parser NAME --enable-auto-tool-choice`` (its required/named
tool choice needs a parser whose tokens the vocabulary has; the tiny model's has none, so without it the
tool-call cases are left out). Run it alone: it starts two engines
(``flock /tmp/llumnix-heavy.lock`` on a shared machine). Exit status 1 when an output differs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llumnixctl.lab import localcluster  # noqa: E402
from llumnixctl.experiments.bench.engine import popen_api_server, stop_api_server  # noqa: E402
from llumnixctl.lab.ports import free_port  # noqa: E402
from llumnixctl.lab.scratch import kept_if, scratch_dir  # noqa: E402

NAME = "m"
ENGINE = {"dtype": "float32", "block_size": 32, "kv_cache_bytes": 64 << 20, "max_num_seqs": 8, "max_model_len": 1024}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "rain": {"type": "boolean"}, "temp": {"type": "integer", "minimum": -50,
                                                                                 "maximum": 60}},
          "required": ["city", "rain", "temp"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "JST"]}},
             "required": ["zone"]}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]
PROMPT = "The weather in Paris, as JSON: "


def cases() -> list[tuple[str, str, dict]]:
    """(name, endpoint, arguments of the openai client's create) for every check."""
    g = {"model": NAME, "temperature": 0, "max_tokens": 120}
    schema_rf = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    named = {"type": "function", "function": {"name": "get_weather"}}
    return [
        ("chat json_object", "chat", {**g, "messages": MESSAGES, "response_format": {"type": "json_object"},
                                      "max_tokens": 40}),
        ("chat json_schema", "chat", {**g, "messages": MESSAGES, "response_format": schema_rf}),
        ("chat json_schema streamed", "chat", {**g, "messages": MESSAGES, "response_format": schema_rf,
                                               "stream": True}),
        ("completion json_schema", "completion", {**g, "prompt": PROMPT, "extra_body": {"response_format": schema_rf}}),
        ("completion regex", "completion", {**g, "prompt": PROMPT,
                                            "extra_body": {"structured_outputs": {"regex": "[A-Z][a-z]{2,9}, [0-9]{1,2}C"}}}),
        ("completion choice", "completion", {**g, "prompt": PROMPT,
                                             "extra_body": {"structured_outputs": {"choice": ["sunny", "rainy", "cloudy"]}}}),
        ("chat grammar", "chat", {**g, "messages": MESSAGES,
                                  "extra_body": {"structured_outputs": {"grammar": 'root ::= "temp=" [0-9] [0-9]?'}}}),
        ("chat tool_choice required", "chat", {**g, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}),
        ("chat tool_choice required, one call", "chat", {**g, "messages": MESSAGES, "tools": TOOLS,
                                                        "tool_choice": "required", "parallel_tool_calls": False}),
        ("chat tool_choice named", "chat", {**g, "messages": MESSAGES, "tools": TOOLS, "tool_choice": named}),
        ("chat tool_choice named streamed", "chat", {**g, "messages": MESSAGES, "tools": TOOLS, "tool_choice": named,
                                                     "stream": True}),
        ("chat tool_choice required streamed", "chat", {**g, "messages": MESSAGES, "tools": TOOLS,
                                                        "tool_choice": "required", "stream": True}),
    ]


def answer(client, endpoint: str, args: dict) -> dict:
    """What a response says, ids left out (or the error it got)."""
    try:
        return _answer(client, endpoint, args)
    except Exception as exc:  # noqa: BLE001 -- a refusal is an answer to compare too
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}


def _answer(client, endpoint: str, args: dict) -> dict:
    """Text or content, tool calls (name, arguments), finish reason."""
    create = client.chat.completions.create if endpoint == "chat" else client.completions.create
    if not args.get("stream"):
        c = create(**args).choices[0]
        if endpoint == "completion":
            return {"text": c.text, "finish_reason": c.finish_reason}
        calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        return {"content": c.message.content or "", "tool_calls": calls, "finish_reason": c.finish_reason}
    content, calls, finish = "", {}, None
    for chunk in create(**args):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            name, arguments = calls.get(t.index, ("", ""))
            calls[t.index] = (name + (t.function.name or ""), arguments + (t.function.arguments or ""))
        finish = chunk.choices[0].finish_reason or finish
    return {"content": content, "tool_calls": [calls[i] for i in sorted(calls)], "finish_reason": finish}


def normalize(a: dict) -> dict:
    """Tool-call arguments compared as JSON values: vLLM re-serializes "required" calls' parameters."""
    out = dict(a)
    if "tool_calls" in out:
        out["tool_calls"] = [(n, _json_or_text(args)) for n, args in out["tool_calls"]]
    return out


def _json_or_text(s: str):
    try:
        return json.loads(s)
    except ValueError:
        return s


def timing(url: str, endpoint: str, body: dict, runs: int) -> dict:
    """TTFT and decode tokens/s of streamed requests, sequential (medians)."""
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    ttft, rate, tokens = [], [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        first = last = None
        n = 0
        with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if not chunk.get("choices"):
                    continue
                ch = chunk["choices"][0]
                piece = ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    n += 1  # a chunk per token on both servers (one token a step)
        ttft.append((first - t0) * 1000)
        tokens.append(n)
        if n > 1:
            rate.append((n - 1) / (last - first))
    return {"ttft_ms": round(statistics.median(ttft), 1), "decode_tok_s": round(statistics.median(rate), 1),
            "tokens": statistics.median(tokens)}


def start_vllm(model: Path, port: int, log: Path, tool_parser: str) -> subprocess.Popen:
    so = json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", NAME, "--dtype", ENGINE["dtype"], "--block-size",
            str(ENGINE["block_size"]), "--kv-cache-memory-bytes", str(ENGINE["kv_cache_bytes"]), "--max-num-seqs",
            str(ENGINE["max_num_seqs"]), "--max-model-len", str(ENGINE["max_model_len"]), "--enforce-eager",
            "--no-enable-prefix-caching", "--seed", "0", "--structured-outputs-config", so]
    if tool_parser:
        argv += ["--tool-call-parser", tool_parser, "--enable-auto-tool-choice"]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    return popen_api_server(argv, log, env)


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"vLLM's server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"vLLM's server did not start in {timeout:g}s:\n{log.read_text()[-3000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="checkpoint directory (default: write the tiny random model)")
    ap.add_argument("--runs", type=int, default=8, help="streamed requests per timing figure")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--tool-parser", default="", help="vLLM's --tool-call-parser (its required/named tool choice "
                    "needs one whose tokens the model's vocabulary has; the tiny model has none): without it the "
                    "tool-call cases are not compared")
    opts = ap.parse_args()
    from openai import OpenAI

    work = scratch_dir("llumnix-structured-")
    model = opts.model
    if model is None:
        from llumnixctl.lab.model import write_tiny_model

        model = write_tiny_model(work / "tiny")
    results: dict = {"model": str(model), "cases": [], "timing": {}}
    schema_rf = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    timed = {"plain": {"model": NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True},
             "json_schema": {"model": NAME, "prompt": PROMPT, "max_tokens": 120, "temperature": 0,
                             "response_format": schema_rf}}
    # vLLM's server first, alone; then ours, alone: each timing on an otherwise idle machine.
    port = free_port()
    vllm_url = f"http://127.0.0.1:{port}"
    proc = start_vllm(model, port, work / "vllm.log", opts.tool_parser)
    checks = [c for c in cases() if opts.tool_parser or "tool_choice" not in c[0]]
    try:
        wait_ready(vllm_url, proc, work / "vllm.log")
        client = OpenAI(base_url=vllm_url + "/v1", api_key="x", max_retries=0)
        theirs = {name: answer(client, ep, args) for name, ep, args in checks}
        results["timing"]["vllm api_server"] = {k: timing(vllm_url, "completion", b, opts.runs) for k, b in timed.items()}
    finally:
        stop_api_server(proc)  # and its engine core process, by pid
    sets = [f"model.path={model}", f"model.name={NAME}", f"model.max_model_len={ENGINE['max_model_len']}",
            f"vllm.dtype={ENGINE['dtype']}", f"vllm.block_size={ENGINE['block_size']}",
            f"vllm.kv_cache_bytes={ENGINE['kv_cache_bytes']}", f"vllm.max_num_seqs={ENGINE['max_num_seqs']}",
            "vllm.disable_any_whitespace=true", "instance.log_level=warning", "proxy.log_level=warning"]
    with kept_if(work, localcluster.ClusterError):  # its error points at the daemons' logs there
        state = localcluster.up(work / "cluster", 1, "vllm", 0, None, sets, timeout_s=300)
    try:
        client = OpenAI(base_url=state.url + "/v1", api_key="x", max_retries=0)
        ours = {name: answer(client, ep, args) for name, ep, args in checks}
        results["timing"]["llumnix cluster"] = {k: timing(state.url, "completion", b, opts.runs)
                                                for k, b in timed.items()}
    finally:
        localcluster.stop(state)
    same_all = True
    for name, _, _ in checks:
        same = normalize(ours[name]) == normalize(theirs[name])
        same_all &= same
        results["cases"].append({"case": name, "same": same, "llumnix": ours[name], "vllm": theirs[name]})
        print(f"{'same' if same else 'DIFFERENT':9} {name}: {json.dumps(ours[name])[:150]}")
        if not same:
            print(f"          vLLM's server: {json.dumps(theirs[name])[:150]}")
    for server, figures in results["timing"].items():
        for kind, f in figures.items():
            print(f"{server:16} {kind:11} TTFT {f['ttft_ms']:7.1f} ms  decode {f['decode_tok_s']:6.1f} tok/s "
                  f"({f['tokens']:.0f} tokens)")
    results["same"] = same_all
    if opts.json:
        opts.json.write_text(json.dumps(results, indent=2))
    return 0 if same_all else 1


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # timeout(1): leave through the finally blocks, as on Ctrl-C
    sys.exit(main())
