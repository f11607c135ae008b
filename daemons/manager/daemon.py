"""The manager daemon: its socket loop, who may send what, the handler for each message type, and the CLI."""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Annotated, Optional

import typer
import zmq
import zmq.asyncio

from daemons import metrics, prefix, runtime, security, wire
from daemons.cli import ConfigFile, LogLevel, Overrides, load_or_exit
from daemons.clock import Clock
from daemons.config import Config
from daemons.links import LinkWatch
from daemons.manager.dispatch import DispatchMixin
from daemons.manager.liveness import LivenessMixin
from daemons.manager.queries import Fanout, QueriesMixin
from daemons.manager.records import M_BAD_FRAMES, M_LINKS_HEALED, M_REFUSED, InstanceRecord
from daemons.manager.registry import RegistryMixin
from daemons.manager.rescheduler import Rescheduler
from daemons.throttle import Throttle
from daemons.manager.view import ViewMixin

log = logging.getLogger("llumnix.manager")

# Who may send what to the manager when cluster sockets use CURVE keys (the role comes from the key).
_VERBS: dict[str, tuple[type, ...]] = {
    "instance": (wire.Register, wire.LoadReport, wire.Goodbye, wire.RequestList, wire.MigrateResult, wire.CacheEvents),
    "proxy": (wire.Dispatch, wire.Dispatched, wire.SnapshotQuery, wire.StatusQuery),
    "reader": (wire.StatusQuery, wire.SnapshotQuery, wire.RequestsQuery, wire.PolicyQuery),  # policy: read only
    "operator": (wire.StatusQuery, wire.SnapshotQuery, wire.RequestsQuery, wire.PolicyQuery, wire.MigrateQuery,
                 wire.DrainQuery, wire.RemoveQuery, wire.AddQuery),
}


