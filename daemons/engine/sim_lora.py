"""The sim engine's LoRA adapters: slots (the same table as vLLM's, daemons/engine/adapters.py) and a load time
that the engine's next step takes as well, as vLLM's loads stall its engine loop: lora.load_ms when set (0 or
more), else the load measured in the latency profile (sim.profile's ``lora``: the load call plus the first step's
activation, daemons/engine/profile.py), else ``DEFAULT_LOAD_MS``. No weights: any path loads; the tokens stay the
sim's."""

from __future__ import annotations

from typing import Callable

from daemons.config import LoraConfig, parse_adapters
from daemons.engine.adapters import AdapterTable
from daemons.engine.base import EngineError
from daemons.engine.profile import LatencyProfile

DEFAULT_LOAD_MS = 50.0  # lora.load_ms = -1 without a profile that measured a load


def load_ms(lora: LoraConfig, profile: LatencyProfile | None) -> float:
    """The sim's load time, ms: lora.load_ms if set (>= 0), else ``profile``'s measured stall (a LatencyProfile
    with a ``lora`` part), else ``DEFAULT_LOAD_MS``."""
    if lora.load_ms >= 0:
        return lora.load_ms
    measured = profile.lora if profile is not None else None
    return measured.stall_ms if measured is not None else DEFAULT_LOAD_MS


class SimAdapters:
    """Owns the sim engine's adapter table and the load time owed to the next step. ``live(request_id)``: the
    engine still holds that request (a request that left frees its adapter; the sim keeps no hook per exit)."""

    def __init__(self, lora: LoraConfig, live: Callable[[str], bool], profile: LatencyProfile | None = None):
        """``profile``: the engine's LatencyProfile (sim.profile), or None."""
        self.table = AdapterTable(lora.slots)
        self.load_s = load_ms(lora, profile) / 1000.0
        self.live = live
        self.owed_s = 0.0
        for name, path in list(parse_adapters(lora.adapters).items())[:lora.slots]:
            self.load(name, path)
        self.owed_s = 0.0  # loaded before serving

    def prune(self) -> None:
        for gone in self.table.settle(self.live):
            self.table.unloaded(gone.name, evicted=not gone.unloading)

    def load(self, name: str, path: str) -> bool:
        self.prune()
        if self.table.renew(name, path):
            return False
        victim = self.table.plan(name)
        if victim is not None:
            self.table.unloaded(victim.name, evicted=True)
        self.table.loaded(name, path, self.table.new_id())
        self.owed_s += self.load_s
        return True

    def unload(self, name: str) -> bool:
        self.prune()
        if name not in self.table:
            return False
        if self.table.unload_when_idle(name):
            self.table.unloaded(name)
        return True

    def start(self, name: str, path: str, request_id: str) -> None:
        if name not in self.table:
            self.load(name, path or name)  # (no weights: a request of the simulator names no path)
        self.table.started(name, request_id)

    def take_owed(self) -> float:
        """Load time the next step takes too (s)."""
        owed, self.owed_s = self.owed_s, 0.0
        return owed


def adapters_of(lora: LoraConfig | None, live: Callable[[str], bool],
                profile: LatencyProfile | None = None) -> SimAdapters | None:
    return SimAdapters(lora, live, profile) if lora is not None and lora.slots else None


def start(adapters: SimAdapters | None, adapter: str, path: str, request_id: str) -> None:
    """A request (or a migration's reservation) that runs with ``adapter`` ("": none): loads it if need be."""
    if not adapter:
        return
    if adapters is None:
        raise EngineError(f"adapter {adapter!r}: this instance serves no LoRA adapters (lora.slots = 0)")
    adapters.start(adapter, path, request_id)


def owed(adapters: SimAdapters | None) -> float:
    """Load time the next step takes too: a load stalls the engine loop, as vLLM's add_lora does."""
    return adapters.take_owed() if adapters is not None else 0.0


def load_fields(adapters: SimAdapters | None) -> dict:
    """The load report's adapter fields (wire.InstanceLoad)."""
    if adapters is None:
        return {}
    adapters.prune()
    return {"adapters": adapters.table.held(), "adapter_slots": adapters.table.open_slots()}
