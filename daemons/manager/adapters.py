"""The LoRA adapters the cluster serves (``llumnixctl lora``, the proxies' /v1/load_lora_adapter and
/v1/unload_lora_adapter): the catalogue (name -> path: lora.adapters, then loads and unloads), which the
snapshots carry to the proxies, and the orders out to the instances that load and unload them. Which
instances hold an adapter is what their load reports say (``InstanceLoad.adapters``)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

from daemons import metrics, wire
from daemons.config import Config, parse_adapters
from daemons.manager.records import InstanceRecord
from daemons.manager.view import ClusterView

log = logging.getLogger("llumnix.manager")

ORDER_TIMEOUT_S = 60.0  # an instance loads an adapter at its next step boundary: its read may take seconds

M_ADAPTER_REPLICAS = metrics.gauge("manager", "llumnix_manager_adapter_replicas",
                                   "Instances that hold each LoRA adapter (their last load reports)", ["adapter"])


def can_hold(rec: InstanceRecord) -> bool:
    """The instance serves LoRA adapters (lora.slots > 0: slots free or held)."""
    return rec.load.adapter_slots > 0 or bool(rec.load.adapters)


@dataclass
class Order:
    done: asyncio.Future
    missing: set[str]
    outcomes: dict[str, wire.AdapterOutcome]


class Adapters:
    """Owns the catalogue and the orders in flight (by query id)."""

    def __init__(self, cfg: Config, cluster: ClusterView, send: Callable[[InstanceRecord, wire.Message], None],
                 next_id: Callable[[], int], timeout_s: float = ORDER_TIMEOUT_S):
        self.catalogue: dict[str, str] = parse_adapters(cfg.lora.adapters)
        self.base = cfg.model.name
        self.max_replicas = cfg.lora.max_replicas
        self.cluster = cluster
        self.send = send
        self.next_id = next_id
        self.timeout_s = timeout_s
        self.orders: dict[int, Order] = {}

    # ------------------------------------------------------------------ reading

    def live(self) -> list[InstanceRecord]:
        return [r for r in self.cluster.records() if r.state == "alive"]

    def holders(self, name: str) -> list[str]:
        return sorted(r.instance_id for r in self.cluster.records() if r.state != "dead" and name in r.load.adapters)

    def rows(self) -> list[wire.AdapterRow]:
        """Each adapter served or held, with its holders; the replicas gauge follows."""
        names = sorted(set(self.catalogue) | {a for r in self.live() for a in r.load.adapters})
        rows = [wire.AdapterRow(n, self.catalogue.get(n, ""), self.holders(n)) for n in names]
        for row in rows:
            M_ADAPTER_REPLICAS.labels(row.name).set(len(row.instances))
        return rows

    def served(self) -> dict[str, str]:
        """The catalogue, for a snapshot (the proxies serve these); the replicas gauge is brought up to date."""
        if self.catalogue or any(r.load.adapters for r in self.cluster.records()):
            self.rows()
        return dict(self.catalogue)

    # ------------------------------------------------------------------ the operator's verbs

    async def on_query(self, msg: wire.LoraQuery) -> wire.Message:
        if msg.op == "list":
            return wire.LoraReply(msg.query_id, self.rows())
        if msg.op not in ("load", "unload"):
            return wire.ErrorReply(msg.query_id, f"unknown LoRA operation {msg.op!r} (load, unload or list)")
        if not msg.name:
            return wire.ErrorReply(msg.query_id, "name the adapter")
        unknown = [i for i in msg.instances if self.cluster.get(i) is None or self.cluster.get(i).state == "dead"]
        if unknown:
            return wire.ErrorReply(msg.query_id, f"adapter {msg.name!r}: no live instance {', '.join(unknown)} "
                                                 f"(see llumnixctl status)")
        return await (self._load(msg) if msg.op == "load" else self._unload(msg))

    async def _load(self, msg: wire.LoraQuery) -> wire.Message:
        name, path = msg.name, msg.path
        if name == self.base:
            return wire.ErrorReply(msg.query_id, f"adapter {name!r}: that is the base model's name (model.name)")
        if not path:
            return wire.ErrorReply(msg.query_id, f"adapter {name!r}: give the path of its directory")
        known = self.catalogue.get(name)
        if known is not None and known != path:
            return wire.ErrorReply(msg.query_id, f"adapter {name!r} is loaded from {known!r}; unload it before "
                                                 f"loading {path!r} under that name")
        targets = [self.cluster.get(i) for i in msg.instances] or self._targets(name)
        if not targets:
            return wire.ErrorReply(msg.query_id, f"adapter {name!r}: no live instance serves LoRA adapters "
                                                 f"(lora.slots is 0 on every instance)")
        outcomes = await self._order(targets, "load", name, path)
        if not any(o.ok for o in outcomes):
            return wire.ErrorReply(msg.query_id, "; ".join(f"{o.instance_id}: {o.message}" for o in outcomes))
        if known is None:
            log.info("adapter %s (%s) served, held by %s", name, path, ", ".join(o.instance_id for o in outcomes if o.ok))
        self.catalogue[name] = path
        return wire.LoraReply(msg.query_id, [r for r in self.rows() if r.name == name], outcomes)

    def _targets(self, name: str) -> list[InstanceRecord]:
        """Every live instance that serves adapters, within lora.max_replicas: holders first, then the most free
        adapter slots."""
        able = sorted((r for r in self.live() if can_hold(r)),
                      key=lambda r: (name not in r.load.adapters, -r.load.adapter_slots, r.instance_id))
        return able[:self.max_replicas] if self.max_replicas else able

    async def _unload(self, msg: wire.LoraQuery) -> wire.Message:
        name = msg.name
        holders = self.holders(name)
        if name not in self.catalogue and not holders and not msg.instances:
            return wire.ErrorReply(msg.query_id, f"adapter {name!r} is not loaded (llumnixctl lora list)")
        if not msg.instances:
            self.catalogue.pop(name, None)  # first: proxies stop sending requests for it
        names = msg.instances or [r.instance_id for r in self.live() if can_hold(r)]
        outcomes = await self._order([self.cluster.get(i) for i in names], "unload", name)
        log.info("adapter %s unloaded from %s", name, ", ".join(o.instance_id for o in outcomes if o.ok) or "nowhere")
        return wire.LoraReply(msg.query_id, self.rows(), outcomes)

    async def _order(self, targets: list[InstanceRecord], op: str, name: str, path: str = "") -> list[wire.AdapterOutcome]:
        qid = self.next_id()
        order = Order(asyncio.get_running_loop().create_future(), {r.instance_id for r in targets}, {})
        self.orders[qid] = order
        for r in targets:
            self.send(r, wire.LoraOrder(qid, op, name, path))
        try:
            await asyncio.wait_for(asyncio.shield(order.done), self.timeout_s)
        except asyncio.TimeoutError:
            pass
        finally:
            self.orders.pop(qid, None)
        late = [wire.AdapterOutcome(i, False, f"no answer within {self.timeout_s:g}s") for i in sorted(order.missing)]
        return [*(order.outcomes[i] for i in sorted(order.outcomes)), *late]

    def on_result(self, msg: wire.LoraResult) -> None:
        order = self.orders.get(msg.query_id)
        if order is None or msg.instance_id not in order.missing:
            return
        order.missing.discard(msg.instance_id)
        order.outcomes[msg.instance_id] = wire.AdapterOutcome(msg.instance_id, msg.ok, msg.message)
        if not order.missing and not order.done.done():
            order.done.set_result(None)
