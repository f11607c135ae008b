"""Prefill/decode roles, off the request path: each prefill instance makes its links to every instance it may hand
requests over to (a decode or mixed one) when either joins or takes its role, not at a request's first handover
(wire.PeerLink; the instance's side is daemons/migration/warmup.py); and a pair of instances whose KV could not
be handed over for their tensor-parallel sizes is refused when the second one joins (``tp_refusal``)."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Iterable

from daemons import wire
from daemons.clock import Clock
from daemons.kv.spec import KvLayout
from daemons.manager.records import InstanceRecord
from daemons.manager.view import ClusterView

log = logging.getLogger("llumnix.manager")

TARGET_ROLES = ("decode", "mixed")  # where a prefill instance's requests may go


def tp_size(info: wire.Register) -> int:
    """An instance's tensor-parallel size, from the KV layout it registered with (1 if it said none)."""
    try:
        return int(KvLayout.parse(info.kv_spec).get("tp", 1))
    except ValueError:
        return 1


def tp_refusal(msg: wire.Register, others: Iterable[InstanceRecord]) -> str:
    """Why an instance joining with ``msg`` must be refused, or "": a decode instance's tensor-parallel size
    must be at least every prefill instance's (the KV a prefill instance hands over is sharded over its ranks;
    a decode instance with fewer ranks could not take it), whichever of the two joins second."""
    role, tp = msg.load.role, tp_size(msg)
    if role not in ("prefill", "decode"):
        return ""
    for r in others:
        if r.state == "dead" or r.instance_id == msg.instance_id or r.load.role not in ("prefill", "decode"):
            continue
        other = tp_size(r.info)
        if role == "decode" and r.load.role == "prefill" and tp < other:
            prefill, p_tp, decode, d_tp = r.instance_id, other, msg.instance_id, tp
        elif role == "prefill" and r.load.role == "decode" and other < tp:
            prefill, p_tp, decode, d_tp = msg.instance_id, tp, r.instance_id, other
        else:
            continue
        return (f"instance {msg.instance_id} ({role}) refused: decode instance {decode} has tensor-parallel size "
                f"{d_tp}, smaller than prefill instance {prefill}'s {p_tp}; a decode instance's "
                f"vllm.tensor_parallel_size must be at least every prefill instance's")
    return ""


def wanted(records: Iterable[InstanceRecord]) -> set[tuple[str, str]]:
    """(prefill instance, instance it may hand over to) for every live pair, while any instance is prefill."""
    live = [r for r in records if r.state == "alive"]
    prefill = [r.instance_id for r in live if r.load.role == "prefill"]
    targets = [r.instance_id for r in live if r.load.role in TARGET_ROLES]
    return {(p, t) for p in prefill for t in targets if p != t}


class HandoverLinks:
    """Owns ``told``: which prefill instance was told to link to which target, as each of the two processes
    was then (a restarted one, or one at a new address, is told anew)."""

    def __init__(self, cluster: ClusterView, clock: Clock, send: Callable[[InstanceRecord, wire.Message], None],
                 interval_s: float):
        self.cluster = cluster
        self.clock = clock
        self.send = send
        self.interval_s = interval_s
        self.told: set[tuple] = set()

    @staticmethod
    def _incarnation(r: InstanceRecord) -> tuple:
        return r.instance_id, r.info.pid, r.info.request_address

    def check(self) -> int:
        """Tell each prefill instance the targets it has not heard of yet; how many messages went."""
        recs = {r.instance_id: r for r in self.cluster.records()}
        now: set[tuple] = set()
        sent = 0
        for p, t in sorted(wanted(recs.values())):
            src, dst = recs[p], recs[t]
            key = (self._incarnation(src), self._incarnation(dst))
            now.add(key)
            if key not in self.told:
                self.send(src, wire.PeerLink(t, dst.info.request_address))
                log.info("prefill instance %s: make the links to %s now (%s)", p, t, dst.load.role)
                sent += 1
        self.told = now  # pairs no longer wanted are told again if they come back
        return sent

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.check()
            await self.clock.sleep(self.interval_s)
