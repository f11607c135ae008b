"""``llumnixctl bench engine``'s JSON and options, without running vLLM: the keys scripts read stay, the
api_server's figures and ratios come beside them."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from typer.testing import CliRunner

from llumnixctl.experiments.bench import engine as bench_engine
from llumnixctl.experiments.bench.cli import app

CLUSTER = {"up_s": 30.0, "rss": 800 * 2**20, "single": 150.0, "batched": 900.0, "cores": 0.9}
OFFLINE = {"start_s": 8.0, "single": 100.0, "batched": 1000.0, "cores": 0.8}
API = {"up_s": 60.0, "single": 120.0, "batched": 1200.0, "cores": 1.4}


def test_the_old_keys_stay_and_the_api_server_comes_beside_them():
    res = bench_engine.result_of(CLUSTER, OFFLINE, API, None, 256, 32, 256, 2)
    for key in ("offline_engine_start_s", "cluster_up_s", "instance_rss_mib", "single_stream_tokens_per_s",
                "batched_tokens_per_s", "batched_cores_used", "batch", "tokens", "batch_tokens", "model"):
        assert key in res, key
    s, b = res["single_stream_tokens_per_s"], res["batched_tokens_per_s"]
    assert (s["cluster"], s["offline"], s["ratio"]) == (150.0, 100.0, 1.5)
    assert (b["cluster"], b["offline"], b["ratio"]) == (900.0, 1000.0, 0.9)
    assert (s["api_server"], s["ratio_api_server"]) == (120.0, 1.25)
    assert (b["api_server"], b["ratio_api_server"]) == (1200.0, 0.75)
    assert res["batched_cores_used"] == {"instance": 0.9, "offline": 0.8, "api_server": 1.4}
    assert res["instance_rss_mib"] == 800 and res["api_server_up_s"] == 60.0 and res["model"] == "tiny (random)"


def test_without_the_api_server_its_figures_are_null():
    res = bench_engine.result_of(CLUSTER, OFFLINE, None, None, 256, 32, 256, 1)
    assert res["batched_tokens_per_s"]["api_server"] is None
    assert res["batched_tokens_per_s"]["ratio_api_server"] is None
    assert res["api_server_up_s"] is None and res["batched_cores_used"]["api_server"] is None
    bench_engine.print_table(res)  # renders with the blanks


def test_the_command_keeps_its_options():
    out = CliRunner().invoke(app, ["engine", "--help"], env={"COLUMNS": "200"}).output
    for option in ("--model", "--tokens", "--batch", "--batch-tokens", "--json", "--api-server", "--repeat"):
        assert option in out, option



# A stand-in for vLLM's server: binds a ZeroMQ socket as a file under VLLM_RPC_BASE_PATH, as vLLM does
# (``get_open_zmq_ipc_path``), makes a file in the temporary directory as its engine's FileStore does
# (``get_file_store_init_method``), says where, and ends at SIGTERM without removing either. vLLM's own servers
# left such files in /tmp, a few per run.
_SERVER = r"""
import os, sys, tempfile, uuid, zmq
sock = zmq.Context().socket(zmq.PULL)
path = os.path.join(os.environ["VLLM_RPC_BASE_PATH"], str(uuid.uuid4()))
sock.bind("ipc://" + path)
store = os.path.join(tempfile.gettempdir(), "vllm_dist_" + uuid.uuid4().hex)
open(store, "w").close()
print(path, store, flush=True)
sys.stdin.read()
"""


def test_a_vllm_server_started_here_leaves_no_socket_or_store_file_behind(tmp_path):
    log = tmp_path / "server.log"
    proc = bench_engine.popen_api_server([sys.executable, "-c", _SERVER], log, dict(os.environ))
    try:
        deadline = time.monotonic() + 60
        while not log.read_text().strip():  # bound once its path is printed
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                proc.wait(0.05)
            except subprocess.TimeoutExpired:
                pass
        sock, store = (Path(p) for p in log.read_text().split()[:2])
        assert sock.is_socket() and sock.parent != Path(tempfile.gettempdir()), sock
        assert store.is_file() and store.parent != Path(tempfile.gettempdir()), store
    finally:
        bench_engine.stop_api_server(proc)
    assert proc.poll() is not None
    assert not sock.exists() and not sock.parent.exists() and not store.exists()
