"""What both engines' runs of ``llumnixctl bench lora`` share (lora.py, lora_vllm.py): the bench's shape, the
placements, the trace (Poisson arrivals, adapters of Zipf popularity) and one placement's figures."""

from __future__ import annotations

import random
from dataclasses import dataclass

PLACEMENTS = {"resident": ["lora.residency=true", "lora.max_replicas=0"],
              "where-loaded": ["lora.residency=true", "lora.max_replicas=1"],
              "by-load": ["lora.residency=false"]}


@dataclass(frozen=True)
class LoraBench:
    instances: int = 4
    slots: int = 2
    adapters: int = 8
    zipf: float = 1.0  # popularity of the k-th adapter ~ 1 / k^zipf
    requests: int = 2000
    rate: float = 40.0  # requests/s: saturating for 4 sim instances at their default step times
    load_ms: float | None = 50.0  # the sim's lora.load_ms; None: the setting's default (the profile's, else 50)
    # (the result's bench.load_ms is the one the sim took; vllm: None)
    seed: int = 0
    prompt: tuple[int, int] = (16, 1024)  # tokens, uniform
    output: tuple[int, int] = (16, 512)


def adapter_draw(n: int, adapters: int, zipf: float, seed: int) -> list[str]:
    """``n`` adapter names (a0 the most popular), drawn with Zipf popularity."""
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** zipf for k in range(adapters)]
    return [f"a{k}" for k in rng.choices(range(adapters), weights=weights, k=n)]


def workload(b: LoraBench) -> tuple[list, dict[int, str]]:
    """The trace (Poisson arrivals) and each request's adapter, by its index."""
    from llumnixctl.experiments.traces import gen

    trace = gen.generate(b.requests, rate=b.rate, prompt=b.prompt, output=b.output, seed=b.seed)
    names = adapter_draw(len(trace), b.adapters, b.zipf, b.seed)
    return trace, {tr.index: name for tr, name in zip(trace, names)}


def figures(completed: int, failed: int, ttft: dict, mean_tpot_ms, loads: int, evictions: int, duration_s: float,
            wall_s: float) -> dict:
    """One placement's figures (the same keys on both engines); ``ttft``: mean, p50, p99 (ms)."""
    minutes = duration_s / 60.0
    return {"completed": completed, "failed": failed, "mean_ttft_ms": ttft["mean"], "p50_ttft_ms": ttft["p50"],
            "p99_ttft_ms": ttft["p99"], "mean_tpot_ms": mean_tpot_ms, "adapter_loads": loads,
            "adapter_evictions": evictions,
            "adapter_loads_per_minute": round(loads / minutes, 2) if minutes > 0 else None,
            "duration_s": duration_s, "wall_s": wall_s}


def summarize(rows: list[dict]) -> dict[str, dict]:
    """Per placement over rounds: each figure's median (one round: its figures), completed and failed summed."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["placement"], []).append(r)
    out = {}
    for name, rs in by.items():
        entry: dict = {"rounds": len(rs)}
        for key in rs[0]:
            if key in ("round", "placement"):
                continue
            if key in ("completed", "failed"):
                entry[key] = sum(r[key] for r in rs)
                continue
            xs = sorted(x for x in (r[key] for r in rs) if isinstance(x, (int, float)))
            entry[key] = xs[len(xs) // 2] if xs else rs[0][key]
        out[name] = entry
    return out