class Manager(ViewMixin, RegistryMixin, LivenessMixin, DispatchMixin, QueriesMixin):
    """The global scheduler: the state below, and a mixin per concern (view, registry, liveness, dispatch,
    queries) in the file named for it; the rescheduler (migration orders, drains, scaling) is a part."""

    def __init__(self, cfg: Config, clock: Clock | None = None, sock=None, ctx: zmq.asyncio.Context | None = None):
        """``clock``: the time it reads (the simulator and tests/support pass a virtual one). ``sock``: what it
        sends and replies with, in place of its ROUTER socket (tests/support passes an in-memory one; the
        daemon's ``run`` binds the ROUTER, ``serve`` reads it). ``ctx``: the ZeroMQ context its sockets are
        made in (default: its own)."""
        metrics.bind("manager", cfg.model.name)
        self.cfg = cfg
        self.clock = clock or Clock()  # the simulator passes its virtual clock
        self.mc = cfg.manager
        self.sc = cfg.scheduling
        # The policies in force: from the config, changed at run time by `llumnixctl policy`.
        self.dispatch_policy = self.mc.dispatch_policy
        self.pairing_policy = self.sc.pairing_policy
        self.request_selection = self.sc.request_selection
        self.scaling_policy = cfg.scaling.policy
        self.instances: dict[str, InstanceRecord] = {}
        self.turn = 0
        self.dispatched_total = 0
        self.started = self.clock.monotonic()
        self.ctx = ctx if ctx is not None else zmq.asyncio.Context()
        self.sec = security.Security(cfg.security, "manager", self.ctx)
        if sock is None:
            sock = self.sec.server(runtime.tune(self.ctx.socket(zmq.ROUTER)), "manager")
            sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.sock = sock
        self.bound = ""
        self.query_ids = itertools.count(1)
        self._fanouts: dict[int, Fanout] = {}
        self._tasks: set[asyncio.Task] = set()
        self.resched = Rescheduler(self)
        self._refused_logged = Throttle(60.0)  # (sender, instance id or verb)
        self.sender = ""  # role:name of the message being handled (CURVE keys), for handlers that need it
        self._asked_to_register: dict[str, float] = {}  # instance id -> when we last asked it to register
        # Connections whose registration named the id of another live instance: their reports are not that
        # instance's (connection identity -> the id it asked for; the oldest forgotten past 10,000).
        self._duplicates: dict[bytes, str] = {}
        # Which instance caches which prompt blocks (daemons/prefix.py), from the instances' CacheEvents; a
        # restarted manager asks each instance for its whole cache at its first report.
        self.cache_index = prefix.Follower(self._ask_cache, self.clock.monotonic, self.mc.heartbeat_interval_s)
        self.proxies: dict[str, float] = {}  # proxy token address -> when it last asked for a snapshot
        self.links = LinkWatch(self.mc.link_timeout_s, self._link_changed, lambda _: M_LINKS_HEALED.inc())
        # What each message type does: answered at once (the reply, or None) ...
        self._handlers = {
            wire.LoadReport: self.on_report,
            wire.CacheEvents: self.on_cache_events,
            wire.Register: self.on_register,
            wire.Dispatched: lambda _, m: self.on_dispatched(m),
            wire.SnapshotQuery: lambda _, m: self.snapshot(m.query_id, m.proxy),
            wire.StatusQuery: lambda _, m: self.snapshot(m.query_id),
            wire.RequestList: lambda _, m: self.on_request_list(m),
            wire.MigrateResult: lambda _, m: self.resched.on_migrate_result(m),
            wire.Goodbye: lambda ident, m: None if ident in self._duplicates else self.on_goodbye(m),
            wire.PolicyQuery: lambda _, m: self.on_policy(m),
            wire.DrainQuery: lambda _, m: self.resched.on_drain(m),
        }
        # ... or later, by a task (dispatches are answered in batches by serve()).
        self._later = {
            wire.RequestsQuery: self.on_requests,
            wire.MigrateQuery: lambda m: self.resched.on_migrate(m),
            wire.RemoveQuery: lambda m: self.resched.on_remove(m),
            wire.AddQuery: lambda m: self.resched.on_add(m),
        }

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _impostor(self, msg) -> bool:
        """With keys: a message about a live instance from a key other than the one it registered with."""
        rec = self.instances.get(msg.instance_id)
        if rec is None or rec.state == "dead" or rec.principal == self.sender:
            return False
        M_REFUSED.inc()
        now = self.clock.monotonic()
        if self._refused_logged.due((self.sender, msg.instance_id), now):
            log.warning("refused %s about instance %s from key %s: it registered with key %s",
                        type(msg).__name__, msg.instance_id, self.sender or "(none)", rec.principal or "(none)")
        return True

    async def handle(self, ident: bytes, msg: wire.Message) -> None:
        reply: wire.Message | None = None
        if (self.sec.enabled and isinstance(msg, (wire.LoadReport, wire.Goodbye, wire.RequestList, wire.MigrateResult))
                and self._impostor(msg)):
            if isinstance(msg, wire.LoadReport):  # it would wait forever to be asked to register: tell it why not
                reply = wire.RegisterAck(msg.instance_id, accepted=False, final=True,
                                         reason=f"instance id {msg.instance_id} is taken by another key's live instance")
                await self.sock.send_multipart([ident, wire.encode(reply)])
            return
        handler = self._handlers.get(type(msg))
        if handler is not None:
            reply = handler(ident, msg)
        elif type(msg) in self._later:  # answered when the instances (or a launch) have answered
            self.spawn(self._reply_later(ident, self._later[type(msg)](msg)))
        else:
            log.warning("dropped unexpected %s from a peer", type(msg).__name__)
            M_BAD_FRAMES.inc()
        if reply is not None:
            await self.sock.send_multipart([ident, wire.encode(reply)])

    async def _reply_later(self, ident: bytes, coro) -> None:
        reply = await coro
        await self.sock.send_multipart([ident, wire.encode(reply)])

    def permitted(self, principal: str, msg: wire.Message) -> bool:
        """With CURVE keys, may the sender (``role:name`` from its key) send ``msg``? A refused query is
        answered with an error; anything refused is logged (once a minute per sender and verb)."""
        role = principal.split(":", 1)[0]
        ok = isinstance(msg, _VERBS.get(role, ()))
        if ok and role == "reader" and isinstance(msg, wire.PolicyQuery):
            ok = not any((msg.dispatch_policy, msg.pairing_policy, msg.request_selection, msg.scaling_policy))
        if not ok:
            M_REFUSED.inc()
            verb = type(msg).__name__
            now = self.clock.monotonic()
            if self._refused_logged.due((principal, verb), now):
                log.warning("refused %s from %s: role %r may not send it", verb, principal or "an unknown key", role)
        return ok

    async def serve(self, stop: asyncio.Event) -> None:
        secured = self.sec.enabled
        async for batch in runtime.receive(self.sock, multipart=True, copy=not secured):
            dispatches: list[tuple[bytes, wire.Dispatch]] = []
            for frames in batch:
                if len(frames) != 2:
                    M_BAD_FRAMES.inc()
                    log.warning("dropped a message of %d frames (expected 2)", len(frames))
                    continue
                principal = ""
                if secured:
                    principal = self.sec.principal(frames[1])
                    frames = [f.bytes for f in frames]
                msg = wire.decode(frames[1])
                if msg is None:
                    M_BAD_FRAMES.inc()
                elif secured and not self.permitted(principal, msg):
                    if hasattr(msg, "query_id"):
                        reply = wire.ErrorReply(msg.query_id, f"permission denied: key {principal.split(':')[-1]!r} "
                                                              f"may not send {type(msg).__name__} (needs an operator key)")
                        await self.sock.send_multipart([frames[0], wire.encode(reply)])
                elif isinstance(msg, wire.Dispatch):
                    dispatches.append((frames[0], msg))  # after the batch's reports: with the freshest loads
                else:
                    self.sender = principal
                    try:
                        await self.handle(frames[0], msg)
                    except Exception:  # one peer's message must not end the manager's loop
                        M_BAD_FRAMES.inc()
                        log.exception("a %s broke its handler; dropped it", type(msg).__name__)
            if dispatches:
                replies = self.on_dispatch_batch([m for _, m in dispatches])
                for (ident, _), reply in zip(dispatches, replies):
                    await self.sock.send_multipart([ident, wire.encode(reply)])
            await asyncio.sleep(0)  # under a backlog, let the pairing loop and the heartbeat watch run too

    async def run(self) -> None:
        self.sec.check_bind("manager.bind" if self.mc.bind else "manager.address", self.mc.bind or self.mc.address)
        self.bound = runtime.bind(self.sock, self.mc.bind or self.mc.address)
        metrics = runtime.start_metrics_server(self.mc.metrics_port, self.mc.metrics_host, security.metrics_token(self.cfg))
        stop = asyncio.Event()  # before "serving on": whoever reads that line may stop us cleanly at once
        runtime.install_stop_signals(asyncio.get_running_loop(), stop)
        log.info("serving on %s (dispatch %s, pairing %s, selection %s, scaling %s, heartbeat %.2fs, metrics %s)",
                 self.bound, self.dispatch_policy, self.pairing_policy if self.migrating else "drains only",
                 self.request_selection, self.scaling_policy, self.mc.heartbeat_interval_s, metrics or "off")
        runtime.sd_notify("READY=1")
        tasks = [asyncio.create_task(c) for c in (self.serve(stop), self.watch_heartbeats(stop),
                                                  self.resched.pairing_loop(), self.resched.scaling_loop())]
        failure = await runtime.first_failure(stop, tasks)
        runtime.sd_notify("STOPPING=1")
        if failure is not None:
            log.error("an essential task failed: %r; exiting so that the service manager restarts us", failure)
        log.info("stopping")
        for t in [*tasks, *self._tasks]:
            t.cancel()
        await asyncio.gather(*tasks, *self._tasks, return_exceptions=True)
        self.links.close()
        self.sec.close()
        self.ctx.destroy(linger=0)
        if failure is not None:
            raise SystemExit(1)


