"""What the figure modules share: the cluster that stands in for the paper's, running simulations on
every core, and writing results/figNN.json (and a PNG when matplotlib is there) with the paper's numbers
beside ours.

The paper (Llumnix, OSDI'24) serves LLaMA-7B on A10 GPUs (24 GB). ``PAPER_LIKE`` is a sim instance of
that shape, ``PAPER_NET`` its network (declared in llumnixctl/experiments/sim/paper.py, which says how).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from daemons.config import load_config
from llumnixctl.experiments.sim.paper import PAPER_LIKE, PAPER_NET  # noqa: F401 (the figures import them here)
from llumnixctl.experiments.sim.simulate import Network, simulate
from llumnixctl.experiments.traces.gen import TraceRequest

POLICIES = ("llumnix", "infaas++", "rr")


def _one(job: dict) -> dict:
    import logging

    logging.getLogger("llumnix").setLevel(logging.WARNING)
    cfg = load_config(None, PAPER_LIKE + list(job.get("sets", ())))
    net = Network(**{**PAPER_NET, **job.get("net", {})})
    res = simulate(cfg, job["instances"], job["trace"], net, sample_s=job.get("sample_s", 0.0))
    res["scaling"].pop("events", None) if not job.get("keep_events") else None
    return {"label": job["label"], **{k: v for k, v in job.items() if k in ("params",)}, "result": res}


def run_all(jobs: list[dict], processes: int | None = None) -> list[dict]:
    """Run simulations (dicts: label, instances, trace, sets, net, sample_s, params) on every core."""
    n = processes or min(len(jobs), os.cpu_count() or 1)
    if n <= 1:
        return [_one(j) for j in jobs]
    with multiprocessing.get_context("fork").Pool(n) as pool:
        return pool.map(_one, jobs)


def ratio(a: float | None, b: float | None) -> float | None:
    """b / a (how many times lower ``a`` is), None when it cannot be said."""
    if not a or b is None:
        return None
    return b / a


def write(out_dir: Path, name: str, data: dict, plot: Callable[[Any, dict], None] | None = None) -> list[Path]:
    """results/NAME.json, and NAME.png through ``plot(pyplot, data)`` when matplotlib is installed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / f"{name}.json"]
    written[0].write_text(json.dumps(data, indent=1, default=str) + "\n")
    if plot is not None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print(f"{name}: matplotlib is not installed (pip install 'llumnix-toolkit[plot]'): no PNG",
                  file=sys.stderr)
        else:
            plot(plt, data)
            png = out_dir / f"{name}.png"
            plt.savefig(png, dpi=120, bbox_inches="tight")
            plt.close("all")
            written.append(png)
    return written


def trace_summary(trace: list[TraceRequest]) -> dict:
    from llumnixctl.experiments.traces import gen as trace_mod

    return trace_mod.summary(trace)


def size_parser(module: str, doc: str, instances_help: str | None = None) -> argparse.ArgumentParser:
    """The options of ``python -m MODULE`` that ``full_size`` completes: --out, --quick, --requests, --instances."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("results"))
    p.add_argument("--quick", action="store_true", help="a tiny version (tests)")
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--instances", type=int, default=None, help=instances_help)
    return p


def full_size(args) -> None:
    """Fill in what the command line (and ``--quick``) left unset as the full run has it: the paper's scale,
    3,000 requests of the M-M mix on 16 instances."""
    args.requests = args.requests or 3000
    args.instances = args.instances or 16
    args.mix = args.mix or "M-M"


def run_figure(args, name: str, figure: str, paper: dict, build_jobs: Callable, run_jobs: Callable, analyse: Callable,
               differences: Callable[[dict, dict], list[str]], plot: Callable[[Any, dict], None]) -> dict:
    """A figure measured beside the paper's: ``build_jobs(args)`` makes the simulations (and the setup they
    record), ``run_jobs`` runs them, ``analyse`` reads their results into ours, ``differences(ours, setup)`` says
    where ours and ``paper`` differ. Writes NAME.json (and NAME.png through ``plot``), says so, returns the data."""
    t0 = time.time()
    jobs, setup = build_jobs(args)
    an = analyse(run_jobs(jobs))
    data = {"figure": figure, "quick": args.quick, "setup": setup, "ours": an, "paper": paper,
            "differences": differences(an, setup), "wall_s": round(time.time() - t0, 1)}
    for path in write(args.out, name, data, plot):
        print(f"wrote {path}")
    return data


# ---------------------------------------------------------------------------------------------- fleet sweeps
# (disagg_fleet, slo_fleet): one simulation per system and load, run on every core or in pieces (--parts,
# then --collect), against SLO targets.


def sweep_options(p: argparse.ArgumentParser, collect_help: str) -> None:
    """--processes, and --parts / --collect: a sweep run in pieces, its figure made from their rows."""
    p.add_argument("--processes", type=int, default=None, help="simulations at once (default: every core)")
    p.add_argument("--parts", default=None, help="a folder for each simulation's row as it finishes (JSON)")
    p.add_argument("--collect", type=Path, default=None, metavar="DIR", help=collect_help)


def target_sets(targets: dict) -> list[str]:
    return [f"slo.ttft_ms={targets['ttft_ms']:g}", f"slo.tpot_ms={targets['tpot_ms']:g}"]


def keep_part(job: dict, row: dict, name: str) -> dict:
    """``row``, also written to the job's ``parts`` folder (if any) as NAME.json."""
    if job.get("parts"):
        Path(job["parts"]).mkdir(parents=True, exist_ok=True)
        (Path(job["parts"]) / f"{name}.json").write_text(json.dumps(row) + "\n")
    return row


def collected(p: argparse.ArgumentParser, folder: Path) -> list[dict]:
    """The rows that earlier runs' --parts wrote to ``folder`` (an error of ``p`` where there are none)."""
    rows = [json.loads(f.read_text()) for f in sorted(folder.glob("*.json"))]
    if not rows:
        p.error(f"no rows in {folder}")
    return rows


def run_sweep(run_job: Callable[[dict], dict], jobs: list[dict], processes: int) -> list[dict]:
    """``run_job`` of each job, on ``processes`` processes (the costliest first)."""
    if processes <= 1:
        return [run_job(j) for j in jobs]
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        return pool.map(run_job, sorted(jobs, key=lambda j: -j["cost"]), chunksize=1)


def sweep_wall_s(t0: float, collect: Path | None, results: list[dict], processes: int) -> float:
    """The sweep's wall time: since ``t0``, or (collected rows) their simulations' time over the processes."""
    if collect is None:
        return time.perf_counter() - t0
    return sum(r["result"]["wall_s"] for r in results) / max(1, processes)
