"""Each simulated instance's llumlet (llumnixctl/experiments/sim/simulate.py): the instance daemon's own parts
(daemons/instance/), built as ``daemons.instance.Instance`` builds them, on the simulation's virtual clock:

- ``Intake`` (Submits in at the boundary, give-backs while draining), ``Mailbox`` (engine calls at a boundary),
  ``StepLoop`` (schedule -> step -> postprocess, the sim's paced path: a step takes the model time the engine's
  latency model returns), ``TokenPath`` (tokens out, the request table advanced), ``Handovers`` (what a prefill
  instance offers the manager), ``Orders`` (a MigrateStart: which requests go, at most ``migration.max_in_flight``
  at once) and ``Control`` (the manager protocol's handler table: SetRole, SetDraining, MigrateStart);
- what the simulator supplies is their I/O: ``ManagerLine`` (to the manager a report lag late, from it through
  ``ManagerWire``, the manager's socket, a message late), ``ProxyPort`` (what the instance sends a proxy reaches
  the simulation at once: ``Site.from_instance``) and ``MigratorTap`` (each migration's end, for the figures).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Callable, Mapping, Protocol

from daemons import metrics, wire

if TYPE_CHECKING:
    from llumnixctl.experiments.sim.parts import SimulatedInstance


class Site(Protocol):
    now: float
    instances: Mapping  # instance id -> SimulatedInstance

    def at(self, t: float, fn: Callable, *args) -> None: ...

    def from_instance(self, inst: SimulatedInstance, msg: wire.Message) -> None: ...  # to the proxy


class ManagerLine:
    """The instance's line to the manager (daemons/instance/tokens.py ``ManagerLine``): what it tells reaches the
    manager's own handler table (``Manager.handle``) ``lag_s`` later; what the manager sends it (``ManagerWire``)
    waits in ``inbox`` for its ``Control``."""

    def __init__(self, ident: bytes, mgr, lag_s: float, site: Site) -> None:
        self.ident, self.mgr, self.lag_s, self.site = ident, mgr, lag_s, site
        self.inbox: asyncio.Queue = asyncio.Queue()

    def tell(self, msg: wire.Message) -> None:
        self.site.at(self.site.now + self.lag_s, self._deliver, msg)

    def _deliver(self, msg: wire.Message) -> None:
        if isinstance(msg, wire.LoadReport):  # (most messages: answered at once, never a reply the sim reads)
            self.mgr.on_report(self.ident, msg)
        else:
            self.mgr.spawn(self.mgr.handle(self.ident, msg))

    async def recv(self) -> wire.Message:
        return await self.inbox.get()


class _Sent:
    def __await__(self):
        return iter(())


class ManagerWire:
    """The manager's socket in the simulation (``Manager(sock=...)``): each message it sends an instance reaches
    that instance's ``ManagerLine`` ``message_s`` later (nothing reaches an instance that stopped). The orders
    it carries are noted (``on_order``)."""

    def __init__(self, message_s: float, site: Site, on_order: Callable[[str, wire.MigrateStart], None]) -> None:
        self.message_s, self.site, self.on_order = message_s, site, on_order
        self.by_ident: dict[bytes, SimulatedInstance] = {}

    def send_multipart(self, frames, flags: int = 0) -> _Sent:
        inst = self.by_ident.get(bytes(frames[0]))
        msg = wire.decode(bytes(frames[1]))
        if inst is not None and inst.gone is None and msg is not None:
            if isinstance(msg, wire.MigrateStart):
                self.on_order(inst.iid, msg)
            self.site.at(self.site.now + self.message_s, inst.line.inbox.put_nowait, msg)
        return _Sent()


class ProxyPort:
    """The instance's links to proxies (daemons/proxylinks.py ``ProxyLinks``) as its ``TokenPath`` and ``Intake``
    use them: every message reaches the simulation at once."""

    def __init__(self, inst: SimulatedInstance, site: Site) -> None:
        self.inst, self.site = inst, site

    def send(self, address: str, msg: wire.Message) -> None:
        self.site.from_instance(self.inst, msg)

    def flush(self) -> None:
        pass

    def seen(self, address: str) -> None:
        pass

    def drop(self, address: str) -> None:
        pass


class MigratorTap:
    """The migrator as the instance's ``Orders`` and ``StepLoop`` reach it; ``ended(src, dst, request_id, outcome,
    started)`` hears each migration out as it ends."""

    def __init__(self, inst: SimulatedInstance, ended: Callable) -> None:
        self.inst, self.ended = inst, ended

    def __getattr__(self, name: str):
        return getattr(self.inst.migrator, name)

    async def migrate_out(self, request_id: str, dst: str, dst_address: str, blocking: bool = False,
                          paced: bool = True) -> wire.MigrationOutcome:
        started = self.inst.migrator.clock.monotonic()
        out = await self.inst.migrator.migrate_out(request_id, dst, dst_address, blocking, paced)
        self.ended(self.inst, dst, request_id, out, started)
        return out


def intake(inst: SimulatedInstance, clock, site: Site, ended: Callable) -> None:
    """The llumlet's way in and out on ``inst`` (its engine, request table, mailbox, standing and migrator are
    there): its ``Intake``, ``TokenPath`` and request phases, and the migrator as its parts reach it."""
    from daemons.instance.intake import Intake  # (torch: only once a simulation runs)
    from daemons.instance.shared import Shared
    from daemons.instance.standing import Identity
    from daemons.instance.tokens import TokenPath

    inst.ident_of = Identity(inst.iid, inst.host.request_address)
    proxies = ProxyPort(inst, site)
    inst.phases = metrics.RequestPhases()
    inst.tap = MigratorTap(inst, ended)
    inst.shared = Shared(inst.engine, inst.table, inst.ident_of, inst.standing, inst.mailbox, inst.phases,
                         inst.line.tell, lambda: inst.tap, clock)
    inst.tokens = TokenPath(proxies, inst.table, inst.ident_of)
    inst.intake = Intake(inst.shared, None, inst.tokens, proxies, lambda reply_to: None)


def build(inst: SimulatedInstance, cfg, clock, cache) -> list:
    """The rest of the llumlet's parts on ``inst`` (``intake`` first, then its reporter), wired as the instance
    daemon wires them; the coroutines to run (its step loop, its control)."""
    from daemons.instance.control import Control  # (torch: only once a simulation runs)
    from daemons.instance.handover import Handovers
    from daemons.instance.listings import Listings
    from daemons.instance.selection import Orders
    from daemons.instance.steps import StepLoop, Stepped
    from daemons.watchdog import Faults, Watchdog

    shared, ic = inst.shared, cfg.instance
    listings = Listings(shared, inst.intake.pending)
    inst.handovers = Handovers(shared, cfg.disagg.handover_lease_s)
    inst.stepper = StepLoop(shared, ic, Stepped(inst.intake, listings, inst.tokens, inst.reporter, cache, inst.handovers),
                            Watchdog(ic.step_timeout_s, ic.hung_exit_s, clock), Faults(inst.iid, ""), inst.fit)
    inst.orders = Orders(shared, lambda: inst.reporter.last, inst.intake.redispatch_queued,
                         cfg.migration.max_in_flight)
    control = Control(shared, cfg, inst.line, inst.reporter, lambda: inst.mailbox.call(inst.intake.redispatch_queued),
                      lambda reason: None)
    handlers = {wire.MigrateStart: inst.orders.on_migrate_start,
                wire.ListRequests: lambda msg: listings.on_list_requests(msg.query_id)}
    return [inst.stepper.run(), control.serve(handlers)]
