"""The instance daemon: the ``Instance`` (its state, and a mixin per concern in the file named for it),
its life cycle (start, serve, shut down with grace), and the CLI."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Callable, Optional

import typer
import zmq
import zmq.asyncio

from daemons.clock import Clock, loop_time
from daemons import metrics, prefix, runtime, security, wire
from daemons.cli import ConfigFile, LogLevel, Overrides, load_or_exit
from daemons.config import Config
from daemons.engine import make_engine
from daemons.engine.base import Engine, EngineError
from daemons.instance.telemetry import M_PREEMPTIONS
from daemons.kvranks import gloo_transport
from daemons.migration import Migrator
from daemons.proxylinks import ProxyLinks
from daemons.requests import RequestTable
from daemons.tracing import Tracer
from daemons.watchdog import Faults, Watchdog

log = logging.getLogger("llumnix.instance")

from daemons.instance.control import ControlMixin
from daemons.instance.intake import IntakeMixin
from daemons.instance.selection import OrdersMixin
from daemons.instance.steps import StepLoopMixin
from daemons.instance.tokens import TokenPathMixin


class Instance(TokenPathMixin, IntakeMixin, StepLoopMixin, ControlMixin, OrdersMixin):
    """One engine plus its llumlet: the state below, and a mixin per concern in the file named for it; the
    migrator (daemons/migration/) runs the migrations in and out."""

    def __init__(self, cfg: Config, engine: Engine, kv=None, ctx: zmq.asyncio.Context | None = None,
                 clock: Clock | None = None):
        """``kv``: the migrator's KV transport (default: Gloo pairs; see daemons/migration/migrator.py). ``ctx``:
        the ZeroMQ context its sockets are made in (default: its own; tests/support/cluster.py shares one
        between daemons in one process, for inproc:// addresses). ``clock``: what its step loop times steps with
        (default: the monotonic clock; tests/support passes the virtual loop's)."""
        self.clock = clock or Clock()
        self.cfg = cfg
        self.tracer = Tracer.create(cfg.tracing, "llumnix-instance", cfg.instance.id)  # None: tracing off
        self.kv = kv
        self.ic = cfg.instance
        self.engine = engine
        self.ctx = ctx if ctx is not None else zmq.asyncio.Context()
        self.sec = security.Security(cfg.security, "instance", self.ctx)
        self.router = self.sec.server(runtime.tune(self.ctx.socket(zmq.ROUTER)), "instance")
        self.manager = self.sec.client(runtime.tune(self.ctx.socket(zmq.DEALER)), "manager")
        # While the manager is away, reports are dropped rather than queued: a restarted manager must not get
        # a flood of stale ones (it asks us to register, and the next report is current).
        self.manager.setsockopt(zmq.IMMEDIATE, 1)
        self.manager.setsockopt(zmq.SNDHWM, 64)
        self.proxies = ProxyLinks(self.ctx, self.ic.orphan_timeout_s, secure=lambda sock: self.sec.client(sock, "proxy"),
                                  clock=self.clock.monotonic)
        self.requests = RequestTable(self.clock.monotonic)
        self.watchdog = Watchdog(self.ic.step_timeout_s, self.ic.hung_exit_s, self.clock)
        self.faults = Faults(self.ic.id)
        self.inbox: list[wire.Submit | wire.Abort] = []
        self.taken: dict[str, int] = {}  # by proxy token address: its Submits taken in at step boundaries
        self.list_queries: list[tuple[int, float]] = []  # ListRequests (id, arrival) answered at the next boundary
        # The engine's request rows as of the end of the last step or boundary (None: not kept, or stale), and
        # until when they are kept (see LISTING_WINDOW_S).
        self.rows: list[wire.RequestLoad] | None = None
        self.rows_until = 0.0
        self.rows_at = 0.0  # when they were read
        self.boundary_calls: list[tuple[Callable, asyncio.Future]] = []
        self.stepping = False  # engine steps run on the executor thread right now
        self.halt_steps = False  # the step loop was cancelled: the engine thread stops after its step
        self.emit_failure: BaseException | None = None  # raised by the step loop, as if it had emitted itself
        self.steps = 0
        self.migrator: Migrator | None = None
        # A real engine's step takes milliseconds of compute: run it on a worker thread so sockets stay
        # served. The engine is only ever touched between steps, from the event loop thread.
        self.executor = (ThreadPoolExecutor(1, thread_name_prefix="engine", initializer=self._init_engine_thread)
                         if getattr(engine, "blocking_step", False) else None)
        if self.executor is not None:
            # The step thread runs Python between its kernels and holds the GIL meanwhile; by default a
            # waiting thread gets it after up to 5 ms. The event loop serves sockets (tokens, migration
            # handshakes, whose latency is downtime): let it in sooner.
            sys.setswitchinterval(0.0005)
        self.last_load = engine.load()
        self.phases = metrics.RequestPhases()  # queue, prefill and decode times of the requests held here
        self.preemptions = metrics.PreemptionCounter(M_PREEMPTIONS, self.last_load.preemptions)
        self.wake = asyncio.Event()
        self.load_changed = asyncio.Event()
        self.accepting = True
        self.draining = ""  # the reason while the manager has us draining
        self.elsewhere = True  # (while draining) another instance takes requests
        self.cordoned = False
        self.stop_reason = "SIGTERM"
        self.started = self.clock.monotonic()
        self.stop = asyncio.Event()
        self.instance_id = self.ic.id
        self.request_address = ""
        self.metrics_address = ""
        self.report_seq = 0
        # The engine's prefix cache, published to the manager and the proxies (daemons/prefix.py); None when
        # the engine keeps none it can report (sim.prefix_caching off; vLLM's events are not read yet).
        self.cache_pub = prefix.Publisher(self.instance_id) if getattr(engine, "cache", None) is not None else None
        self._cache_syncs: dict[str, float] = {}  # asker -> when we last sent it our whole cache
        self._cache_counted = (0, 0)  # the cache's (queried, hit) tokens already in the metrics

    def _init_engine_thread(self) -> None:
        """(Engine thread, first) Lower this thread's priority by ``instance.engine_nice`` (Linux: niceness is
        per thread, and threads it starts inherit it), then the engine's own set-up."""
        if self.ic.engine_nice:
            tid = threading.get_native_id()
            try:
                os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + self.ic.engine_nice)
            except OSError as exc:
                log.warning("instance.engine_nice=%d not applied: %s", self.ic.engine_nice, exc)
        init = getattr(self.engine, "init_thread", None)
        if init is not None:
            init()

    async def run(self) -> None:
        self.sec.check_bind("instance.request_address", self.ic.request_address)
        self.sec.check_bind("migration.kv_host", self.cfg.migration.kv_host)
        self.request_address = runtime.bind(self.router, self.ic.request_address)
        if self.ic.advertise_address:
            self.request_address = self.ic.advertise_address
        if not self.instance_id:
            self.instance_id = f"{self.ic.host or socket.gethostname()}-{self.request_address.rsplit(':', 1)[-1]}"
        if self.cache_pub is not None:
            self.cache_pub.instance_id = self.instance_id
        metrics.bind("instance", self.cfg.model.name, self.instance_id)
        try:
            self.migrator = Migrator(self, self.cfg.migration, self.engine, self.requests, self.boundary, self.faults,
                                     self.kv or gloo_transport(self.cfg.migration, self.engine, self.boundary), self.clock)
        except (RuntimeError, ValueError, OSError) as exc:  # the KV store's port is taken, or the host does not resolve
            raise runtime.StartupError(f"cannot listen for KV transfer on {self.cfg.migration.kv_host}:"
                                       f"{self.cfg.migration.kv_port}: {exc}") from None
        self.metrics_address = runtime.start_metrics_server(self.ic.metrics_port, self.ic.metrics_host,
                                                            security.metrics_token(self.cfg))
        runtime.connect(self.manager, self.cfg.manager.address)
        self._tell_manager(self.register_msg())
        load = self.engine.load()
        # Before "serving on": whoever reads that line may stop us cleanly at once.
        runtime.install_stop_signals(asyncio.get_running_loop(), self.stop)
        log.info("instance %s serving on %s (backend %s, %d blocks of %d tokens, manager %s, KV transfer %s, "
                 "metrics %s)", self.instance_id, self.request_address, self.engine.backend, load.blocks_total,
                 load.block_size, self.cfg.manager.address, self.migrator.kv.address or "pairs meet over ZeroMQ", self.metrics_address or "off")
        runtime.sd_notify("READY=1")
        self.watchdog.start()
        tasks = [asyncio.create_task(c) for c in
                 (self.serve_requests(), self.step_loop(), self.serve_manager(), self.report_loop(), self.proxy_loop())]
        stopped = asyncio.create_task(self.stop.wait())
        done, _ = await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
        failure = next((t.exception() for t in done if t is not stopped and t.exception() is not None), None)
        if failure is not None:
            log.error("instance loop failed: %r", failure)
        await self.shutdown(tasks, self.stop_reason if failure is None else f"failed: {failure!r}",
                            grace=self.ic.shutdown_grace_s if failure is None else 0.0)
        if failure is not None:
            raise SystemExit(1)  # let systemd's Restart=on-failure see it

    async def shutdown(self, tasks: list[asyncio.Task], reason: str, grace: float) -> None:
        """Drain, then stop: leave the dispatch set and, for a grace period, let the manager migrate running
        requests out and give queued ones back for re-dispatch (its drain orders do both, once another
        instance can take them), or let them finish; then fail what is left."""
        runtime.sd_notify("STOPPING=1")
        self.accepting = False
        self._tell_manager(wire.Goodbye(self.instance_id, reason))
        log.info("stopping: %d requests in flight, draining for up to %.1fs", len(self.requests), grace)
        deadline = loop_time() + grace
        while (len(self.requests) or (self.migrator is not None and self.migrator.busy)) and loop_time() < deadline:
            await asyncio.sleep(0.05)
        self.watchdog.stop()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.migrator is not None:
            await self.migrator.close()
        if self.executor is not None:
            self.executor.shutdown(wait=True)  # a step in flight finishes before we touch the engine
        for rid, entry in list(self.requests.items()):
            self.engine.abort_request(rid)
            # Retryable: the proxy continues the request elsewhere from the tokens it already has.
            self.fail(rid, entry.reply_to, f"instance {self.instance_id} stopped", retryable=True)
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
    cfg = load_or_exit("llumnix-instance", config, set_, {
        "instance.id": id, "instance.backend": backend, "manager.address": manager,
        "instance.request_address": request_address, "instance.metrics_port": metrics_port,
        "instance.log_level": log_level,
    })
    runtime.setup_logging(cfg.instance.log_level, "llumnix-instance")
    try:  # before loading a model for minutes: are the keys and addresses acceptable?
        pre = security.Security(cfg.security, "instance")
        pre.check_bind("instance.request_address", cfg.instance.request_address)
        pre.check_bind("migration.kv_host", cfg.migration.kv_host)
    except runtime.StartupError as exc:
        log.error("cannot start: %s", exc)
        raise typer.Exit(1) from None
    try:
        engine = make_engine(cfg)
    except EngineError as exc:
        log.error("cannot start the %s engine: %s", cfg.instance.backend, exc)
        raise typer.Exit(1) from None
    runtime.exit_on_startup_error("llumnix-instance", lambda: Instance(cfg, engine).run())


def entry() -> None:
    app()
