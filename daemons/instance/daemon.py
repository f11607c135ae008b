"""The instance daemon: the ``Instance``, a facade over the parts that do its work (each in the file named in
daemons/instance/__init__.py), its life cycle (start, serve, shut down with grace), and the CLI."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Annotated, Optional

import typer
import zmq
import zmq.asyncio

from daemons import metrics, runtime, security, wire
from daemons.cli import ConfigFile, LogLevel, Overrides, daemon_main
from daemons.clock import Clock
from daemons.config import Config
from daemons.engine import make_engine
from daemons.engine.base import Engine, EngineError
from daemons.instance.adapters import AdapterOrders
from daemons.instance.attainment import Attainment
from daemons.instance.cache import CacheReports
from daemons.instance.control import Control
from daemons.instance.handover import Handovers
from daemons.instance.intake import Intake
from daemons.instance.listings import Listings
from daemons.instance.mailbox import Mailbox
from daemons.instance.outlook import OutputLengths
from daemons.instance.predictor import StepFit
from daemons.instance.reports import Heartbeats, Reporter
from daemons.instance.selection import Orders
from daemons.instance.standing import Identity, Standing
from daemons.instance.shared import Shared
from daemons.instance.steps import StepLoop, Stepped
from daemons.instance.tokens import ManagerLine, TokenPath
from daemons.kv.ranks import gloo_transport
from daemons.migration import Migrator
from daemons.proxylinks import ProxyLinks
from daemons.requests import RequestTable
from daemons.tracing import Tracer
from daemons.watchdog import Faults, Watchdog

log = logging.getLogger("llumnix.instance")


class Instance:
    """One engine plus its llumlet: builds its parts and wires each to what it needs, starts their loops,
    and shuts down. The migrator (daemons/migration/) runs the migrations in and out; what it needs of the
    instance (``daemons.migration.records.Host``) is read here from the parts that own it."""

    def __init__(self, cfg: Config, engine: Engine, kv=None, ctx: zmq.asyncio.Context | None = None,
                 clock: Clock | None = None, faults: Faults | None = None):
        """``kv``: the migrator's KV transport (default: Gloo pairs; see daemons/migration/migrator.py). ``ctx``:
        the ZeroMQ context its sockets are made in (default: its own; tests/support/cluster.py shares one
        between daemons in one process, for inproc:// addresses). ``clock``: what it reads time from (default:
        the monotonic clock; tests/support passes the virtual loop's). ``faults``: those injected (default:
        from $LLUMNIX_FAULTS)."""
        self.clock = clock or Clock()
        self.cfg = cfg
        self.ic = ic = cfg.instance
        self.tracer = Tracer.create(cfg.tracing, "llumnix-instance", ic.id)  # None: tracing off
        self.kv = kv
        self.engine = engine
        self.ctx = ctx if ctx is not None else zmq.asyncio.Context()
        self.sec = security.Security(cfg.security, "instance", self.ctx)
        self.router = self.sec.server(runtime.tune(self.ctx.socket(zmq.ROUTER)), "instance")
        self.manager = self.sec.client(runtime.tune(self.ctx.socket(zmq.DEALER)), "manager")
        # While the manager is away, reports are dropped rather than queued: a restarted manager must not get
        # a flood of stale ones (it asks us to register, and the next report is current).
        self.manager.setsockopt(zmq.IMMEDIATE, 1)
        self.manager.setsockopt(zmq.SNDHWM, 64)
        self.proxies = ProxyLinks(self.ctx, ic.orphan_timeout_s, secure=lambda sock: self.sec.client(sock, "proxy"),
                                  clock=self.clock)
        self.requests = RequestTable(self.clock)
        self.watchdog = Watchdog(ic.step_timeout_s, ic.hung_exit_s, self.clock)
        self.faults = faults or Faults(ic.id)
        self.migrator: Migrator | None = None  # built when it starts (its KV transport listens)
        self.ident = Identity(ic.id)
        self.standing = Standing(ic.role)
        self.stop = asyncio.Event()
        self.stop_reason = "SIGTERM"
        self.phases = metrics.RequestPhases()  # queue, prefill and decode times of the requests held here
        heartbeat_s = cfg.manager.heartbeat_interval_s

        self.line = ManagerLine(self.manager)
        self.mailbox = Mailbox()
        # (the parts ask for the migrator when they need it)
        shared = Shared(engine, self.requests, self.ident, self.standing, self.mailbox, self.phases, self.line.tell,
                        lambda: self.migrator, self.clock)
        self.attainment = Attainment(cfg.slo.window_s, self.clock)  # SLO judgements of the requests that finish here
        self.tokens = TokenPath(self.proxies, self.requests, self.ident, self.attainment.token)
        self.cache = CacheReports(shared, self.proxies, heartbeat_s)
        self.intake = Intake(shared, self.router, self.tokens, self.proxies, self.cache.on_sync)
        self.listings = Listings(shared, self.intake.pending)
        # The step-time model and the output lengths observed here (the SLO's predictions).
        self.fit = StepFit(engine.prefill_budget, lengths=OutputLengths())
        self.reporter = Reporter(shared, cfg, self.watchdog, self.proxies, self.intake.taken, self.cache, self.fit,
                                 self.attainment)
        self.heartbeats = Heartbeats(
            self.reporter, self.watchdog, self.proxies, self.requests,
            lambda address, why: self.mailbox.call(lambda: self.intake.abort_orphans(address, why)),
            min(heartbeat_s, ic.step_timeout_s / 4), self.clock)
        self.handovers = Handovers(shared, cfg.disagg.handover_lease_s)
        self.stepper = StepLoop(shared, ic, Stepped(self.intake, self.listings, self.tokens, self.reporter, self.cache,
                                                    self.handovers), self.watchdog, self.faults, self.fit)
        self.orders = Orders(shared, lambda: self.reporter.last, self.intake.redispatch_queued,
                             cfg.migration.max_in_flight)
        self.adapters = AdapterOrders(engine, self.mailbox, self.line.tell, self.ident, self.reporter.changed)
        self.control = Control(shared, cfg, self.line, self.reporter,
                               lambda: self.mailbox.call(self.intake.redispatch_queued), self.halt)

    # ------------------------------------------------------------------ what the migrator reads (Host)

    @property
    def instance_id(self) -> str:
        return self.ident.instance_id

    @property
    def request_address(self) -> str:
        return self.ident.request_address

    @property
    def accepting(self) -> bool:
        return self.standing.accepting

    @property
    def draining(self) -> str:
        return self.standing.draining

    @property
    def wake(self) -> asyncio.Event:
        return self.mailbox.wake

    def reply_peer(self, identity: bytes, msg: wire.Message) -> None:
        self.intake.reply(identity, msg)

    def announce_move(self, request_id: str, address: str, instance_id: str, request_address: str, epoch: int,
                      from_index: int) -> None:
        self.tokens.announce_move(request_id, address, instance_id, request_address, epoch, from_index)

    def abort_local(self, request_id: str) -> bool:
        return self.intake.abort_local(request_id)

    # ------------------------------------------------------------------ life cycle

    @property
    def parts(self) -> tuple:
        """The objects whose tasks are the instance's (tests/support/cluster.py cancels them as a kill -9)."""
        return tuple(p for p in (self, self.intake, self.stepper, self.reporter, self.heartbeats, self.orders,
                                 self.control, self.migrator, self.proxies) if p is not None)

    def halt(self, reason: str) -> None:
        """Stop serving (``run`` shuts down), for ``reason``."""
        self.stop_reason = reason
        self.stop.set()

    def build_migrator(self) -> Migrator:
        """The migrator, with the KV transport it moves blocks over: the one given (tests/support moves blocks
        in memory), else Gloo pairs, rank by rank for a tensor-parallel engine (daemons/kv/ranks.py)."""
        kv = self.kv or gloo_transport(self.cfg.migration, self.engine.kv_ranks())
        return Migrator(self, self.cfg.migration, self.engine, self.requests, self.mailbox.call, self.faults, kv,
                        self.clock, self.cfg.kv_tier.pull_timeout_s)

    async def run(self) -> None:
        self.sec.check_bind("instance.request_address", self.ic.request_address)
        self.sec.check_bind("migration.kv_host", self.cfg.migration.kv_host)
        ident = self.ident
        ident.request_address = runtime.bind(self.router, self.ic.request_address)
        if self.ic.advertise_address:
            ident.request_address = self.ic.advertise_address
        if not ident.instance_id:
            ident.instance_id = f"{self.ic.host or socket.gethostname()}-{ident.request_address.rsplit(':', 1)[-1]}"
        self.cache.name(ident.instance_id)
        metrics.bind("instance", self.cfg.model.name, ident.instance_id)
        try:
            self.migrator = self.build_migrator()
        except (RuntimeError, ValueError, OSError) as exc:  # the KV store's port is taken, or the host does not resolve
            raise runtime.StartupError(f"cannot listen for KV transfer on {self.cfg.migration.kv_host}:"
                                       f"{self.cfg.migration.kv_port}: {exc}") from None
        ident.metrics_address = runtime.start_metrics_server(self.ic.metrics_port, self.ic.metrics_host,
                                                             security.metrics_token(self.cfg))
        runtime.connect(self.manager, self.cfg.manager.address)
        self.control.register()
        load = self.engine.load()
        # Before "serving on": whoever reads that line may stop us cleanly at once.
        runtime.install_stop_signals(asyncio.get_running_loop(), self.stop)
        log.info("instance %s serving on %s (backend %s, %d blocks of %d tokens, manager %s, KV transfer %s, "
                 "metrics %s)", ident.instance_id, ident.request_address, self.engine.backend, load.blocks_total,
                 load.block_size, self.cfg.manager.address, self.migrator.kv.address or "pairs meet over ZeroMQ",
                 ident.metrics_address or "off")
        runtime.sd_notify("READY=1")
        self.watchdog.start()
        handlers = {wire.ListRequests: lambda msg: self.listings.on_list_requests(msg.query_id),
                    wire.MigrateStart: self.orders.on_migrate_start,
                    wire.CacheSync: lambda msg: self.cache.on_sync(""),
                    wire.PeerDead: self.on_peer_dead,
                    wire.PeerLink: lambda msg: self.migrator.link(msg.instance_id, msg.request_address),
                    wire.LoraOrder: self.adapters.on_order,
                    wire.Rehome: self.migrator.rehome.on_order}
        tasks = [asyncio.create_task(c) for c in (self.intake.serve(), self.stepper.run(), self.control.serve(handlers),
                                                   self.reporter.run(), self.heartbeats.run())]
        stopped = asyncio.create_task(self.stop.wait())
        done, _ = await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
        failure = next((t.exception() for t in done if t is not stopped and t.exception() is not None), None)
        if failure is not None:
            log.error("instance loop failed: %r", failure, exc_info=failure)  # where: an engine's assertion says nothing
        await self.shutdown(tasks, self.stop_reason if failure is None else f"failed: {failure!r}",
                            grace=self.ic.shutdown_grace_s if failure is None else 0.0)
        if failure is not None:
            raise SystemExit(1)  # let systemd's Restart=on-failure see it

    def on_peer_dead(self, msg: wire.PeerDead) -> None:
        """The manager declared another instance dead: what our migrations with it hold goes at once."""
        if msg.instance_id != self.ident.instance_id and self.migrator is not None:
            self.migrator.peer_dead(msg.instance_id, msg.request_address)

    async def shutdown(self, tasks: list[asyncio.Task], reason: str, grace: float) -> None:
        """Drain, then stop: leave the dispatch set and, for a grace period, let the manager migrate running
        requests out and give queued ones back for re-dispatch (its drain orders do both, once another
        instance can take them), or let them finish; then fail what is left."""
        runtime.sd_notify("STOPPING=1")
        self.control.stop_accepting(reason)
        log.info("stopping: %d requests in flight, draining for up to %.1fs", len(self.requests), grace)
        deadline = self.clock.monotonic() + grace
        while ((len(self.requests) or (self.migrator is not None and self.migrator.busy))
               and self.clock.monotonic() < deadline):
            await self.clock.sleep(0.05)
        self.watchdog.stop()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.migrator is not None:
            await self.migrator.close()
        self.stepper.close()  # a step in flight finishes before we touch the engine
        for rid, entry in list(self.requests.items()):
            self.engine.abort_request(rid)
            # Retryable: the proxy continues the request elsewhere from the tokens it already has.
            self.tokens.fail(rid, entry.reply_to, f"instance {self.ident.instance_id} stopped", retryable=True)
        self.engine.shutdown()
        if self.tracer is not None:
            self.tracer.shutdown()  # the last migrations' spans
        self.proxies.close()  # with its linger: the failures above still go out
        self.sec.close()
        self.ctx.destroy(linger=0)  # closes what is left; term() would wait on any socket still open
        log.info("stopped")


