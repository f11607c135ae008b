"""`llumnixctl bench serve`: a small trace replayed against our sim cluster's proxy and against vLLM's own
OpenAI server on the tiny model; vLLM's key names, figures consistent with the per-request arrays, and
prompts of exactly the trace's token counts (the servers' usage.prompt_tokens)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from tests.support.vllmserver import VllmServer


def serve(*args: str):
    """`llumnixctl bench serve ARGS` in this process (no 3-6 s of imports per run): exit_code, stdout, stderr."""
    from typer.testing import CliRunner

    from llumnixctl.experiments.bench import cli as bench

    return CliRunner().invoke(bench.app, ["serve", *args], catch_exceptions=False)

pytestmark = pytest.mark.e2e

# (arrival_s, prompt_tokens, output_tokens): lengths 1 and odd sizes, a prompt longer than the token pool.
TRACE = [(0.05, 5, 4), (0.1, 1, 1), (0.15, 37, 8), (0.2, 64, 2), (0.3, 150, 12), (0.35, 9, 6), (0.4, 97, 3),
         (0.5, 17, 10)]
VLLM_KEYS = {"completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
             "output_throughput", "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls",
             "latencies", "generated_texts", "errors"} | {
    f"{stat}_{m}_ms" for stat in ("mean", "median", "std", "p99") for m in ("ttft", "tpot", "itl", "e2el")}


def _trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"arrival_s": a, "prompt_tokens": p, "output_tokens": o}) + "\n"
                            for a, p, o in TRACE))
    return path


def _check(d: dict) -> None:
    """What must hold of any run of TRACE that completed."""
    assert VLLM_KEYS <= set(d), VLLM_KEYS - set(d)
    n = len(TRACE)
    assert d["errors"] == [""] * n, d["errors"]
    assert (d["completed"], d["failed"]) == (n, 0)
    # Exact lengths: the servers' usage counts are the trace's.
    assert d["input_lens"] == [p for _, p, _ in TRACE] and d["prompt_token_mismatches"] == 0
    assert d["output_lens"] == [o for _, _, o in TRACE] and d["short_outputs"] == 0
    assert d["total_input_tokens"] == sum(d["input_lens"]) and d["total_output_tokens"] == sum(d["output_lens"])
    dur = d["duration"]
    assert dur >= TRACE[-1][0]
    assert d["request_throughput"] == pytest.approx(n / dur)
    assert d["output_throughput"] == pytest.approx(d["total_output_tokens"] / dur)
    assert d["total_token_throughput"] == pytest.approx((d["total_input_tokens"] + d["total_output_tokens"]) / dur)
    ttfts, lats, outs = np.array(d["ttfts"]), np.array(d["latencies"]), d["output_lens"]
    assert (ttfts > 0).all() and (ttfts <= lats).all()
    tpots = [(lat - t) / (o - 1) for t, lat, o in zip(ttfts, lats, outs) if o > 1]
    itls = [g for gaps in d["itls"] for g in gaps]
    # ITL: the gaps between the chunks, first to last (our proxy sends finish_reason in a chunk of its own)
    for i, gaps in enumerate(d["itls"]):
        assert len(gaps) <= outs[i] and sum(gaps) == pytest.approx(lats[i] - ttfts[i], abs=1e-9)
    assert len(itls) > 0
    for key, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", lats)):
        assert d[f"mean_{key}_ms"] == pytest.approx(np.mean(xs) * 1e3), key
        assert d[f"median_{key}_ms"] == pytest.approx(np.median(xs) * 1e3), key
        assert d[f"std_{key}_ms"] == pytest.approx(np.std(xs) * 1e3), key
        assert d[f"p99_{key}_ms"] == pytest.approx(np.percentile(xs, 99) * 1e3), key


def _block_values(text: str) -> dict[str, str]:
    lines = text.strip().splitlines()
    assert lines[0] == "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=") and lines[-1] == "=" * 50
    return {line[:40].strip(): line[41:].strip() for line in lines if line.endswith(" ") or ":" in line[:41]}


def test_sim_cluster_vllm_keys_consistent_and_cluster_counters(vllm_server, cluster, tmp_path):
    # (vllm_server: only started here, for the last test, so that its start overlaps these)
    saved, plots = tmp_path / "result.json", tmp_path / "plots"
    res = serve("--url", cluster.url, "--trace", str(_trace_file(tmp_path)), "--run-dir", str(cluster.run_dir),
                "--save", str(saved), "--plot", str(plots), "--max-concurrency", "4")
    assert res.exit_code == 0, res.stderr
    d = json.loads(saved.read_text())
    _check(d)
    assert d["model_id"] == "llumnix-sim" and d["max_concurrency"] == 4
    assert isinstance(d["preemptions"], int) and set(d["migrations"]) == {"committed", "aborted"}
    st = d["steadiness"]  # each instance's heartbeat ticks during the run, read off its /metrics
    assert st["instances_dead"] == [] and st["proxy_failovers"] == 0 and st["proxy_rejected"] == 0
    assert sorted(st["heartbeat_lateness_ms"]) == ["i0", "i1"], st
    assert all(v["p99_ms"] <= v["max_ms"] for v in st["heartbeat_lateness_ms"].values()), st
    # The printed block is vLLM's, with the saved figures.
    v = _block_values(res.stdout)
    assert v["Successful requests:"] == str(len(TRACE)) and v["Maximum request concurrency:"] == "4"
    assert v["Total input tokens:"] == str(d["total_input_tokens"])
    assert v["Total generated tokens:"] == str(d["total_output_tokens"])
    for name, key in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2EL", "e2el")):
        assert v[f"Mean {name} (ms):"] == f"{d[f'mean_{key}_ms']:.2f}"
        assert v[f"P99 {name} (ms):"] == f"{d[f'p99_{key}_ms']:.2f}"
    assert "Time per Output Token (excl. 1st token)" in res.stdout and "Preemptions:" in res.stdout
    assert "Heartbeat lateness P99, max (ms, <=):" in res.stdout and v["Instances marked dead:"] == "0"
    if importlib.util.find_spec("matplotlib") is None:
        assert "no plots" in res.stderr
    else:
        assert sorted(p.name for p in plots.iterdir()) == ["e2el_cdf.png", "tpot_cdf.png", "ttft_cdf.png"]


def test_generated_trace_and_bad_arguments(cluster):
    res = serve("--url", cluster.url, "--requests", "3", "--rate", "50", "--prompt-min", "1", "--prompt-max", "20",
                "--output-min", "1", "--output-max", "5", "--json")
    assert res.exit_code == 0, res.stderr
    d = json.loads(res.stdout)
    assert d["completed"] == 3 and d["request_rate"] == 50 and d["prompt_token_mismatches"] == 0
    assert "preemptions" not in d  # not asked to reach a manager
    res = serve("--url", cluster.url)
    assert res.exit_code == 2 and "--trace" in res.stderr
    res = serve("--url", "http://127.0.0.1:9", "--requests", "1")
    assert res.exit_code == 1 and "cannot reach" in res.stderr


# ------------------------------------------------------------------ vLLM's own server


def _vllm_server(tmp_path_factory) -> VllmServer:
    """vLLM's OpenAI server on the tiny model, started at once; ``ready()`` waits for its /health."""
    from llumnixctl.lab.model import write_tiny_model

    model = write_tiny_model(tmp_path_factory.mktemp("tiny"))
    return VllmServer(model, tmp_path_factory.mktemp("vllm") / "server.log",
                      ["--max-model-len", "1024", "--dtype", "float32", "--enforce-eager"], {"VLLM_CPU_KVCACHE_SPACE": "1"})


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    """Started when first asked for (the first test here asks, so that its ~40 s start overlaps the sim
    tests), stopped at the module's end."""
    if importlib.util.find_spec("vllm") is None:
        yield None
        return
    server = _vllm_server(tmp_path_factory)
    try:
        yield server
    finally:
        server.stop()


def test_vllm_api_server(vllm_server, tmp_path):
    if vllm_server is None:
        pytest.skip("vllm is not installed")
    server = vllm_server.ready()
    url, model = server.url, server.model
    saved = tmp_path / "result.json"
    res = serve("--url", url, "--trace", str(_trace_file(tmp_path)), "--save", str(saved))
    assert res.exit_code == 0, res.stderr
    print(res.stdout)  # the block, for `pytest -s`
    d = json.loads(saved.read_text())
    _check(d)
    v = _block_values(res.stdout)
    assert v["Successful requests:"] == str(len(TRACE)) and v["Failed requests:"] == "0"
    assert v["Total input tokens:"] == str(sum(p for _, p, _ in TRACE))
    assert v["Median TTFT (ms):"] == f"{d['median_ttft_ms']:.2f}"
    assert d["model_id"] == model  # the first of GET /v1/models
    assert any(d["generated_texts"])
    # At most one chunk per token (vLLM may bundle tokens in a chunk), the finish_reason in the last one.
    assert all(len(g) <= o - 1 for g, (_, _, o) in zip(d["itls"], TRACE))
