"""``llumnixctl bench lora``: LoRA placement on the simulator (virtual time, llumnixctl/experiments/sim/). One
generated trace whose requests name adapters of Zipf popularity runs on a cluster of sim instances with a few
adapter slots each (adapters as slots with a load time, daemons/engine/sim_lora.py), once per placement:

- ``resident``: dispatch by residency (daemons/policy/residency.py): holders that are not hot, else an instance
  that loads the adapter, without a bound on replicas;
- ``where-loaded``: the same with lora.max_replicas = 1: a request goes where its adapter is loaded;
- ``by-load``: lora.residency = false: the dispatch policy alone, the adapter loaded wherever a request lands.

It prints TTFT (P50, P99), TPOT and the adapter loads (per minute of the run) and evictions of each."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

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
    load_ms: float = 50.0
    seed: int = 0


def adapter_draw(n: int, adapters: int, zipf: float, seed: int) -> list[str]:
    """``n`` adapter names (a0 the most popular), drawn with Zipf popularity."""
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** zipf for k in range(adapters)]
    return [f"a{k}" for k in rng.choices(range(adapters), weights=weights, k=n)]


def run(b: LoraBench, placements: list[str] | None = None, sets: list[str] = ()) -> dict:
    from daemons.config import load_config
    from llumnixctl.experiments.sim.simulate import simulate
    from llumnixctl.experiments.traces import gen

    trace = gen.generate(b.requests, rate=b.rate, prompt=(16, 1024), output=(16, 512), seed=b.seed)
    names = adapter_draw(len(trace), b.adapters, b.zipf, b.seed)
    by_index = {tr.index: name for tr, name in zip(trace, names)}
    out = {"bench": dataclasses_dict(b), "placements": {}}
    for name in placements or list(PLACEMENTS):
        cfg = load_config(None, [f"lora.slots={b.slots}", f"lora.load_ms={b.load_ms}", *PLACEMENTS[name], *sets])
        res = simulate(cfg, b.instances, trace, adapter_of=lambda tr: by_index[tr.index])
        minutes = res["duration"] / 60.0
        out["placements"][name] = {
            "completed": res["completed"], "failed": res["failed"], "mean_ttft_ms": res["mean_ttft_ms"],
            "p50_ttft_ms": res["median_ttft_ms"], "p99_ttft_ms": res["p99_ttft_ms"], "mean_tpot_ms": res["mean_tpot_ms"],
            "adapter_loads": res["adapter_loads"], "adapter_evictions": res["adapter_evictions"],
            "adapter_loads_per_minute": round(res["adapter_loads"] / minutes, 2) if minutes > 0 else None,
            "duration_s": res["duration"], "wall_s": res["wall_s"]}
    return out


def dataclasses_dict(b: LoraBench) -> dict:
    import dataclasses

    return dataclasses.asdict(b)


def command(
    instances: Annotated[int, typer.Option("--instances", "-n", min=1, help="simulated instances")] = 4,
    slots: Annotated[int, typer.Option("--slots", min=1, help="adapter slots per instance (lora.slots)")] = 2,
    adapters: Annotated[int, typer.Option("--adapters", min=1, help="adapters the requests name")] = 8,
    zipf: Annotated[float, typer.Option("--zipf", min=0.0, help="popularity of the k-th adapter ~ 1/k^ZIPF")] = 1.0,
    requests: Annotated[int, typer.Option("--requests", min=1, help="requests in the trace")] = 2000,
    rate: Annotated[float, typer.Option("--rate", min=0.001, help="requests/s (Poisson)")] = 40.0,
    load_ms: Annotated[float, typer.Option("--load-ms", min=0.0, help="an adapter's load time, ms (lora.load_ms)")] = 50.0,
    seed: Annotated[int, typer.Option("--seed", help="seed of the trace and of the adapters' draw")] = 0,
    placement: Annotated[Optional[list[str]], typer.Option("--placement", help="resident, where-loaded or by-load (repeat; default: all three)")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", metavar="FILE", help="also write the figures as JSON there")] = None,
    json_: Annotated[bool, typer.Option("--json", help="print JSON for scripts")] = False,
) -> None:
    """LoRA placement on the simulator: P99 TTFT and adapter loads by residency, where-loaded and by load alone."""
    unknown = [p for p in placement or () if p not in PLACEMENTS]
    if unknown:
        Console(stderr=True).print(f"llumnixctl: unknown placement {', '.join(unknown)} (known: {', '.join(PLACEMENTS)})")
        raise typer.Exit(2)
    res = run(LoraBench(instances, slots, adapters, zipf, requests, rate, load_ms, seed), placement)
    if out is not None:
        out.write_text(json.dumps(res, indent=2) + "\n")
    if json_:
        print(json.dumps(res, indent=2))
        return
    table = Table(title=f"{instances} instances x {slots} adapter slots, {adapters} adapters (Zipf {zipf:g}), "
                        f"{requests} requests at {rate:g}/s, loads of {load_ms:g} ms", title_justify="left")
    for col in ("PLACEMENT", "P50 TTFT", "P99 TTFT", "MEAN TPOT", "LOADS", "LOADS/MIN", "EVICTIONS", "FAILED"):
        table.add_column(col, justify="left" if col == "PLACEMENT" else "right")
    for name, r in res["placements"].items():
        table.add_row(name, f"{r['p50_ttft_ms']:.0f} ms", f"{r['p99_ttft_ms']:.0f} ms", f"{r['mean_tpot_ms']:.1f} ms",
                      str(r["adapter_loads"]), f"{r['adapter_loads_per_minute']:.1f}", str(r["adapter_evictions"]),
                      str(r["failed"]))
    Console().print(table)
