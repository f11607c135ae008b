"""An in-process manager on virtual time: the real ``daemons.manager.Manager`` core (its handlers, heartbeat watch,
pairing loop, drains and orders), with its ROUTER socket replaced by an in-memory one (``Wire``) and its
connection watch by links the scenario sets (``Links``), among scripted instances (``Inst``).

Everything runs on one virtual-time event loop (tests/support/virtual.py): a scenario says what happens in
which order, the manager's timers run on virtual seconds, and the outcome is the same on every run and every
machine. A scenario is an ``async def`` given the bench::

    def test_x():
        async def scenario(b: Bench):
            i0, i1 = b.instance("i0"), b.instance("i1")
            i0.reporting = False
            await b.heartbeats(10)
            ...
        Bench.run(scenario)
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from daemons import wire
from daemons.config import load_config
from daemons.links import UNKNOWN, UP
from daemons.manager import Manager
from tests.support import virtual

BLOCK = 16


class _Sent:
    """What the manager's ``await sock.send_multipart(...)`` gets: already done."""

    def __await__(self):
        return iter(())


class Wire:
    """Stands in for the manager's ROUTER socket: every message it sends is decoded, logged, and handed to the
    peer with that identity (its inbox), if the scenario made one."""

    def __init__(self) -> None:
        self.inboxes: dict[bytes, asyncio.Queue] = {}
        self.log: list[tuple[bytes, wire.Message]] = []

    def send_multipart(self, frames, flags: int = 0) -> _Sent:
        ident, frame = bytes(frames[0]), bytes(frames[1])
        msg = wire.decode(frame)
        assert msg is not None, f"the manager sent an undecodable frame to {ident!r}"
        self.log.append((ident, msg))
        inbox = self.inboxes.get(ident)
        if inbox is not None:
            inbox.put_nowait(msg)
        return _Sent()

    def sent(self, ident: bytes, kind: type) -> list:
        return [m for to, m in self.log if to == ident and isinstance(m, kind)]


class Links:
    """Stands in for daemons.links.LinkWatch: each instance's connection is in the state the scenario sets."""

    def __init__(self, on_change: Callable[[str, str], None]) -> None:
        self.on_change = on_change
        self.states: dict[str, str] = {}

    def state(self, key: str) -> str:
        return self.states.get(key, UNKNOWN)

    def set(self, key: str, state: str) -> None:
        if self.states.get(key) != state:
            self.states[key] = state
            self.on_change(key, state)

    def forget(self, key: str) -> None:
        self.states.pop(key, None)

    def close(self) -> None:
        pass


@dataclass
class Inst:
    """A scripted instance: it registers, reports ``load`` every heartbeat while ``reporting``, counts the
    requests it is sent, and answers the manager as its fields say."""

    bench: Bench
    iid: str
    load: wire.InstanceLoad
    ident: bytes = b""
    reporting: bool = True
    seq: int = 0
    # How it answers a MigrateStart: after ``migrate_after_s`` virtual seconds with ``migrate_outcome`` for
    # each request asked for (None: never answers, as a source whose result is lost).
    migrate_after_s: float | None = 0.5
    migrate_outcome: str = "committed"
    list_requests: list[wire.RequestLoad] | None = field(default_factory=list)  # None: never answers
    inbox: asyncio.Queue = field(default_factory=asyncio.Queue)

    @property
    def address(self) -> str:
        return f"inproc://scripted-{self.iid}"  # not tcp:// or ipc://: the manager watches no socket of ours

    def register_msg(self) -> wire.Register:
        return wire.Register(self.iid, "host-" + self.iid, 1000 + len(self.bench.instances), self.address, "sim",
                             "m", self.load)

    async def report(self) -> None:
        self.seq += 1
        await self.bench.deliver(self.ident, wire.LoadReport(self.iid, self.seq, self.load))

    def took(self, n: int = 1, blocks: int = 0) -> None:
        """``n`` requests arrived (dispatched or migrated in; the next report counts them)."""
        load = self.load
        self.load = wire.InstanceLoad(**{**_fields(load), "requests_received": load.requests_received + n,
                                         "running": load.running + n, "blocks_used": load.blocks_used + blocks})

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(self.bench.heartbeat)
            if self.reporting:
                await self.report()

    async def _serve(self) -> None:
        while True:
            msg = await self.inbox.get()
            if isinstance(msg, wire.MigrateStart) and self.migrate_after_s is not None:
                self.bench.spawn(self._migrate(msg))
            elif isinstance(msg, wire.ListRequests) and self.list_requests is not None:
                await self.bench.deliver(self.ident, wire.RequestList(msg.query_id, self.iid, list(self.list_requests)))
            elif isinstance(msg, wire.Shutdown):  # as a stopping instance: goodbye, then it is gone
                self.reporting = False
                await self.bench.deliver(self.ident, wire.Goodbye(self.iid, msg.reason))

    async def _migrate(self, msg: wire.MigrateStart) -> None:
        await asyncio.sleep(self.migrate_after_s)
        ids = msg.request_ids or [f"{self.iid}-r{k}" for k in range(max(msg.count, 1))]
        outcomes = [wire.MigrationOutcome(rid, self.iid, msg.dst, self.migrate_outcome) for rid in ids]
        if self.migrate_outcome == "committed":  # they left: the next report says so
            moved = min(len(ids), self.load.running)
            per = self.load.blocks_used // self.load.running if self.load.running else 0
            self.load = wire.InstanceLoad(**{**_fields(self.load), "running": self.load.running - moved,
                                             "blocks_used": self.load.blocks_used - moved * per,
                                             "migrations_committed": self.load.migrations_committed + moved})
            dst = self.bench.instances.get(msg.dst)
            if dst is not None:
                dst.took(moved, blocks=moved * per)
        await self.bench.deliver(self.ident, wire.MigrateResult(msg.query_id, self.iid, outcomes))


