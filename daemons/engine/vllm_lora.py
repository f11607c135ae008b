"""The vllm engine's LoRA adapters: the table of what it holds (daemons/engine/adapters.py) kept in step with
vLLM's (``VllmInternals.add_lora``, ``remove_lora``), and each request's ``LoRARequest``.

vLLM runs with ``max_cpu_loras`` one above lora.slots (``vllm_internals.lora_args``): a new adapter is loaded
first and only then is the table's victim unloaded, so a load that fails costs nothing. When every slot's adapter
is in use a new one loads beyond the slots and the request waits in vLLM's queue (``max_loras`` adapters in a
batch); past one more, vLLM's own LRU may evict an adapter in use, which vLLM loads again from its path when its
requests next run (its ``LoRARequest`` carries it)."""

from __future__ import annotations

import logging

from daemons.config import LoraConfig, parse_adapters
from daemons.engine.adapters import Adapter, AdapterTable, check_adapter_dir, check_shapes
from daemons.engine.base import EngineError

log = logging.getLogger("llumnix.engine.vllm")


class VllmAdapters:
    """Owns the adapter table of one vllm engine (``VllmEngine.adapters``). ``load`` and ``unload`` are the
    operator's verbs, ``rows`` what it holds; ``start`` (a request that runs with an adapter, loading it first if
    need be) and ``end`` bracket each request. ``calls``: vLLM's (``vllm_internals.VllmLoraCalls``)."""

    def __init__(self, calls, lora: LoraConfig, dims: dict[str, tuple[int, int]]):
        """``dims``: the model's projections (``adapters.module_dims``), which an adapter must fit."""
        self._v = calls
        self.table = AdapterTable(lora.slots)
        self.max_rank = lora.max_rank
        self.dims = dims

    def load_configured(self, text: str) -> None:
        """lora.adapters, up to lora.slots; one that does not load is logged and the rest go on."""
        for name, path in list(parse_adapters(text).items())[:self.table.slots]:
            try:
                self.load(name, path)
            except EngineError as exc:
                log.error("lora.adapters: %s", exc)

    def load(self, name: str, path: str) -> bool:
        """Hold ``name`` from ``path``; False when it was held already (from that path). EngineError names the
        adapter and what is wrong: a bad path, a rank over lora.max_rank, weights that do not fit this model."""
        if self.table.renew(name, path):
            return False
        config = check_adapter_dir(name, path, self.max_rank)
        check_shapes(name, path, self.dims, str(config.get("base_model_name_or_path") or ""))
        victim = self.table.plan(name)
        lora_id = self.table.new_id()
        try:
            self._v.add(name, lora_id, path)
        except Exception as exc:  # vLLM's checks raise ValueError, RuntimeError, its own LoRA errors
            self._forget(lora_id)
            raise EngineError(f"adapter {name!r} from {path!r} does not fit this model "
                              f"({type(exc).__name__}: {exc})") from None
        self.table.loaded(name, path, lora_id)
        if victim is not None:
            self._v.remove(victim.lora_id)
            self.table.unloaded(victim.name, evicted=True)
            log.info("adapter %s unloaded to make room for %s (least recently used)", victim.name, name)
        log.info("adapter %s loaded from %s", name, path)
        return True

    def _forget(self, lora_id: int) -> None:
        try:
            self._v.remove(lora_id)
        except Exception as exc:  # it was never added: nothing to undo
            log.debug("nothing to remove for lora id %d: %r", lora_id, exc)

    def unload(self, name: str) -> bool:
        """Unload ``name`` now, or when its running requests end. False if it is not held."""
        if name not in self.table:
            return False
        if self.table.unload_when_idle(name):
            self._drop(self.table.get(name))
        return True

    def _drop(self, adapter: Adapter) -> None:
        """Unload: asked (``unloading``), or the least recently used idle one past the slots (evicted)."""
        self._v.remove(adapter.lora_id)
        self.table.unloaded(adapter.name, evicted=not adapter.unloading)
        log.info("adapter %s unloaded%s", adapter.name, "" if adapter.unloading else " (least recently used)")

    def start(self, name: str, path: str, request_id: str):
        """The ``LoRARequest`` a request that runs with ``name`` is built with; loads the adapter from ``path``
        first if it is not held (EngineError when it cannot be)."""
        if name not in self.table:
            if not path:
                raise EngineError(f"adapter {name!r} is not loaded on this instance")
            self.load(name, path)
        a = self.table.started(name, request_id)
        return self._v.request(a.name, a.lora_id, a.path)

    def end(self, name: str, request_id: str) -> None:
        for gone in self.table.ended(name, request_id):
            self._drop(gone)

    def left(self, live) -> None:
        """A request left the engine (``LiveRequests.gone``)."""
        if live.adapter:
            self.end(live.adapter, live.rid)
