"""``llumnixctl bench engine``: vLLM through the whole cluster against vLLM alone.

Three runs of one checkpoint with the same settings (eager, the ``[vllm]`` kernel choice and OpenMP
threads, ``--batch`` sequences, a 256 MiB KV cache, no prefix caching), one after the other so that they
never share the cores:

- offline: vLLM's ``LLM.generate`` in a child process, every prompt handed over at once (the ceiling);
- api_server: vLLM's own OpenAI server (``vllm.entrypoints.openai.api_server``), what people deploy;
- cluster: a local cluster (proxy, manager, one ``vllm`` instance).

The two servers are measured with the same streaming client (``proxy_short.stream_load``): one greedy stream of
``--tokens``, then ``--batch`` concurrent streams of ``--batch-tokens``, all with ``ignore_eos``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated

import httpx
import psutil
import typer
from rich.console import Console
from rich.table import Table

from llumnixctl.experiments.bench.budget import (DEFAULT_BUDGET_S, STOP_RESERVE_S, Budget, BudgetOpt, JsonOpt, Progress,
                                                 emit, estimate)
from llumnixctl.experiments.bench.cluster import start_cluster

# What the api_server run and the cluster run take against the offline run (start-up included), to weigh the
# api_server run against --budget-s (see command).
API_SERVER_VS_OFFLINE = 2.5
CLUSTER_VS_OFFLINE = 1.3
from llumnixctl.experiments.bench.proxy_short import stream_load
from llumnixctl.lab import localcluster
from llumnixctl.lab.procs import stop
from llumnixctl.lab.scratch import scratch_dir

PROMPT = [5, 17, 300, 42, 7, 99, 12, 8]
KV_CACHE_BYTES = 256 << 20
# The context limit on all three sides (the cluster's default; a checkpoint's own may be longer, and vLLM refuses
# one that does not fit in the KV cache: SmolLM2's 8192 in float32)
MAX_MODEL_LEN = 4096

# Offline vLLM in a child process: vLLM sets process-wide state (threads, seeds, torch.distributed).
_OFFLINE = r"""
import json, sys, time
from daemons.config import VllmConfig
from daemons.engine.vllm_internals import apply_workarounds
a = json.loads(sys.argv[1])
cfg = VllmConfig(**a["vllm"])
apply_workarounds(cfg)
from vllm import LLM, SamplingParams
t0 = time.perf_counter()
llm = LLM(model=a["model"], enforce_eager=True, dtype=cfg.dtype, block_size=cfg.block_size, seed=0, max_model_len=a["max_model_len"],
          max_num_seqs=cfg.max_num_seqs, kv_cache_memory_bytes=cfg.kv_cache_bytes or None,
          enable_prefix_caching=cfg.enable_prefix_caching)
start = time.perf_counter() - t0
import os
def rate(n_req, n_tok):
    sp = SamplingParams(temperature=0, max_tokens=n_tok, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(a["prompt"])} for _ in range(n_req)]
    t, c = time.perf_counter(), os.times()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall, c2 = time.perf_counter() - t, os.times()
    return sum(len(o.outputs[0].token_ids) for o in outs) / wall, (c2.user + c2.system - c.user - c.system) / wall