app = typer.Typer(add_completion=False, help="llumnix-instance: one model instance (engine + llumlet).")


@app.command()
def main(
    config: ConfigFile = None,
    id: Annotated[Optional[str], typer.Option("--id", help="instance id shown by llumnixctl and used in metrics and logs (instance.id)")] = None,
    backend: Annotated[Optional[str], typer.Option(help="engine backend: sim or vllm (instance.backend)")] = None,
    manager: Annotated[Optional[str], typer.Option(help="address of the manager (manager.address)")] = None,
    request_address: Annotated[Optional[str], typer.Option(help="address to bind for requests from proxies (instance.request_address)")] = None,
    metrics_port: Annotated[Optional[int], typer.Option(help="port of the Prometheus endpoint on instance.metrics_host; 0 picks a free port, -1 turns it off (instance.metrics_port)")] = None,
    log_level: LogLevel("instance") = None,
    set_: Overrides("; instance.host, instance.advertise_address, model.path, the engine settings and the [migration] settings have no flag of their own and are set this way or in the file") = None,
) -> None:
    """Run one model instance until SIGTERM."""
    daemon_main("llumnix-instance", config, set_, {
        "instance.id": id, "instance.backend": backend, "manager.address": manager,
        "instance.request_address": request_address, "instance.metrics_port": metrics_port,
        "instance.log_level": log_level,
    }, start)


def start(cfg: Config):
    """Check the keys and addresses before loading a model for minutes, load the engine, then run."""
    runtime.lower_priority(cfg.instance.nice)  # the control plane on this host first (instance.nice)
    pre = security.Security(cfg.security, "instance")
    pre.check_bind("instance.request_address", cfg.instance.request_address)
    pre.check_bind("migration.kv_host", cfg.migration.kv_host)
    try:
        engine = make_engine(cfg)
    except EngineError as exc:
        log.error("cannot start the %s engine: %s", cfg.instance.backend, exc)
        raise typer.Exit(1) from None
    return Instance(cfg, engine).run()


def entry() -> None:
    app()
