"""Of ``llumnixctl simulate``: sessions (``--sessions N``) and the fleet comparison (``--compare``).

The workload is the session trace (llumnixctl/experiments/traces/sessions.py: closed loop in virtual time, each
turn sent its think time after the previous answer ended; prompts that grow by the answer and a new message;
shared agent system prompts), with prefix caching on in the sim engines. ``--rate`` is then sessions started per
second.

``--compare`` runs the same trace on three systems of the same instances (each one simulation on the daemons'
own objects; two at a time on two cores), with the [slo] targets measuring only (nothing refused):

- ``sessions``: ``llumnix-cache`` dispatch, every turn naming its session (sim/cache.py: on its Submit and, where
  this build's wire has it, on its Dispatch: the manager's session dispatch), the host KV tier and prefix
  pulls on where this build declares them (``[kv_tier]``);
- ``llumnix-cache``: today's cache-aware dispatch, no session, no tier, no pulls;
- ``infaas++``: INFaaS++ dispatch, no tier.

Figures per system: P99 and mean TTFT, goodput (turns per second that met both targets) and attainment, prompt
tokens served from the cache, failures. The issue's fleet check is the paper-like instance (figs/common.py
``PAPER_LIKE``) at 16 instances with sessions of 20-40 turns: ``FLEET`` is that shape (docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import time

from llumnixctl.experiments.traces import sessions as tsessions

SYSTEMS = {  # name -> (dispatch policy, session keys, tier settings wanted)
    "sessions": ("llumnix-cache", True, ("sessions.affinity=true", "kv_tier.pull=true")),
    "llumnix-cache": ("llumnix-cache", False, ("kv_tier.host_mb=0", "kv_tier.pull=false")),
    "infaas++": ("infaas++", False, ("kv_tier.host_mb=0", "kv_tier.pull=false")),
}


@dataclasses.dataclass(frozen=True)
class Shape:
    """A session workload (traces/sessions.py ``sessions``); ``FLEET`` is the issue's."""

    sessions: int = 200
    turns: tuple[int, int] = (20, 40)
    agents: int = 4
    system_tokens: int = 1024
    message: tuple[int, int] = (16, 256)
    reply: tuple[int, int] = (16, 128)
    think: float = 0.5  # vllm-router's data: 86% of an agent's follow-ups within 1 s
    max_context: int = 8192

    def trace(self, session_rate: float, seed: int, working_set_tokens: int = 0) -> list:
        return tsessions.sessions(0 if working_set_tokens else self.sessions, session_rate=session_rate,
                                  turns=self.turns, agents=self.agents, system_tokens=self.system_tokens,
                                  message=self.message, reply=self.reply, think=self.think,
                                  max_context=self.max_context, working_set_tokens=working_set_tokens, seed=seed)


FLEET = Shape()


def parse_turns(text: str) -> tuple[int, int]:
    """``MIN-MAX`` (or one number) -> the turns' bounds."""
    lo, _, hi = text.partition("-")
    try:
        bounds = (int(lo), int(hi or lo))
    except ValueError:
        raise ValueError(f"--turns takes MIN-MAX (e.g. 20-40), not {text!r}") from None
    if bounds[0] < 1 or bounds[1] < bounds[0]:
        raise ValueError(f"--turns bounds must satisfy 1 <= MIN <= MAX; got {text!r}")
    return bounds


def system_sets(name: str) -> list[str]:
    """The settings of system ``name`` that this build declares (bench/sessions.py ``declared``): they come after
    the command's own (``--set kv_tier.host_mb=...`` sizes the sessions system's tier; the others keep none)."""
    from llumnixctl.experiments.bench.sessions import declared

    policy_, _, wanted = SYSTEMS[name]
    return ["sim.prefix_caching=true", f"manager.dispatch_policy={policy_}",
            *(s for s in wanted if declared(s.split("=", 1)[0]))]


def _one(job: dict) -> dict:
    import logging

    from daemons.config import load_config

    logging.getLogger("llumnix").setLevel(logging.WARNING)
    cfg = load_config(job["config"], job["sets"])
    sim = job["simulation"](cfg, job["instances"], job["trace"], job["net"], slo_admission=False,
                            sessions=SYSTEMS[job["system"]][1], seed=job["seed"])
    cpu = time.process_time()
    res = sim.run()
    every = res["slo"]["all"]
    return {"system": job["system"], "completed": res["completed"], "failed": res["failed"],
            "mean_ttft_ms": round(res["mean_ttft_ms"], 1), "p99_ttft_ms": round(res["p99_ttft_ms"], 1),
            "p99_tpot_ms": round(res["p99_tpot_ms"], 1), "goodput_rps": every.get("goodput"),
            "attainment": every.get("attainment"), "prefix_hit_rate": round(res.get("prefix_hit_rate", 0.0), 4),
            "preemptions": res["preemptions"], "leaked_blocks": res["leaked_blocks"],
            "sessions_known": len(sim.mgr.dispatcher.sessions),  # (the manager's session table: its dispatches named them)
            "duration_s": round(res["duration"], 1), "wall_s": round(res["wall_s"], 1),
            "cpu_s": round(time.process_time() - cpu, 1), "settings": job["sets"]}