app = typer.Typer(add_completion=False, help="llumnix-manager: the Llumnix global scheduler.")


@app.command()
def main(
    config: ConfigFile = None,
    address: Annotated[Optional[str], typer.Option(help="ZeroMQ address of the manager, to serve on (manager.address)")] = None,
    bind: Annotated[Optional[str], typer.Option(help="address to bind when it differs from --address, e.g. tcp://*:7100 (manager.bind)")] = None,
    dispatch_policy: Annotated[Optional[str], typer.Option(help="llumnix, llumnix-cache, infaas++, rr or flood (manager.dispatch_policy; see Dispatch in llumnix-manager(8))")] = None,
    metrics_port: Annotated[Optional[int], typer.Option(help="port of the Prometheus endpoint on manager.metrics_host; 0 picks a free port, -1 turns it off (manager.metrics_port)")] = None,
    log_level: LogLevel("manager") = None,
    set_: Overrides(" (see llumnix.toml(5))") = None,
) -> None:
    """Run the global scheduler until SIGTERM."""
    cfg = load_or_exit("llumnix-manager", config, set_, {
        "manager.address": address, "manager.bind": bind, "manager.dispatch_policy": dispatch_policy,
        "manager.metrics_port": metrics_port, "manager.log_level": log_level,
    })
    runtime.setup_logging(cfg.manager.log_level, "llumnix-manager")
    runtime.exit_on_startup_error("llumnix-manager", lambda: Manager(cfg).run())


def entry() -> None:
    app()
