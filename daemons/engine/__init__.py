"""Engine backends behind one interface (base.py). Only the instance daemon imports this package."""

from __future__ import annotations

from daemons.config import Config
from daemons.engine.base import Engine


def make_engine(cfg: Config) -> Engine:
    backend = cfg.instance.backend
    if backend == "sim":
        from daemons.engine.sim import SimEngine

        return SimEngine(cfg.sim, cfg.model, lora=cfg.lora, kv_tier=cfg.kv_tier)
    if backend == "vllm":
        from daemons.engine.vllm_backend import VllmEngine

        return VllmEngine(cfg.model, cfg.vllm, cfg.lora, cfg.kv_tier)
    raise ValueError(f"unknown engine backend {backend!r}")