def compare(simulation, config, sets: list[str], instances: int, trace: list, net, seed: int, kv_tokens: int = 0,
            systems: tuple[str, ...] = tuple(SYSTEMS), processes: int = 2) -> dict:
    """The same session trace on each system (``sets``, then each system's own), each a ``simulation``
    (sim/simulate.py's ``Simulation``): their figures, and the trace's (``kv_tokens``: the fleet's KV, for the
    working set's ratio)."""
    import multiprocessing

    jobs = [{"system": s, "config": config, "sets": list(sets) + system_sets(s), "instances": instances,
             "trace": trace, "net": net, "seed": seed, "simulation": simulation} for s in systems]
    t0 = time.perf_counter()
    if processes > 1 and len(jobs) > 1:
        pool = multiprocessing.get_context("fork").Pool(min(processes, len(jobs)))
        try:
            rows = pool.map(_one, jobs, chunksize=1)
            pool.close()  # (ended, not terminated: a terminated worker prints its KeyboardInterrupt)
        except BaseException:
            pool.terminate()
            raise
        finally:
            pool.join()
    else:
        rows = [_one(j) for j in jobs]
    return {"instances": instances, "trace": tsessions.describe(trace, kv_tokens), "systems": rows,
            "wall_s": round(time.perf_counter() - t0, 1)}


def compare_block(res: dict) -> str:
    """The comparison for people."""
    t = res["trace"]
    lines = [f"{t['sessions']} sessions, {t['turns']} turns (mean {t['mean_turns']}), prompts mean "
             f"{t['prompt_tokens_mean']:.0f} / max {t['prompt_tokens_max']} tokens, working set "
             f"{t['working_set_tokens']} tokens" + (f" = {t['working_set_over_kv']}x the fleet's KV"
                                                   if t.get("working_set_over_kv") else "")
             + f"; {res['instances']} instances; {res['wall_s']} s wall",
             f"{'system':<15}{'P99 TTFT ms':>13}{'mean TTFT ms':>14}{'goodput/s':>11}{'attain':>8}{'hit rate':>10}"
             f"{'failed':>8}"]
    for r in res["systems"]:
        good = "-" if r["goodput_rps"] is None else f"{r['goodput_rps']:.2f}"
        att = "-" if r["attainment"] is None else f"{r['attainment']:.3f}"
        lines.append(f"{r['system']:<15}{r['p99_ttft_ms']:>13.0f}{r['mean_ttft_ms']:>14.0f}{good:>11}{att:>8}"
                     f"{100 * r['prefix_hit_rate']:>9.1f}%{r['failed']:>8}")
    return "\n".join(lines)


def command_sessions(simulation, instances: int, n: int, rate: float, turns: str, agents: int, system_tokens: int, think: float,
                     working_set: float, side_by_side: bool, policy_: str | None, config, sets: list[str], seed: int,
                     net, json_: bool) -> None:
    """``llumnixctl simulate --sessions N``: one ``simulation`` (sim/simulate.py's ``Simulation``), or
    (``side_by_side``: --compare) one per system."""
    from daemons.config import ConfigError, load_config
    from llumnixctl.common import die, out, print_json
    from llumnixctl.experiments.sim.result import result_block

    sets = ["sim.prefix_caching=true", *sets, *([f"manager.dispatch_policy={policy_}"] if policy_ else [])]
    try:
        cfg = load_config(config, sets)
        shape = dataclasses.replace(FLEET, sessions=n, turns=parse_turns(turns), agents=agents,
                                    system_tokens=system_tokens, think=think,
                                    max_context=min(FLEET.max_context, cfg.model.max_model_len))
        kv_tokens = instances * cfg.sim.num_blocks * cfg.sim.block_size
        reqs = shape.trace(rate, seed, int(working_set * kv_tokens))
    except (ConfigError, ValueError) as exc:
        die(str(exc), 2)
    import logging

    logging.getLogger("llumnix").setLevel(logging.WARNING)
    if side_by_side:
        res = compare(simulation, config, sets, instances, reqs, net, seed, kv_tokens)
        text = compare_block(res)
    else:
        res = simulation(cfg, instances, reqs, net, sessions=True, seed=seed).run()
        text = result_block(res)
    if json_:
        print_json(res)
    else:
        out.print(text, markup=False, highlight=False)
