"""``llumnixctl profile``: measure an engine's step times and write a latency profile.

The vllm engine runs in this process with the settings given (``--set vllm.*``), as an instance runs it:
prefill steps of one request of each ``--prefill`` length, then decode steps of each ``--batch`` size at
each ``--context`` length per request (medians of ``--repeat`` steps). The sim engine
(``sim.profile = FILE``) and ``llumnixctl simulate`` then take their step times from the file
(daemons/engine/profile.py). On a GPU node the same command measures CUDA vLLM.

First (unless ``--no-lora``) it measures what a LoRA adapter load costs (the profile's ``lora`` part, which the sim
engine's loads take: profile_lora.py): vllm in a child process with an adapter made with PEFT for the model (or
``--lora-adapter DIR``); ``--lora-only`` adds that part to an existing profile and leaves its step times alone.
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from daemons.config import ConfigError, load_config
from llumnixctl.common import ConfigOpt, JsonOpt, die, out, print_json

if TYPE_CHECKING:
    from daemons.engine.profile import LatencyProfile


def _ints(text: str, name: str) -> list[int]:
    try:
        xs = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        xs = []
    if not xs or xs[0] < 1:
        die(f"--{name} must be positive integers separated by commas; got {text!r}", 2)
    return xs


def measure(engine, prefill: list[int], batch: list[int], context: list[int], repeat: int, log=lambda m: None,
            vocab: int = 1000) -> LatencyProfile:
    """Step times of ``engine`` (any Engine; steps are timed on the wall clock unless the engine reports
    a model time, as the sim does)."""
    from daemons.engine.base import EngineRequest
    from daemons.engine.profile import LatencyProfile
    from daemons.wire import SamplingParams

    rng = random.Random(0)
    ids = iter(range(1 << 30))

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    def timed_step() -> tuple[float, list]:
        t0 = time.perf_counter()
        result = engine.step()
        wall = time.perf_counter() - t0
        return (result.model_time_s or wall) * 1e3, result.outputs

    def add(n: int, max_tokens: int) -> str:
        rid = f"profile-{next(ids)}"
        engine.add_request(EngineRequest(rid, prompt(n), SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        return rid

    def drain() -> None:
        for _ in range(10_000):
            if not engine.has_work():
                return
            engine.step()

    add(16, 2)  # warm up
    drain()
    prefill_ms = []
    for n in prefill:
        samples = []
        for _ in range(repeat):
            add(n, 1)
            samples.append(timed_step()[0])
            drain()
        prefill_ms.append(statistics.median(samples))
        log(f"prefill {n} tokens: {prefill_ms[-1]:.2f} ms")
    decode_ms = []
    for b in batch:
        row = []
        for c in context:
            rids = {add(c, repeat + 64) for _ in range(b)}
            started: set[str] = set()
            for _ in range(10_000):  # prefill every request (in as many steps as the engine takes)
                started |= {o.request_id for o in engine.step().outputs}
                if started >= rids:
                    break
            samples = [timed_step()[0] for _ in range(repeat)]
            row.append(statistics.median(samples))
            for rid in rids:
                engine.abort_request(rid)
            log(f"decode batch {b} x {c} tokens: {row[-1]:.2f} ms")
        decode_ms.append(row)
    kv = engine.kv_blocks()
    return LatencyProfile(prefill, prefill_ms, batch, context, decode_ms,
                          kv_bytes_per_token=kv.block_nbytes // engine.block_size, block_size=engine.block_size)


def command(
    out_file: Annotated[Path, typer.Option("--out", "-o", metavar="FILE", help="the profile file to write (JSON)")],
    backend: Annotated[str, typer.Option(metavar="vllm|sim", help="vllm (in this process) or sim (its own latency model: for checking)")] = "vllm",
    model: Annotated[Optional[Path], typer.Option(metavar="DIR", help="vllm: checkpoint directory (default: generate the tiny test model)")] = None,
    prefill: Annotated[str, typer.Option(metavar="N,N...", help="prompt lengths of the prefill steps")] = "16,64,256,1024,2048",
    batch: Annotated[str, typer.Option(metavar="N,N...", help="batch sizes of the decode steps")] = "1,4,16,32",
    context: Annotated[str, typer.Option(metavar="N,N...", help="context lengths per request of the decode steps")] = "128,512,1024",
    repeat: Annotated[int, typer.Option(help="steps per point (the median is kept)", min=1)] = 5,
    lora: Annotated[bool, typer.Option("--lora/--no-lora", help="also measure a LoRA adapter's load (the profile's lora part; vllm: in a child process with lora.slots=2, before the steps)")] = True,
    lora_adapter: Annotated[Optional[Path], typer.Option(metavar="DIR", help="the adapter to load (default: one of rank 8 made with PEFT for the model: needs peft)")] = None,
    lora_loads: Annotated[int, typer.Option(help="adapter loads measured (the median is kept)", min=1)] = 5,
    lora_only: Annotated[bool, typer.Option("--lora-only", help="measure the adapter load alone and add it to the profile already in --out (its step times are kept)")] = False,
    config: ConfigOpt = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="engine settings: section.key=value (vllm.*, sim.*, model.*)")] = None,
    json_: JsonOpt = False,
) -> None:
    """Measure an engine's step times (prefill by length, decode by batch and context) into a profile file."""
    from daemons.engine.base import EngineError
    from daemons.engine.profile import LatencyProfile, ProfileError
    pre, bat, ctx = _ints(prefill, "prefill"), _ints(batch, "batch"), _ints(context, "context")
    err = lambda m: print(m, file=sys.stderr)  # noqa: E731
    if backend not in ("vllm", "sim"):
        die(f"unknown --backend {backend!r}; choose vllm or sim", 2)
    old = None
    if lora_only:
        try:
            old = LatencyProfile.load(out_file)
        except ProfileError as exc:
            die(f"--lora-only adds to the profile in --out: {exc}", 2)
    sets = list(set_ or [])
    tmp = None
    if backend == "vllm" and model is None:
        from llumnixctl.lab.model import write_tiny_model

        tmp = tempfile.TemporaryDirectory(prefix="llumnix-profile-")
        err("writing the tiny test model ...")
        model = write_tiny_model(Path(tmp.name) / "tiny")
    if model is not None:
        sets.append(f"model.path={model.resolve()}")
    need = max(pre[-1], ctx[-1] + repeat + 64) + 16
    sets = [f"model.max_model_len={need}", *sets]
    try:
        cfg = load_config(config, sets)
    except ConfigError as exc:
        die(str(exc), 2)
    try:
        lora_part = _lora(backend, cfg, sets, config, model, lora_adapter, lora_loads, err) if lora or lora_only else None
        if old is not None:
            if lora_part is None:
                die("no adapter load measured: the profile is left as it was")
            prof = LatencyProfile(**{**old.__dict__, "lora": lora_part})
        else:
            label = "tiny (llumnixctl model tiny)" if tmp is not None else str(model or cfg.model.name)
            prof = _steps(backend, cfg, pre, bat, ctx, repeat, err, label)
            prof = LatencyProfile(**{**prof.__dict__, "lora": lora_part})
    except EngineError as exc:
        die(str(exc))
    finally:
        if tmp is not None:
            tmp.cleanup()
    prof.save(out_file)
    if json_:
        print_json(prof.to_json())
    elif old is not None:
        out.print(f"wrote {out_file}: its step times, and an adapter load of {_lora_line(prof.lora)}", markup=False,
                  highlight=False)
    else:
        out.print(f"wrote {out_file}: prefill {pre}, decode {bat} x {ctx} ({prof.engine})"
                  + (f"; an adapter load of {_lora_line(prof.lora)}" if prof.lora else ""), markup=False, highlight=False)