rate(1, 8)
single = max(rate(1, a["tokens"])[0] for _ in range(a["repeat"]))
batched, cores = max(rate(a["batch"], a["batch_tokens"]) for _ in range(a["repeat"]))
print(json.dumps({"start_s": start, "single": single, "batched": batched, "cores": cores}))
"""

# vLLM's server with the instance's environment and kernel choice (the same process-wide fixes), then
# its own entry point as ``python -m`` would run it.
_API_SERVER = r"""
import json, runpy, sys
from daemons.config import VllmConfig
from daemons.engine.vllm_internals import apply_workarounds
cfg = VllmConfig(**json.loads(sys.argv.pop(1)))
apply_workarounds(cfg)
import os
os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # set_env's in-process core is ours; the server runs vLLM's way
runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
"""


class BenchError(Exception):
    """A reference run that did not come up; the message says why."""


def _cpu(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            total += sum(p.cpu_times()[:2])
        except psutil.NoSuchProcess:
            continue
    return total


def measure(url: str, procs: list[psutil.Process], tokens: int, batch: int, batch_tokens: int, repeat: int) -> dict:
    """Tokens/s of one greedy stream and of ``batch`` concurrent ones (the best of ``repeat`` each), and the
    cores ``procs`` kept busy during the best batched run."""

    asyncio.run(stream_load(url, "bench", 1, 1, 8, PROMPT, 0.0))  # warm-up
    single = 0.0
    for _ in range(repeat):
        t = time.perf_counter()
        single = max(single, asyncio.run(stream_load(url, "bench", 1, 1, tokens, PROMPT, 0.0)) / (time.perf_counter() - t))
    batched, cores = 0.0, 0.0
    for _ in range(repeat):
        t, cpu = time.perf_counter(), _cpu(procs)
        n = asyncio.run(stream_load(url, "bench", batch, batch, batch_tokens, PROMPT, 0.0))  # greedy, as offline
        wall = time.perf_counter() - t
        batched, cores = max((batched, cores), (n / wall, (_cpu(procs) - cpu) / wall))
    return {"single": single, "batched": batched, "cores": cores}


def offline_run(path: Path, vllm: dict, tokens: int, batch: int, batch_tokens: int, repeat: int) -> dict:
    args = {"model": str(path), "vllm": vllm, "prompt": PROMPT, "tokens": tokens, "batch": batch,
            "batch_tokens": batch_tokens, "repeat": repeat, "max_model_len": MAX_MODEL_LEN}
    child = subprocess.run([sys.executable, "-c", _OFFLINE, json.dumps(args)], capture_output=True, text=True)
    if child.returncode != 0:
        raise BenchError(f"the offline vLLM run failed:\n{child.stderr[-2000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def start_api_server(path: Path, vllm: dict, run_dir: Path, timeout_s: float = 300.0) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server on ``path`` as model ``bench``, listening on 127.0.0.1; returns once /health
    answers. Its output goes to ``run_dir/api_server.log``."""
    url = f"http://127.0.0.1:{localcluster.free_port()}"
    argv = [sys.executable, "-c", _API_SERVER, json.dumps(vllm), "--model", str(path), "--served-model-name", "bench",
            "--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1], "--enforce-eager", "--seed", "0",
            "--distributed-executor-backend", "uni",  # the executor an instance runs (in the engine core process)
            "--block-size", str(vllm["block_size"]), "--max-num-seqs", str(vllm["max_num_seqs"]),
            "--dtype", vllm.get("dtype", "auto"), "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(vllm["kv_cache_bytes"]),
            "--enable-prefix-caching" if vllm.get("enable_prefix_caching") else "--no-enable-prefix-caching",
            "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    log = run_dir / "api_server.log"
    proc = popen_api_server(argv, log, env)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise BenchError(f"vLLM's api_server exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_api_server(proc)
            raise BenchError(f"vLLM's api_server was not healthy within {timeout_s:g}s:\n{log.read_text()[-2000:]}")
        try:
            proc.wait(0.5)  # its exit, or half a second before asking /health again
        except subprocess.TimeoutExpired:
            pass


def router_argv(binary: str, port: int, policy: str, worker_urls: list[str]) -> list[str]:
    """The command line of a router (vllm-router, smg: its ``launch`` command) on 127.0.0.1:``port`` in front of
    ``worker_urls`` with ``policy``."""
    launch = ["launch"] if Path(binary).name == "smg" else []
    return [binary, *launch, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
            "--worker-urls", *worker_urls]


def start_router(argv: list[str], url: str, log: Path, timeout_s: float = 120.0) -> subprocess.Popen:
    """A router in front of api_servers (vllm-router, smg): started with ``argv`` (its output to ``log``),
    returned once ``url``/v1/models answers; stopped (by pid) if it does not."""
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_api_server(proc)
            raise BenchError(f"{Path(argv[0]).name} did not come up: {log.read_text()[-2000:]}")
        time.sleep(0.5)


def _tree(proc: subprocess.Popen) -> list[psutil.Process]:
    """The server and its engine core process (vLLM runs the core in a child)."""
    try:
        root = psutil.Process(proc.pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


# vLLM's server binds its ZeroMQ sockets as files under VLLM_RPC_BASE_PATH (default: the temporary directory)
# and leaves them there when it is stopped: each server started here gets a directory of its own, which
# stop_api_server removes. By the server's pid.
_ipc_dirs: dict[int, str] = {}


def popen_api_server(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """Start vLLM's server (``argv``) in a session of its own, its output to ``log``; stop it with
    ``stop_api_server``. What it writes in the temporary directory goes in one of its own, removed when it is
    stopped: its ZeroMQ sockets (VLLM_RPC_BASE_PATH) and the rest (TMPDIR: its engine's torch.distributed
    FileStore, vllm_dist_*, stays where the process that made it is killed)."""
    ipc = tempfile.mkdtemp(prefix="vllm-ipc-")
    try:
        with open(log, "wb") as f:
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT,
                                    env={**env, "VLLM_RPC_BASE_PATH": ipc, "TMPDIR": ipc}, start_new_session=True)
    except BaseException:
        shutil.rmtree(ipc, ignore_errors=True)
        raise
    _ipc_dirs[proc.pid] = ipc
    return proc


def stop_api_server(proc: subprocess.Popen, children: list[psutil.Process] | None = None) -> None:
    """By pid: the server, then its children (``children``: as noted while it ran) if they outlived it; then
    the directory of its socket files, when ``popen_api_server`` started it."""
    stop([proc], 20, _tree(proc)[1:] or (children or []))
    ipc = _ipc_dirs.pop(proc.pid, None)
    if ipc is not None:
        shutil.rmtree(ipc, ignore_errors=True)


def api_server_run(path: Path, vllm: dict, run_dir: Path, tokens: int, batch: int, batch_tokens: int,
                   repeat: int) -> dict:
    t0 = time.perf_counter()
    proc, url = start_api_server(path, vllm, run_dir)
    try:
        return {"up_s": time.perf_counter() - t0, **measure(url, _tree(proc), tokens, batch, batch_tokens, repeat)}
    finally:
        stop_api_server(proc)


def cluster_run(path: Path, vllm: dict, run_dir: Path, tokens: int, batch: int, batch_tokens: int,
                repeat: int) -> dict:
    sets = [f"model.path={path.resolve()}", "model.name=bench", f"vllm.max_num_seqs={vllm['max_num_seqs']}",
            f"vllm.kv_cache_bytes={vllm['kv_cache_bytes']}", f"vllm.dtype={vllm.get('dtype', 'auto')}",
            f"model.max_model_len={MAX_MODEL_LEN}",
            "instance.log_level=warning", "proxy.log_level=warning"]
    t0 = time.perf_counter()
    state = start_cluster(run_dir, 1, "vllm", sets, timeout_s=300)
    up_s = time.perf_counter() - t0
    try:
        inst = next(p for p in state.procs if p.name.startswith("instance")).process()
        figures = measure(state.url, [inst], tokens, batch, batch_tokens, repeat)
        return {"up_s": up_s, "rss": inst.memory_info().rss, **figures}
    finally:
        localcluster.stop(state)


def _ratio(a: float, b: float | None) -> float | None:
    return a / b if b else None


def result_of(cluster: dict, offline: dict, api: dict | None, model: Path | None, tokens: int, batch: int,
              batch_tokens: int, repeat: int, dtype: str = "auto") -> dict:
    """The JSON: the keys scripts already read, plus the api_server's figures and ratios to it."""
    res = {
        "offline_engine_start_s": offline["start_s"], "cluster_up_s": cluster["up_s"],
        "instance_rss_mib": cluster["rss"] / 2**20,
        "batch": batch, "tokens": tokens, "batch_tokens": batch_tokens, "model": str(model or "tiny (random)"),
        "repeat": repeat, "api_server_up_s": api["up_s"] if api else None, "dtype": dtype,
    }
    for key, k in (("single_stream_tokens_per_s", "single"), ("batched_tokens_per_s", "batched")):
        res[key] = {"cluster": cluster[k], "offline": offline[k], "ratio": cluster[k] / offline[k],
                    "api_server": api[k] if api else None,
                    "ratio_api_server": _ratio(cluster[k], api[k] if api else None)}
    res["batched_cores_used"] = {"instance": cluster["cores"], "offline": offline["cores"],
                                 "api_server": api["cores"] if api else None}
    return res


def _fmt(x: float | None, spec: str) -> str:
    return "" if x is None else format(x, spec)


def print_table(res: dict) -> None:
    table = Table(title=f"vLLM through the cluster vs vLLM alone · {psutil.cpu_count()} cores · model {res['model']}")
    for col in ("measure", "cluster", "offline vLLM", "ratio", "vLLM api_server", "ratio"):
        table.add_column(col, justify="left" if col == "measure" else "right")
    s, b = res["single_stream_tokens_per_s"], res["batched_tokens_per_s"]
    for label, r in ((f"single stream ({res['tokens']} tokens), tokens/s", s),
                     (f"batched ({res['batch']} x {res['batch_tokens']} tokens), tokens/s", b)):
        table.add_row(label, f"{r['cluster']:.0f}", f"{r['offline']:.0f}", f"{r['ratio']:.2f}",
                      _fmt(r["api_server"], ".0f"), _fmt(r["ratio_api_server"], ".2f"))
    c = res["batched_cores_used"]
    table.add_row("start (cluster up / offline engine / api_server up), s", f"{res['cluster_up_s']:.1f}",
                  f"{res['offline_engine_start_s']:.1f}", "", _fmt(res["api_server_up_s"], ".1f"), "")
    table.add_row("cores busy during the batched run", f"{c['instance']:.2f}", f"{c['offline']:.2f}", "",
                  _fmt(c["api_server"], ".2f"), "")
    table.add_row("instance RSS, MiB", f"{res['instance_rss_mib']:.0f}", "", "", "", "")
    Console().print(table)


def command(
    model: Annotated[Path | None, typer.Option(metavar="DIR", help="checkpoint directory (default: a tiny random model)")] = None,
    tokens: Annotated[int, typer.Option(help="output tokens of the single stream")] = 256,
    batch: Annotated[int, typer.Option(help="concurrent streams of the batched run")] = 32,
    batch_tokens: Annotated[int, typer.Option(help="output tokens per batched stream")] = 256,
    api_server: Annotated[bool, typer.Option("--api-server/--no-api-server", help="also measure vLLM's own OpenAI server")] = True,
    repeat: Annotated[int, typer.Option(help="runs of each measure; the best counts (shared cores are noisy)", min=1)] = 1,
    json_: JsonOpt = False,
    dtype: Annotated[str, typer.Option(metavar="auto|float32|bfloat16|float16", help="weights and activations on all three sides (vllm.dtype; auto: the checkpoint's). On a CPU without bf16 instructions float32 runs a bf16 checkpoint's prefill and batched steps about ten times faster")] = "auto",
    budget_s: BudgetOpt = DEFAULT_BUDGET_S,
) -> None:
    """vLLM through the whole cluster (proxy, manager, one instance) against vLLM's offline run and its api_server.
    The api_server run is skipped when it would not leave room in --budget-s for the cluster run (estimated from
    the offline run: 2.5 and 1.3 times as long); --json then says so in skipped."""
    budget = Budget(budget_s)
    from daemons.config import VllmConfig
    from llumnixctl.lab.model import write_tiny_model

    run_dir = scratch_dir("llumnix-bench-")
    path = model or write_tiny_model(run_dir / "tiny-llama")
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        Console(stderr=True).print(f"llumnixctl: unknown --dtype {dtype!r}; choose auto, float32, bfloat16 or float16")
        raise typer.Exit(2)
    cfg = VllmConfig(max_num_seqs=max(batch, 1), kv_cache_bytes=KV_CACHE_BYTES, dtype=dtype)  # prefix caching off on all sides
    vllm = {"max_num_seqs": cfg.max_num_seqs, "kv_cache_bytes": cfg.kv_cache_bytes, "block_size": cfg.block_size,
            "dtype": cfg.dtype}
    err = Console(stderr=True)
    progress = Progress(2 + api_server, start=budget.t0)
    try:
        progress.step("offline vLLM")
        budget.always()
        t0 = time.monotonic()
        err.print("offline vLLM run ...")
        offline = offline_run(path, vllm, tokens, batch, batch_tokens, repeat)
        offline_s = estimate([(1.0, time.monotonic() - t0)])
        api = None
        if api_server:
            # Every side runs the same requests, but the servers start slower than the offline engine: measured
            # here (load average 8-10) offline 57 s in all, api_server 140 s (126 of them its start), cluster 72 s.
            if budget.consider({"run": "api_server"}, API_SERVER_VS_OFFLINE * offline_s,
                               CLUSTER_VS_OFFLINE * offline_s + STOP_RESERVE_S):
                progress.step("vLLM api_server")
                err.print("vLLM api_server run ...")
                api = api_server_run(path, vllm, run_dir, tokens, batch, batch_tokens, repeat)
            else:
                progress.skipped("vLLM api_server", budget.skipped[-1]["reason"])
        progress.step("cluster")  # the subject: always measured
        err.print("cluster run ...")
        cluster = cluster_run(path, vllm, run_dir, tokens, batch, batch_tokens, repeat)
    except BenchError as exc:
        err.print(f"llumnixctl: {exc}", markup=False)
        raise typer.Exit(1) from None
    finally:
        progress.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    res = {**result_of(cluster, offline, api, model, tokens, batch, batch_tokens, repeat, dtype), **budget.fields()}
    emit(res, json_, print_table, lambda s: f"the {s['run']} run")
