"""``llumnixctl bench serve``'s figures (llumnixctl/experiments/bench/serve.py): those of vLLM's ``vllm bench
serve`` (vllm/benchmarks/serve.py), with its definitions, computed from a replay's results; the text block
it prints and the latency CDF plots."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from llumnixctl.experiments.traces import gen as trace_mod
from llumnixctl.stats import percentile

METRICS = (("ttft", "TTFT", "Time to First Token"), ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
           ("itl", "ITL", "Inter-token Latency"), ("e2el", "E2EL", "End-to-end Latency"))


def tpot_s(r: dict, tokens: int | None = None) -> float | None:
    """Time per output token after the first, vLLM's way: (E2EL - TTFT) / (output tokens - 1)."""
    n = r["completion_tokens"] if tokens is None else tokens
    if r["error"] is not None or not r["times"] or not n or n < 2:
        return None
    return (r["times"][-1] - r["times"][0]) / (n - 1)


def stats_ms(xs: list[float]) -> dict:
    """numpy's mean, median and std, and P99 (linear, as numpy's), of seconds, in ms (0 for no samples, as vLLM does)."""
    xs = xs or [0.0]
    return {"mean": float(np.mean(xs)) * 1e3, "median": float(np.median(xs)) * 1e3,
            "std": float(np.std(xs)) * 1e3, "p99": percentile(xs, 99) * 1e3}



def metrics(reqs: list[trace_mod.TraceRequest], results: list[dict], duration_s: float) -> dict:
    """vLLM's result JSON (the keys of ``vllm bench serve --save-result``) from the replay's results."""
    ok = [r for r in results if r["error"] is None]
    out_lens = [(r["completion_tokens"] or 0) if r["error"] is None else 0 for r in results]
    in_lens = [r["prompt_tokens"] if r["prompt_tokens"] is not None else q.prompt_tokens
               for q, r in zip(reqs, results)]
    ttfts = [r["times"][0] for r in ok]
    e2els = [r["times"][-1] for r in ok]
    tpots = [t for t in (tpot_s(r) for r in ok) if t is not None]
    itls = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    total_in = sum(n for n, r in zip(in_lens, results) if r["error"] is None)
    total_out = sum(out_lens)
    res = {
        "duration": duration_s, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s, "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "input_lens": in_lens, "output_lens": out_lens,
        "ttfts": [r["times"][0] if r["error"] is None else 0.0 for r in results],
        "itls": [[b - a for a, b in zip(r["times"], r["times"][1:])] if r["error"] is None else []
                 for r in results],
        "latencies": [r["times"][-1] if r["error"] is None else 0.0 for r in results],
        "start_times": [r["start_s"] for r in results],
        "generated_texts": [r["text"] for r in results],
        "errors": [r["error"] or "" for r in results],
    }
    for key, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        s = stats_ms(values)
        for stat in ("mean", "median", "std", "p99"):
            res[f"{stat}_{key}_ms"] = s[stat]
    # Ours: how exact the lengths were.
    res["expected_input_lens"] = [q.prompt_tokens for q in reqs]
    res["expected_output_lens"] = [q.output_tokens for q in reqs]
    res["prompt_token_mismatches"] = sum(r["error"] is None and r["prompt_tokens"] != q.prompt_tokens
                                         for q, r in zip(reqs, results))
    res["short_outputs"] = sum(r["error"] is None and (r["completion_tokens"] or 0) != q.output_tokens
                               for q, r in zip(reqs, results))
    return res


def result_block(res: dict) -> str:
    """vLLM's ``Serving Benchmark Result`` block (its layout, plus the E2EL section and our extras)."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    row = lambda label, v: lines.append("{:<40} {:<10}".format(label, v))  # noqa: E731
    rowf = lambda label, v: lines.append("{:<40} {:<10.2f}".format(label, v))  # noqa: E731
    row("Successful requests:", res["completed"])
    row("Failed requests:", res["failed"])
    if res.get("max_concurrency") is not None:
        row("Maximum request concurrency:", res["max_concurrency"])
    if res.get("request_rate") is not None:
        rowf("Request rate configured (RPS):", res["request_rate"])
    rowf("Benchmark duration (s):", res["duration"])
    row("Total input tokens:", res["total_input_tokens"])
    row("Total generated tokens:", res["total_output_tokens"])
    rowf("Request throughput (req/s):", res["request_throughput"])
    rowf("Output token throughput (tok/s):", res["output_throughput"])
    rowf("Total Token throughput (tok/s):", res["total_token_throughput"])
    for key, name, header in METRICS:
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        rowf(f"Mean {name} (ms):", res[f"mean_{key}_ms"])
        rowf(f"Median {name} (ms):", res[f"median_{key}_ms"])
        rowf(f"P99 {name} (ms):", res[f"p99_{key}_ms"])
    if "preemptions" in res or res["prompt_token_mismatches"] or res["short_outputs"]:
        lines.append("{s:{c}^{n}}".format(s="Llumnix", n=50, c="-"))
        if "preemptions" in res:
            row("Preemptions:", res["preemptions"])
            row("Migrations committed:", res["migrations"]["committed"])
            row("Migrations aborted:", res["migrations"]["aborted"])
        st = res.get("steadiness")
        if st is not None:
            row("Instances marked dead:", len(st["instances_dead"]))
            row("Failovers, refusals (429/503):", f"{st['proxy_failovers']:g}, {st['proxy_rejected']:g}")
            for key, label in (("heartbeat_lateness_ms", "Heartbeat lateness"), ("query_ms", "Query answer")):
                worst = max((v["p99_ms"] for v in st[key].values()), default=None)
                top = max((v["max_ms"] for v in st[key].values()), default=None)
                if worst is not None:
                    row(f"{label} P99, max (ms, <=):", f"{worst:g}, {top:g}")
        row("Prompt token mismatches:", res["prompt_token_mismatches"])
        row("Outputs not of the trace's length:", res["short_outputs"])
    slo = res.get("slo")
    if slo is not None:
        lines.append("{s:{c}^{n}}".format(s=f"SLO (TTFT {slo['slo_ttft_ms']:g} ms, TPOT {slo['slo_tpot_ms']:g} ms)",
                                          n=50, c="-"))
        rowf("Goodput (met requests/s):", slo["goodput_rps"])
        for cls, c in slo["classes"].items():
            row(f"Attainment, {cls} (met/completed):", "-" if c["attainment"] is None
                else f"{c['attainment']:.3f} ({c['met']}/{c['admitted']})")
    lines.append("=" * 50)
    return "\n".join(lines)


def plot_cdfs(res: dict, out_dir: Path) -> list[Path]:
    """TTFT, TPOT and E2EL CDF PNGs (needs matplotlib: the ``plot`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [i for i, e in enumerate(res["errors"]) if not e]
    series = {
        "ttft": [res["ttfts"][i] * 1e3 for i in ok],
        "tpot": [(res["latencies"][i] - res["ttfts"][i]) / (res["output_lens"][i] - 1) * 1e3
                 for i in ok if res["output_lens"][i] > 1],
        "e2el": [res["latencies"][i] * 1e3 for i in ok],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for key, xs in series.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = np.sort(np.asarray(xs, dtype=float))
        if len(xs):
            ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post")
        ax.set_xlabel(f"{key.upper()} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{key.upper()} CDF · {res['completed']} requests · {res.get('model_id', '')}")
        ax.grid(alpha=0.3)
        path = out_dir / f"{key}_cdf.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