def _lora_line(lora) -> str:
    return (f"{lora.load_ms:.1f} ms, its first step {lora.activate_ms:+.1f} ms (rank {lora.rank}, median of "
            f"{lora.loads})")


def _steps(backend: str, cfg, pre, bat, ctx, repeat: int, err, label: str) -> LatencyProfile:
    """The step times, measured on ``backend``'s engine in this process."""
    from daemons.engine.profile import LatencyProfile

    if backend == "vllm":
        from daemons.engine.vllm_backend import VllmEngine

        engine = VllmEngine(cfg.model, cfg.vllm)
        engine.init_thread()
        name = f"vllm {engine.version}"
    else:
        from daemons.engine.sim import SimEngine

        engine, name = SimEngine(cfg.sim, cfg.model), "sim"
    prof = measure(engine, pre, bat, ctx, repeat, err, vocab=engine.vocab_size)
    return LatencyProfile(**{**prof.__dict__, "engine": name, "model": label})


def _lora(backend: str, cfg, sets: list[str], config, model: Path | None, adapter: Path | None, loads: int, err):
    """The profile's lora part (None, with a line on stderr, when it cannot be measured here)."""
    from llumnixctl.experiments.sim import profile_lora

    if backend == "sim":
        from daemons.config import LoraConfig
        from daemons.engine.sim import SimEngine

        engine = SimEngine(cfg.sim, cfg.model, kv=False, lora=LoraConfig(slots=profile_lora.SLOTS,
                                                                         load_ms=cfg.lora.load_ms))
        return profile_lora.measure_lora(engine, str(adapter or "sim-adapter"), loads, err, vocab=engine.vocab_size)
    tmp = None
    try:
        if adapter is None:
            try:
                from llumnixctl.lab.adapter import write_adapter
                import peft  # noqa: F401
            except ImportError:
                err("peft is not installed: no adapter load measured (give --lora-adapter DIR, or --no-lora)")
                return None
            tmp = tempfile.TemporaryDirectory(prefix="llumnix-profile-lora-")
            err("writing a LoRA adapter (rank 8) with PEFT ...")
            adapter = write_adapter(model or cfg.model.path, Path(tmp.name) / "adapter")
        err("measuring adapter loads in a child process (LoRA on) ...")
        return profile_lora.measure_in_child(sets, config, str(Path(adapter).resolve()), loads, log=err)
    except profile_lora.LoraMeasureError as exc:
        err(f"no adapter load measured: {exc}")
        return None
    finally:
        if tmp is not None:
            tmp.cleanup()
