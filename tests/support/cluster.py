"""A whole cluster in one process on virtual time: the real manager, instances (sim engine, llumlet, migrator)
and the proxy's cluster client, as the daemons run them, wired by ZeroMQ's in-process transport (inproc://:
in-memory queues, delivered in the sending thread) with KV moved in memory (tests/support/kv.py), on one
virtual-time event loop (tests/support/virtual.py).

One thread and no network: whatever a scenario does happens in the order the code and the timers say, and a
protocol run of minutes takes milliseconds. What the harness cannot show is left to the e2e tests: real TCP
connections and their keepalives (inproc connections are never watched: liveness falls back to the
heartbeat rules), Gloo, the HTTP front end, separate processes.

    def test_x():
        async def scenario(c: VirtualCluster):
            s = await c.request(max_tokens=50)
            await c.tokens(s, 5)
            ...
        VirtualCluster.run(scenario, instances=2)
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Awaitable, Callable

import zmq
import zmq.asyncio

from daemons import runtime, wire
from daemons.config import load_config
from daemons.engine.sim import SimEngine, sim_token_id
from daemons.instance import Instance
from daemons.manager import Manager
from daemons.proxy.cluster.client import ClusterClient, Stream
from daemons.watchdog import EXIT_HUNG, Faults
from tests.support import virtual
from tests.support.kv import Hub

class SharedContext(zmq.asyncio.Context):
    """A daemon's view of the process's one ZeroMQ context (inproc:// works only within one): its ``destroy``
    closes the daemon's own sockets and leaves the context to the others."""

    def term(self) -> None:
        pass


SETTINGS = ["manager.heartbeat_interval_s=0.2", "manager.metrics_port=-1", "instance.metrics_port=-1",
            "instance.shutdown_grace_s=1", "manager.address=inproc://manager"]


class VirtualCluster:
    def __init__(self, loop: virtual.VirtualTimeLoop, sets: list[str], kv_bytes_per_s: float = 0.0) -> None:
        self.loop = loop
        self.sets = SETTINGS + sets
        self.cfg = load_config(None, self.sets)
        self.hub = Hub(kv_bytes_per_s)
        self.zmq = zmq.asyncio.Context()
        self.clock = virtual.LoopClock(loop)
        self._contexts: list[SharedContext] = []  # the daemons' views of the context, each tracking its sockets
        self.manager = self.new_manager()
        self.instances: dict[str, Instance] = {}
        self.runs: dict[str, asyncio.Task] = {}
        self.exits: dict[str, int] = {}  # instances that exited by themselves (the watchdog's), and their status
        self.proxy: ClusterClient | None = None
        self._rids = itertools.count(1)
        self._managers = 0  # restarts

    def context(self) -> SharedContext:
        ctx = SharedContext.shadow(self.zmq.underlying)
        self._contexts.append(ctx)
        return ctx

    def new_manager(self, cfg=None) -> Manager:
        m = Manager(cfg or self.cfg, clock=self.clock, ctx=self.context())
        m.resched.launcher.start = self.launched  # scaling.launcher starts instances here, in process
        return m

    async def launched(self, cmd: str, iid: str) -> int:
        """A launch (scaling.launcher, any command): instance ``iid`` starts in process; the command "exits"
        0 at once, as ``systemctl start`` does."""
        self.add(iid)
        return 0

    @classmethod
    def run(cls, scenario: Callable[[VirtualCluster], Awaitable], instances: int = 2, sets: list[str] = (),
            kv_bytes_per_s: float = 0.0, faults: dict[str, str] | None = None):
        """Run ``scenario(cluster)`` on a fresh virtual-time loop with ``instances`` instances (i0, i1, ...);
        ``kv_bytes_per_s``: how fast migrations copy KV (0: at once); ``faults``: by instance id (see ``add``)."""
        async def main(loop):
            c = cls(loop, list(sets), kv_bytes_per_s)
            try:
                await c.start(instances, faults or {})
                return await scenario(c)
            finally:
                await c.close()
        return virtual.run(main)

    # ------------------------------------------------------------------ life cycle

    async def start(self, instances: int, faults: dict[str, str] | None = None) -> None:
        self.runs["manager"] = asyncio.ensure_future(self.manager.run())
        for i in range(instances):
            self.add(f"i{i}", faults=(faults or {}).get(f"i{i}", ""))
        proxy_cfg = load_config(None, self.sets + ["proxy.token_address=inproc://proxy"])
        self.proxy = ClusterClient(proxy_cfg, ctx=self.context(), clock=self.clock)
        await self.proxy.start()
        await self.until(lambda: len(self.proxy.alive()) == instances, 10, "the instances did not come up")

    def add(self, iid: str, *sets: str, faults: str = "") -> Instance:
        """Instance ``iid`` with ``sets``; ``faults``: as $LLUMNIX_FAULTS (daemons/watchdog.py), for it alone
        (default: that variable).
        Its watchdog judges on the virtual clock; a hung instance "exits" with EXIT_HUNG (``exits``)."""
        cfg = load_config(None, self.sets + [f"instance.id={iid}", "instance.backend=sim",
                                             f"instance.request_address=inproc://{iid}", *sets])
        engine = SimEngine(cfg.sim, cfg.model, kv_tier=cfg.kv_tier, clock=self.clock.monotonic)  # (as the daemon's)
        inst = Instance(cfg, engine, kv=self.hub.transport(iid), ctx=self.context(),
                        clock=self.clock, faults=Faults(iid, faults or None))  # none given: $LLUMNIX_FAULTS
        inst.watchdog.on_hung = lambda: self.exited(iid, EXIT_HUNG)
        self.instances[iid] = inst
        self.runs[iid] = asyncio.ensure_future(inst.run())
        return inst

    async def join(self, iid: str, *sets: str) -> Instance:
        """``add``, then wait until the proxy counts the new instance among those that take requests."""
        inst = self.add(iid, *sets)
        await self.until(lambda: iid in {v.instance_id for v in self.proxy.alive()}, 10, f"{iid} did not join")
        return inst

    def _cancel_tasks_of(self, *owners) -> None:
        for task in asyncio.all_tasks(self.loop):
            frame = task.get_coro().cr_frame
            if frame is not None and any(frame.f_locals.get("self") is o for o in owners):
                task.cancel()

    def kill(self, iid: str) -> None:
        """As kill -9: every task of the instance (its loops, its migrations) ends where it is, its sockets
        close, nothing is said."""
        inst = self.instances.pop(iid)
        self.runs.pop(iid).cancel()
        self._cancel_tasks_of(*inst.parts)
        inst.watchdog.stop()
        inst.ctx.destroy(linger=0)

    def exited(self, iid: str, status: int) -> None:
        """The instance exits by itself with ``status`` (as os._exit: nothing more is said)."""
        self.exits[iid] = status
        self.kill(iid)

    def kill_proxy(self) -> None:
        """As kill -9 of the proxy: its tasks end, its sockets close, it tells nobody (no aborts)."""
        p = self.proxy
        self._cancel_tasks_of(p)
        for t in p.essential:
            t.cancel()
        p.sec.close()
        p.ctx.destroy(linger=0)
        self.proxy = None

    async def restart_proxy(self) -> ClusterClient:
        """As kill -9 of the proxy, then a new one at the same token address (``proxy.token_address`` set, as an
        operator's unit has it): it knows none of the old one's streams."""
        address = self.proxy.token_address
        self.kill_proxy()
        cfg = load_config(None, self.sets + [f"proxy.token_address={address}"])
        # The old socket's name is released by ZeroMQ's reaper thread (real time, a moment): bind when it is.
        deadline = time.monotonic() + 10
        while True:
            proxy = ClusterClient(cfg, ctx=self.context(), clock=self.clock)
            try:
                await proxy.start()
                break
            except runtime.StartupError:
                proxy.sec.close()
                proxy.ctx.destroy(linger=0)
                assert time.monotonic() < deadline, f"{address} was not released"
                time.sleep(0.001)
        self.proxy = proxy
        # Over TCP the instances' PUSH sockets reconnect by themselves; an inproc connection whose peer closed
        # is never made again, so the harness makes it, as the reconnect timer would.
        for inst in self.instances.values():
            link = inst.proxies.links.get(address)
            if link is not None:
                try:
                    link.sock.disconnect(address)
                except zmq.ZMQError:  # the connection went with its peer
                    pass
                link.sock.connect(address)
        return proxy

    async def restart_manager(self) -> Manager:
        """As kill -9 of the manager, then a new one on its address: it keeps no state, all it knows comes
        back from the instances' registrations and reports."""
        old = self.manager
        self.runs["manager"].cancel()
        self._cancel_tasks_of(*old.parts())
        await asyncio.gather(self.runs["manager"], return_exceptions=True)
        self._close_manager(old)
        # Over TCP, ZeroMQ reconnects the daemons to the new manager by itself; an inproc connection whose
        # peer closed is never made again, so the harness makes it, as the reconnect timer would. To a new
        # name: the old one is released only once ZeroMQ's reaper thread has closed the old socket.
        self._managers += 1
        old_address, address = old.mc.address, f"{self.cfg.manager.address}-{self._managers}"
        self.manager = self.new_manager(load_config(None, self.sets + [f"manager.address={address}"]))
        self.runs["manager"] = asyncio.ensure_future(self.manager.run())
        for sock in [inst.manager for inst in self.instances.values()] + [self.proxy.manager]:
            sock.disconnect(old_address)
            sock.connect(address)
        return self.manager

    @staticmethod
    def _close_manager(m: Manager) -> None:
        m.links.close()
        m.sec.close()
        m.ctx.destroy(linger=0)

    async def close(self) -> None:
        if self.proxy is not None:
            await self.proxy.stop()
        for iid in list(self.instances):
            inst = self.instances.pop(iid)
            inst.stop.set()
        await asyncio.gather(*(t for k, t in self.runs.items() if k != "manager"), return_exceptions=True)
        self.runs["manager"].cancel()
        await asyncio.gather(self.runs["manager"], return_exceptions=True)
        self._close_manager(self.manager)
        # A socket left open (a daemon's task cancelled before it closed its own) would make the context's
        # termination wait for ever (zmq_ctx_term, in C: no timeout, no signal ends it): close every daemon's.
        for ctx in self._contexts:
            ctx.destroy(linger=0)
        self.zmq.destroy(linger=0)

    # ------------------------------------------------------------------ requests

    async def request(self, max_tokens: int = 20, prompt_tokens: int = 16, priority: int = 0, tenant: str = "",
                      weight: float = 1.0, give_up_s: float = 0.0, fits: tuple[str, ...] = (), request_id: str = "",
                      **sampling) -> Stream:
        """A request through the proxy's cluster client (dispatched by the manager), as the HTTP front end
        sends one; its stream. ``priority`` 1 is the API's "high"; ``tenant``: its API key's name (the fair
        queue between keys), with that key's ``weight``; ``give_up_s``: with no token that long, it ends with 429
        (the front end's slo.give_up_factor times its TTFT target); ``fits``: the instances admission by SLO found
        fit (its verdict's), where the front end places it; ``request_id``: its id (default: the next req-N)."""
        rid = request_id or f"req-{next(self._rids)}"
        params = wire.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
        submit = wire.Submit(rid, list(range(100, 100 + prompt_tokens)), params, self.proxy.token_address,
                             priority=priority)
        return await self.proxy.submit(submit, tenant, weight, give_up_s, fits=fits)

    async def tokens(self, stream: Stream, n: int, within_s: float = 30) -> None:
        """Wait (virtual time) until the stream has at least ``n`` tokens (or ended)."""
        await self.until(lambda: stream.next_index >= n or stream.done, within_s, f"{stream.request_id}: {n} tokens")

    async def result(self, stream: Stream, within_s: float = 120) -> list[wire.TokenOut]:
        """Every output of the stream, once it ended (as a client reads them); the proxy forgets it then."""
        out: list[wire.TokenOut] = []
        end = self.loop.time() + within_s
        while True:
            got = await asyncio.wait_for(stream.take(), max(end - self.loop.time(), 0.001))
            out += got
            if stream.done and not stream.ready:
                break
        self.proxy.finish(stream)
        return out

    def expected(self, stream: Stream, n: int) -> list[int]:
        """The sim's tokens for ``stream``'s first ``n`` indices: what an unmigrated run streams."""
        return [sim_token_id(stream.request_id, i, self.cfg.sim.vocab_size) for i in range(n)]

    def holders(self, request_id: str) -> list[str]:
        """The instances whose request tables hold the request (two while a race is being resolved)."""
        return [iid for iid, inst in self.instances.items() if request_id in inst.requests]

    async def migrate(self, request_id: str, dst: str, src: str = "", count: int = 1) -> wire.Message:
        """As `llumnixctl migrate REQ --to DST` (or `--from SRC --count N --to DST`): the manager's answer."""
        query = wire.MigrateQuery(0, dst=dst, request_id=request_id, src=src, count=count)
        return await self.manager.resched.orders.on_migrate(query)

    async def until(self, cond: Callable[[], bool], within_s: float, what: str) -> float:
        start = self.loop.time()
        while not cond():
            if self.loop.time() - start > within_s:
                raise AssertionError(f"{what}: not within {within_s:g} virtual seconds")
            await asyncio.sleep(0.01)
        return self.loop.time() - start
