"""The figures of a finished simulation (llumnixctl/experiments/sim/simulate.py): vLLM's ``bench serve`` statistics
and the cluster's own."""

from __future__ import annotations

import math
from collections import Counter

from llumnixctl.stats import percentile


def result_of(sim, wall_s: float) -> dict:
    """The figures of a finished simulation (its ``result``)."""
    done = [r for r in sim.requests.values() if r.finish]
    mig = sim.migrations
    end = max((r.last for r in done), default=0.0)
    start = min((r.sent for r in sim.requests.values() if r.sent >= 0), default=0.0)
    duration = max(end - start, 1e-9)
    ttfts = [r.first - r.sent for r in done]
    e2el = [r.last - r.sent for r in done]
    tpots = [(r.last - r.first) / (r.tokens - 1) for r in done if r.tokens > 1]
    inputs = [r.trace.prompt_tokens for r in done]
    outputs = [r.tokens for r in done]
    out = {
        "completed": len(done), "failed": sum(1 for r in sim.requests.values() if r.error),
        "duration": duration, "total_input_tokens": sum(inputs), "total_output_tokens": sum(outputs),
        "request_throughput": len(done) / duration, "output_throughput": sum(outputs) / duration,
        "total_token_throughput": (sum(inputs) + sum(outputs)) / duration,
    }
    for name, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", list(sim.itls)), ("e2el", e2el)):
        out.update(stats_of(name, xs))
    loads = [i.engine.load() for i in sim.instances.values()]
    seconds = sum(max(0.0, (i.gone if i.gone is not None else end) - max(i.born, start))
                  for i in sim.instances.values())
    out.update({
        "instances": sim.n_instances, "instance_seconds": seconds,
        "instances_at_end": sum(1 for i in sim.instances.values() if i.gone is None),
        "scaling": {"out": sum(e["what"] == "out" for e in sim.scaler.events),
                    "in": sum(e["what"] == "in" for e in sim.scaler.events), "events": sim.scaler.events},
        "fragmentation": dict(sim.fragmentation.counts),
        "preemptions": sum(ld.preemptions for ld in loads),
        "migrations": dict(sorted(mig.outcomes.items())),
        "migration_downtime_ms": stats_of("downtime", mig.downtimes)["mean_downtime_ms"] if mig.downtimes else None,
        "dispatch_policy": sim.mgr.dispatch_policy, "events": sim.events, "wall_s": wall_s,
        "leaked_blocks": sum(ld.blocks_used for ld in loads),
        **sim.cache.figures(),
    })
    return out


def stats_of(name: str, xs: list[float]) -> dict:
    """vLLM's ``bench serve`` statistics of one latency, in ms (numpy's percentiles: linear)."""
    if not xs:
        return {f"{k}_{name}_ms": 0.0 for k in ("mean", "median", "std", "p99")}
    ys = sorted(xs)

    def pct(q: float) -> float:
        return percentile(ys, q)

    mean = sum(ys) / len(ys)
    std = math.sqrt(sum((y - mean) ** 2 for y in ys) / len(ys))
    return {f"mean_{name}_ms": mean * 1e3, f"median_{name}_ms": pct(50) * 1e3, f"std_{name}_ms": std * 1e3,
            f"p99_{name}_ms": pct(99) * 1e3}


def result_block(res: dict) -> str:
    from llumnixctl.experiments.bench import serve_figures as bench_serve_figures

    block = bench_serve_figures.result_block({**res, "prompt_token_mismatches": 0, "short_outputs": 0,
                                      "migrations": {"committed": sum(v for k, v in res["migrations"].items()
                                                                      if k.endswith("/committed")),
                                                     "aborted": sum(v for k, v in res["migrations"].items()
                                                                    if k.endswith("/aborted"))}})
    extra = [f"{'Instances:':<40} {res['instances']}", f"{'Instance-seconds:':<40} {res['instance_seconds']:.1f}",
             f"{'Simulated in (s, wall):':<40} {res['wall_s']:.2f}"]
    return block.rstrip("=").rstrip() + "\n" + "\n".join(extra) + "\n" + "=" * 50


class Fragmentation:
    """Samples of the cluster's queue heads: ``counts`` of samples, of those where some queue head was
    blocked for room, and of those where the cluster's free blocks together could hold one that no single
    instance's can (fragmentation)."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()

    def sample(self, loads: list) -> list:
        free = [ld.blocks_total - ld.blocks_used for ld in loads]
        total = sum(free)
        c = self.counts
        c["samples"] += 1
        blocked = [ld.hol_demand_blocks for ld, f in zip(loads, free) if ld.waiting and ld.hol_demand_blocks > f]
        if blocked:
            c["blocked"] += 1
            if any(d <= total and all(f < d for f in free) for d in blocked):
                c["fragmented"] += 1
        return loads
