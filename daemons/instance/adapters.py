"""The manager's LoRA orders (``llumnixctl lora load`` and ``unload``, the proxies' /v1/load_lora_adapter): each
runs on the engine at a step boundary and is answered with what came of it."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from daemons import wire
from daemons.engine.base import Engine, EngineError
from daemons.instance.mailbox import Mailbox
from daemons.instance.standing import Identity
from daemons.instance.telemetry import M_ADAPTER_EVICTIONS, M_ADAPTER_LOADS, M_ADAPTERS_HELD

log = logging.getLogger("llumnix.instance")


class AdapterOrders:
    """Owns nothing but the orders in flight: the engine owns its adapters (daemons/engine/adapters.py)."""

    def __init__(self, engine: Engine, mailbox: Mailbox, tell_manager: Callable[[wire.Message], None],
                 ident: Identity, changed: Callable[[], None]):
        """``changed``: the load the reports carry changed (the adapters held): report soon."""
        self.engine = engine
        self.mailbox = mailbox
        self.tell_manager = tell_manager
        self.ident = ident
        self.changed = changed

    def on_order(self, msg: wire.LoraOrder) -> None:
        fut = self.mailbox.call(lambda: self._apply(msg))
        fut.add_done_callback(lambda f: self._answer(msg, f))

    def _apply(self, msg: wire.LoraOrder) -> str:
        adapters = self.engine.adapters
        if adapters is None:
            raise EngineError(f"adapter {msg.name!r}: this instance serves no LoRA adapters (lora.slots = 0)")
        if msg.op == "load":
            return "loaded" if adapters.load(msg.name, msg.path) else "already loaded"
        if msg.op == "unload":
            return "unloaded" if adapters.unload(msg.name) else "not loaded here"
        raise ValueError(f"unknown LoRA order {msg.op!r} (load or unload)")

    def _answer(self, msg: wire.LoraOrder, fut: asyncio.Future) -> None:
        exc = fut.exception()
        if exc is not None and not isinstance(exc, (EngineError, ValueError)):
            log.error("LoRA order %s %s failed: %r", msg.op, msg.name, exc)
        ok = exc is None
        message = fut.result() if ok else str(exc)
        if ok:
            log.info("adapter %s: %s", msg.name, message)
        else:
            log.warning("%s of adapter %s refused: %s", msg.op, msg.name, message)
        self.changed()
        self.tell_manager(wire.LoraResult(msg.query_id, self.ident.instance_id, ok, message))


class AdapterCounts:
    """The engine's adapter counters (its table's loads and evictions, monotonic) as metrics, read with each load
    report: ints the engine thread only adds to, read on the event loop."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.loads = self.evictions = 0

    def count(self, load: wire.InstanceLoad) -> None:
        adapters = self.engine.adapters
        if adapters is None:
            return
        loads, evictions = adapters.table.loads, adapters.table.evictions
        M_ADAPTER_LOADS.inc(loads - self.loads)
        M_ADAPTER_EVICTIONS.inc(evictions - self.evictions)
        self.loads, self.evictions = loads, evictions
        M_ADAPTERS_HELD.set(len(load.adapters))
