"""``llumnixctl profile``'s LoRA part: what loading an adapter costs an engine (the ``lora`` part of a latency
profile, daemons/engine/profile.py).

With every adapter slot full (``SLOTS`` adapters held, each used), ``loads`` times: load an adapter not held (vLLM's
``add_lora``; it also unloads the least recently used adapter, as every load of a thrashing cluster does), then
one request of a ``PROMPT``-token prompt with it (a one-step prefill), then the same again (the adapter now held and
active). The load call's time is ``load_ms`` (the engine loop runs no step meanwhile: an instance loads at a step
boundary, in its step thread), the first step's time beyond the second's ``activate_ms``; ``unload_ms`` times
unloading the idle adapters at the end. Medians. A step is timed on the wall clock unless the engine reports a
model time (the sim, whose load shows as its next step's extra time).

For vllm the measurement runs in a child process (``python -m llumnixctl.experiments.sim.profile_lora``) with an
engine of its own, LoRA on: the engine that measures the steps runs without LoRA, as the profile's step times must
(vLLM's LoRA layers make every step slower), and the child has exited, its memory freed, before that one starts.
"""

from __future__ import annotations

import itertools
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from daemons.engine.profile import LoraProfile

SLOTS = 2  # lora.slots of the measuring engine
RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank choices
PROMPT = 16  # tokens of each request's prompt
LORA_SETS = [f"lora.slots={SLOTS}", "lora.adapters="]


class LoraMeasureError(RuntimeError):
    """The LoRA measurement could not run; the message says why."""


def adapter_rank(path: str | Path) -> int:
    """The rank (``r``) in an adapter's adapter_config.json; 0 if it has none (the sim's made-up adapters)."""
    try:
        return int(json.loads((Path(path) / "adapter_config.json").read_text()).get("r", 0))
    except (OSError, ValueError, TypeError):
        return 0


def measure_lora(engine, path: str, loads: int, log=lambda m: None, vocab: int = 1000) -> LoraProfile:
    """The ``lora`` part of a profile, measured on ``engine`` (any Engine with ``adapters``, lora.slots >= 1),
    loading the adapter at ``path`` under ``loads`` new names."""
    from daemons.engine.base import EngineError, EngineRequest
    from daemons.engine.profile import LoraProfile
    from daemons.wire import SamplingParams

    adapters = engine.adapters
    if adapters is None:
        raise EngineError("the engine serves no LoRA adapters (lora.slots = 0)")
    rng = random.Random(0)
    ids = itertools.count()

    def timed_step() -> float:
        t0 = time.perf_counter()
        result = engine.step()
        return (result.model_time_s or time.perf_counter() - t0) * 1e3

    def request(name: str) -> float:
        """One request with adapter ``name``: the time of the step that prefills it."""
        rid = f"profile-lora-{next(ids)}"
        engine.add_request(EngineRequest(rid, [rng.randrange(10, vocab) for _ in range(PROMPT)],
                                         SamplingParams(max_tokens=1, ignore_eos=True), adapter=name,
                                         adapter_path=path))
        ms = timed_step()
        for _ in range(1000):
            if not engine.has_work():
                break
            engine.step()
        return ms

    for k in range(adapters.table.slots):  # every slot full, and LoRA's first step behind us
        adapters.load(f"profile-warm-{k}", path)
        request(f"profile-warm-{k}")
        request(f"profile-warm-{k}")
    load_ms, activate_ms = [], []
    for i in range(loads):
        name = f"profile-lora-{i}"
        t0 = time.perf_counter()
        adapters.load(name, path)
        load_ms.append((time.perf_counter() - t0) * 1e3)
        first = request(name)
        activate_ms.append(first - request(name))
        log(f"adapter load {i + 1}/{loads}: {load_ms[-1]:.2f} ms, its first step {activate_ms[-1]:+.2f} ms")
    unload_ms = []
    for name in adapters.table.held():
        t0 = time.perf_counter()
        adapters.unload(name)
        unload_ms.append((time.perf_counter() - t0) * 1e3)
    return LoraProfile(adapter_rank(path), loads, statistics.median(load_ms), statistics.median(activate_ms),
                       statistics.median(unload_ms) if unload_ms else 0.0)


def measure_in_child(sets: list[str], config: str | None, adapter: str, loads: int, timeout_s: float = 900.0,
                     log=lambda m: None) -> LoraProfile:
    """``measure_lora`` on a vllm engine of its own, in a child process (the settings ``sets``, LoRA on)."""
    from daemons.engine.profile import LoraProfile

    args = json.dumps({"sets": sets, "config": config, "adapter": adapter, "loads": loads})
    try:
        done = subprocess.run([sys.executable, "-m", "llumnixctl.experiments.sim.profile_lora", args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise LoraMeasureError(f"the adapter loads were not measured within {timeout_s:g}s") from None
    for line in done.stderr.splitlines():
        if line.startswith("adapter load "):
            log(line)
    if done.returncode != 0 or not done.stdout.strip():
        tail = "\n".join(done.stderr.strip().splitlines()[-10:])
        raise LoraMeasureError(f"the adapter loads could not be measured (exit status {done.returncode}):\n{tail}")
    return LoraProfile.from_json(json.loads(done.stdout.strip().splitlines()[-1]), "the measuring child")


def _child(argv: list[str]) -> int:
    from daemons.config import load_config
    from daemons.engine.vllm_backend import VllmEngine

    a = json.loads(argv[0])
    rank = next((r for r in RANKS if r >= max(16, adapter_rank(a["adapter"]))), RANKS[-1])
    cfg = load_config(a["config"], [*a["sets"], *LORA_SETS, f"lora.max_rank={rank}"])
    engine = VllmEngine(cfg.model, cfg.vllm, cfg.lora)
    engine.init_thread()
    prof = measure_lora(engine, a["adapter"], a["loads"], lambda m: print(m, file=sys.stderr, flush=True),
                        vocab=engine.vocab_size)
    print(json.dumps(prof.to_json()), flush=True)
    engine.shutdown()
    return 0


if __name__ == "__main__":
    import os

    code = _child(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)  # (vLLM's exit hooks are not waited for: the figures are out)
