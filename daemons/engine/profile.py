"""Latency profiles: an engine's measured step time, as data (``llumnixctl profile`` writes them).

A profile is JSON::

    {"format": 1, "engine": "vllm 0.32.0 (cpu)", "model": "...", "block_size": 32, "kv_bytes_per_token": 8192,
     "prefill": {"tokens": [16, 64, ...], "ms": [3.1, 4.0, ...]},
     "decode": {"batch": [1, 4, ...], "context": [128, 512, ...], "ms": [[...per context...], ...per batch]},
     "lora": {"rank": 8, "loads": 5, "load_ms": 9.5, "activate_ms": 1.2, "unload_ms": 0.4}}

``prefill.ms[i]``: a step that prefills ``tokens[i]`` prompt tokens (one request). ``decode.ms[b][c]``: a
step that decodes ``batch[b]`` requests of ``context[c]`` tokens each. Between the measured points the
time is interpolated linearly (bilinearly for decode); beyond them it is extrapolated from the last two
points, so a profile measured up to batch 32 still answers for 64. A step that both prefills and decodes
takes the sum of both parts, as the sim's linear model does.

``lora`` (optional; a profile written before it has none): what a LoRA adapter of ``rank`` costs the engine,
medians of ``loads`` loads (llumnixctl/experiments/sim/profile_lora.py). ``load_ms``: the load call (vLLM's
``add_lora``: the weights read and checked), from the order to the adapter held and usable, with every slot full
so that it also unloads the least recently used adapter, as a thrashing cluster's loads do; the engine loop runs no
step meanwhile. ``activate_ms``: what the first step that runs the new adapter takes beyond the same step with it
held (vLLM copies it into a slot). ``unload_ms``: an unload alone. The sim engine charges ``stall_ms`` (load plus
activation) to the step after a load when lora.load_ms is left at -1 (daemons/engine/sim_lora.py).
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path

FORMAT = 1


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the file and the field."""


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1 = xs[i], xs[i + 1]
    return ys[i] + (ys[i + 1] - ys[i]) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class LoraProfile:
    """The ``lora`` part of a profile: an adapter load's cost (ms), measured."""

    rank: int
    loads: int
    load_ms: float
    activate_ms: float
    unload_ms: float

    @property
    def stall_ms(self) -> float:
        """What a load costs the engine loop: the load call and the first step's activation."""
        return self.load_ms + max(0.0, self.activate_ms)

    def to_json(self) -> dict:
        return {"rank": self.rank, "loads": self.loads, "load_ms": self.load_ms, "activate_ms": self.activate_ms,
                "unload_ms": self.unload_ms}

    @classmethod
    def from_json(cls, data: dict, where: str) -> "LoraProfile":
        try:
            prof = cls(int(data["rank"]), int(data["loads"]), float(data["load_ms"]), float(data["activate_ms"]),
                       float(data["unload_ms"]))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProfileError(f"{where}: lora must be {{rank, loads, load_ms, activate_ms, unload_ms}} "
                               f"({type(exc).__name__}: {exc})") from None
        if prof.load_ms < 0 or prof.unload_ms < 0 or prof.loads < 1:
            raise ProfileError(f"{where}: lora.load_ms and lora.unload_ms must be >= 0 and lora.loads >= 1")
        return prof


@dataclass(frozen=True)
class LatencyProfile:
    prefill_tokens: list[int]
    prefill_ms: list[float]
    decode_batch: list[int]
    decode_context: list[int]
    decode_ms: list[list[float]]
    kv_bytes_per_token: int = 0
    block_size: int = 0
    engine: str = ""
    model: str = ""
    lora: LoraProfile | None = None

    def prefill(self, tokens: int) -> float:
        return max(0.0, _interp(self.prefill_tokens, self.prefill_ms, tokens))

    def decode(self, batch: int, context_tokens: int) -> float:
        """One decode step of ``batch`` requests holding ``context_tokens`` tokens in all."""
        per_seq = context_tokens / max(batch, 1)
        by_batch = [_interp(self.decode_context, row, per_seq) for row in self.decode_ms]
        return max(0.0, _interp(self.decode_batch, by_batch, batch))

    def step_ms(self, prefill_tokens: int, n_decoding: int, context_tokens: int) -> float:
        ms = self.prefill(prefill_tokens) if prefill_tokens > 0 else 0.0
        if n_decoding > 0:
            ms += self.decode(n_decoding, context_tokens)
        return ms

    def to_json(self) -> dict:
        return {"format": FORMAT, "engine": self.engine, "model": self.model, "block_size": self.block_size,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "prefill": {"tokens": self.prefill_tokens, "ms": self.prefill_ms},
                "decode": {"batch": self.decode_batch, "context": self.decode_context, "ms": self.decode_ms},
                **({"lora": self.lora.to_json()} if self.lora is not None else {})}

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "LatencyProfile":
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ProfileError(f"{path}: cannot read the latency profile: {exc.strerror or exc}") from None
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{path}: not JSON: {exc}") from None
        try:
            if data.get("format") != FORMAT:
                raise ProfileError(f"{path}: format must be {FORMAT}; got {data.get('format')!r}")
            pre, dec = data["prefill"], data["decode"]
            prof = cls([int(x) for x in pre["tokens"]], [float(x) for x in pre["ms"]],
                       [int(x) for x in dec["batch"]], [int(x) for x in dec["context"]],
                       [[float(x) for x in row] for row in dec["ms"]], int(data.get("kv_bytes_per_token", 0)),
                       int(data.get("block_size", 0)), str(data.get("engine", "")), str(data.get("model", "")),
                       LoraProfile.from_json(data["lora"], str(path)) if data.get("lora") is not None else None)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, ProfileError):
                raise
            raise ProfileError(f"{path}: not a latency profile ({type(exc).__name__}: {exc})") from None
        prof.check(str(path))
        return prof

    def check(self, where: str) -> None:
        def increasing(name: str, xs: list) -> None:
            if not xs or any(b <= a for a, b in zip(xs, xs[1:])):
                raise ProfileError(f"{where}: {name} must be non-empty and strictly increasing")

        increasing("prefill.tokens", self.prefill_tokens)
        increasing("decode.batch", self.decode_batch)
        increasing("decode.context", self.decode_context)
        if len(self.prefill_ms) != len(self.prefill_tokens):
            raise ProfileError(f"{where}: prefill.ms must have one time per prefill.tokens entry")
        if len(self.decode_ms) != len(self.decode_batch) or any(len(r) != len(self.decode_context) for r in self.decode_ms):
            raise ProfileError(f"{where}: decode.ms must be a [len(batch)][len(context)] table")