def _fields(s) -> dict:
    return {f: getattr(s, f) for f in s.__struct_fields__}


def load(blocks_total: int = 100, blocks_used: int = 0, running: int = 0, **kw) -> wire.InstanceLoad:
    return wire.InstanceLoad(blocks_total=blocks_total, blocks_used=blocks_used, running=running, waiting=0,
                             batch_size=8, block_size=BLOCK, **kw)


class Bench:
    """The manager core and the scripted peers around it, on one virtual-time loop."""

    SETTINGS = ["manager.heartbeat_interval_s=0.2", "manager.query_timeout_s=0.5"]

    def __init__(self, loop: virtual.VirtualTimeLoop, sets: list[str]) -> None:
        self.loop = loop
        self.wire = Wire()
        self.m = Manager(load_config(None, self.SETTINGS + sets), clock=virtual.LoopClock(loop), sock=self.wire)
        self.links = Links(self.m.liveness.link_changed)
        self.m.liveness.links = self.links
        self.heartbeat = self.m.mc.heartbeat_interval_s
        self.instances: dict[str, Inst] = {}
        self.stop = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._qids = itertools.count(1)
        self.spawn(self.m.liveness.watch_heartbeats(self.stop))
        self.spawn(self.m.resched.orders.pairing_loop())

    @classmethod
    def run(cls, scenario: Callable[[Bench], Awaitable], sets: list[str] = ()):
        async def main(loop):
            bench = cls(loop, list(sets))
            try:
                return await scenario(bench)
            finally:
                bench.close()
        return virtual.run(main)

    def close(self) -> None:
        self.stop.set()
        for t in self._tasks:
            t.cancel()
        self.m.sec.close()
        self.m.ctx.destroy(linger=0)

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @property
    def now(self) -> float:
        return self.loop.time()

    async def deliver(self, ident: bytes, msg: wire.Message) -> None:
        """As the manager's socket loop does with one message from ``ident``."""
        await self.m.handle(ident, msg)

    def instance(self, iid: str, link: str = UP, told: dict | None = None, **load_kw) -> Inst:
        """A new instance, registered now (its connection ``link``), reporting every heartbeat. ``told``: what
        it says in its registration that it was told before (``drain_reason``, ``cordoned``, ``uptime_s``)."""
        inst = Inst(self, iid, load(**load_kw), ident=f"sock-{iid}-{len(self.wire.inboxes)}".encode())
        self.instances[iid] = inst
        self.wire.inboxes[inst.ident] = inst.inbox
        self._register(inst, **(told or {}))
        self.links.set(iid, link)
        self.spawn(inst._report_loop())
        self.spawn(inst._serve())
        return inst

    def _register(self, inst: Inst, **told) -> None:
        msg = inst.register_msg()
        reply = self.m.on_register(inst.ident, wire.Register(**{**_fields(msg), **told}) if told else msg)
        assert isinstance(reply, wire.RegisterAck) and reply.accepted, reply

    def restart(self, inst: Inst) -> None:
        """Its process restarted: a new socket (identity) under the same instance id; it has not registered."""
        del self.wire.inboxes[inst.ident]
        inst.ident = f"sock-{inst.iid}-{len(self.wire.inboxes) + 100}".encode()
        inst.inbox = asyncio.Queue()
        self.wire.inboxes[inst.ident] = inst.inbox
        self.spawn(inst._serve())

    async def heartbeats(self, n: float) -> None:
        """Let ``n`` heartbeat intervals of virtual time pass."""
        await asyncio.sleep(n * self.heartbeat)

    async def until(self, cond: Callable[[], bool], within_s: float, what: str) -> float:
        """Wait (virtual time) until ``cond()``; the virtual seconds it took. Fails past ``within_s``."""
        start = self.now
        while not cond():
            if self.now - start > within_s:
                raise AssertionError(f"{what}: not within {within_s:g} virtual seconds")
            await asyncio.sleep(self.heartbeat / 20)
        return self.now - start

    def dispatch(self, n: int, prompt_tokens: int = 16, priority: int = 0, exclude: list[str] = ()) -> list[str]:
        """One batch of ``n`` dispatch queries, as the manager's socket loop answers them: the chosen instance
        ids (the instances are told nothing: call ``took`` on them when the requests arrive)."""
        msgs = [wire.Dispatch(next(self._qids), f"req-{next(self._qids)}", prompt_tokens, priority, list(exclude))
                for _ in range(n)]
        return [r.instance_id for r in self.m.on_dispatch_batch(msgs)]

    def state(self, iid: str) -> str:
        return self.m.instances[iid].state

    def view(self, iid: str) -> wire.InstanceView:
        return next(v for v in self.m.view(self.now) if v.instance_id == iid)

    async def ask(self, msg: wire.Message, ident: bytes = b"operator") -> wire.Message:
        """An admin query, answered as the manager answers its socket (at once or later); the reply."""
        inbox = self.wire.inboxes.setdefault(ident, asyncio.Queue())
        await self.deliver(ident, msg)
        return await inbox.get()


def capture(caplog) -> Callable[[], str]:
    """The manager's log lines so far (pytest's caplog at INFO for llumnix.manager)."""
    caplog.set_level(logging.INFO, logger="llumnix.manager")
    return lambda: "\n".join(r.getMessage() for r in caplog.records if r.name == "llumnix.manager")
