"""The manager daemon: its socket loop, who may send what, the handler for each message type, and the CLI."""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Annotated, Optional

import typer
import zmq
import zmq.asyncio

from daemons import metrics, policy, runtime, security, wire
from daemons.cli import ConfigFile, LogLevel, Overrides, daemon_main
from daemons.clock import Clock
from daemons.config import Config
from daemons.manager.adapters import Adapters
from daemons.manager.dispatch import Dispatcher
from daemons.manager.handover_links import HandoverLinks
from daemons.manager.liveness import Liveness
from daemons.manager.queries import Queries, lookup_timeout
from daemons.manager.records import M_BAD_FRAMES, M_REFUSED, InstanceRecord, Policies
from daemons.manager.registry import Registry
from daemons.manager.rescheduler import Rescheduler
from daemons.manager.shared import Shared
from daemons.manager.view import ClusterView, ProxyRanks
from daemons.policy import slo
from daemons.throttle import Throttle

log = logging.getLogger("llumnix.manager")

# Who may send what to the manager when cluster sockets use CURVE keys (the role comes from the key).
_VERBS: dict[str, tuple[type, ...]] = {
    "instance": (wire.Register, wire.LoadReport, wire.Goodbye, wire.RequestList, wire.MigrateResult, wire.CacheEvents,
                 wire.HandoverReady, wire.LoraResult),
    # LoraQuery: the proxies' /v1/load_lora_adapter and /v1/unload_lora_adapter (their API keys guard them)
    "proxy": (wire.Dispatch, wire.Dispatched, wire.SnapshotQuery, wire.StatusQuery, wire.LoraQuery),
    "reader": (wire.StatusQuery, wire.SnapshotQuery, wire.RequestsQuery, wire.PolicyQuery,  # policy, lora: read only
               wire.LoraQuery, wire.SessionsQuery),
    "operator": (wire.StatusQuery, wire.SnapshotQuery, wire.RequestsQuery, wire.PolicyQuery, wire.MigrateQuery,
                 wire.DrainQuery, wire.RemoveQuery, wire.AddQuery, wire.RoleQuery, wire.LoraQuery, wire.SessionsQuery),
}


class Manager:
    """The global scheduler: its socket loop and the handler for each message type, over one object per
    concern, each in the file named for it: ``cluster`` (view.py, the instance records), ``policies``
    (records.py), ``registry``, ``liveness``, ``dispatcher`` (dispatch.py), ``queries`` and ``resched``
    (rescheduler.py: migration orders, lifecycle, scaling)."""

    def __init__(self, cfg: Config, clock: Clock | None = None, sock=None, ctx: zmq.asyncio.Context | None = None):
        """``clock``: the time it reads (the simulator and tests/support pass a virtual one). ``sock``: what it
        sends and replies with, in place of its ROUTER socket (tests/support passes an in-memory one; the
        daemon's ``run`` binds the ROUTER, ``serve`` reads it). ``ctx``: the ZeroMQ context its sockets are
        made in (default: its own)."""
        metrics.bind("manager", cfg.model.name)
        self.cfg = cfg
        self.clock = clock or Clock()  # the simulator passes its virtual clock
        self.mc = mc = cfg.manager
        self.started = self.clock.monotonic()
        self.ctx = ctx if ctx is not None else zmq.asyncio.Context()
        self.sec = security.Security(cfg.security, "manager", self.ctx)
        if sock is None:
            sock = self.sec.server(runtime.tune(self.ctx.socket(zmq.ROUTER)), "manager")
            sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.sock = sock
        self.bound = ""
        self._tasks: set[asyncio.Task] = set()
        self._refused_logged = Throttle(60.0)  # (sender, instance id or verb)
        query_ids = itertools.count(1)  # fan-outs and migration orders: answers are matched by it
        next_id = lambda: next(query_ids)  # noqa: E731
        self.policies = Policies(cfg)
        classes = slo.Classes(cfg.slo)
        self.cluster = ClusterView(cfg.scheduling, self.clock, lambda: classes.targets[slo.NORMAL].tpot_s
                                   if self.policies.dispatch.predicts else 0.0, cfg.slo.tpot_full)
        self.proxies = ProxyRanks(mc.heartbeat_interval_s)
        self.queries = Queries(self.cluster, mc, self.send, next_id)
        self.adapters = Adapters(cfg, self.cluster, self.send, next_id)
        self.resched = Rescheduler(Shared(cfg, self.cluster, self.policies, self.clock, self.send, self.spawn), next_id,
                                   self.queries.lookup, lookup_timeout(mc), self.started)
        self.liveness = Liveness(self.cluster, self.clock, mc, cfg.scheduling, self.ctx, self.sec,
                                 self.resched.orders.fail_migrations_from, self.send)
        self.registry = Registry(self.cluster, self.clock, mc, cfg.scheduling, self.send, self.liveness.watch,
                                 self.resched.joined)
        self.handover_links = HandoverLinks(self.cluster, self.clock, self.send, mc.heartbeat_interval_s / 2)
        self.dispatcher = Dispatcher(self.cluster, self.policies, self.registry.cache_index, self.clock, mc,
                                     policy.rules_of(cfg), classes, cfg.sessions.max_sessions)
        orders, lifecycle = self.resched.orders, self.resched.lifecycle
        # What each message type does, given (connection identity, message, sender's key role:name): answered
        # at once (the reply, or None) ...
        self._handlers = {
            wire.LoadReport: lambda i, m, _: self.registry.on_report(i, m),
            wire.CacheEvents: lambda i, m, _: self.registry.on_cache_events(i, m),
            wire.Register: self.registry.on_register,
            wire.Dispatched: lambda _, m, __: self.dispatcher.on_dispatched(m),
            wire.SnapshotQuery: lambda _, m, __: self.snapshot(m.query_id, m.proxy),
            wire.StatusQuery: lambda _, m, __: self.snapshot(m.query_id),
            wire.RequestList: lambda _, m, __: self.queries.on_request_list(m),
            wire.MigrateResult: lambda _, m, __: orders.on_migrate_result(m),
            wire.Goodbye: lambda i, m, _: self.registry.on_goodbye(i, m),
            wire.PolicyQuery: lambda _, m, __: self.policies.change(m),
            wire.DrainQuery: lambda _, m, __: lifecycle.on_drain(m),
            wire.HandoverReady: lambda _, m, __: self.resched.roles.on_handover(m),
            wire.RoleQuery: lambda _, m, __: self.resched.roles.on_role(m),
            wire.LoraResult: lambda _, m, __: self.adapters.on_result(m),
            wire.SessionsQuery: lambda _, m, __: self.sessions(m),
        }
        # ... or later, by a task (dispatches are answered in batches by serve()).
        self._later = {
            wire.RequestsQuery: self.queries.on_requests,
            wire.MigrateQuery: orders.on_migrate,
            wire.RemoveQuery: lifecycle.on_remove,
            wire.AddQuery: lifecycle.on_add,
            wire.LoraQuery: self.adapters.on_query,
        }

    # ------------------------------------------------------------------ what the simulator and tests drive

    @property
    def instances(self):
        """The instance records by id (read-only; the cluster view owns them)."""
        return self.cluster.instances

    @property
    def links(self):
        return self.liveness.links

    @property
    def cache_index(self):
        return self.registry.cache_index

    @property
    def dispatch_policy(self) -> str:
        return self.policies.dispatch_policy

    def parts(self) -> tuple:
        """The objects whose tasks the manager runs (tests/support stops them all, as a kill would)."""
        r = self.resched
        return (self, self.cluster, self.registry, self.liveness, self.dispatcher, self.queries, self.adapters, r, r.orders,
                r.lifecycle, r.scaling, r.launcher, self.handover_links)

    def on_register(self, ident: bytes, msg: wire.Register, principal: str = "") -> wire.Message | None:
        return self.registry.on_register(ident, msg, principal)

    def on_report(self, ident: bytes, msg: wire.LoadReport) -> wire.Message | None:
        return self.registry.on_report(ident, msg)

    def on_cache_events(self, ident: bytes, msg: wire.CacheEvents) -> None:
        self.registry.on_cache_events(ident, msg)

    def on_dispatch_batch(self, msgs: list[wire.Dispatch]) -> list[wire.DispatchReply]:
        return self.dispatcher.on_dispatch_batch(msgs)

    def on_dispatched(self, msg: wire.Dispatched) -> None:
        self.dispatcher.on_dispatched(msg)

    def states(self, now: float):
        return self.cluster.states(now)

    def view(self, now: float) -> list[wire.InstanceView]:
        return self.cluster.view(now)

    def forget(self, rec: InstanceRecord, why: str) -> None:
        self.cluster.forget(rec, why)

    # ------------------------------------------------------------------ the daemon

    def send(self, r: InstanceRecord, msg: wire.Message) -> None:
        """To an instance; never waits (a full queue means it is gone, and heartbeats will say so)."""
        if not runtime.send_now(self.sock, [r.identity, wire.encode(msg)]):
            log.warning("could not send a %s to instance %s", type(msg).__name__, r.instance_id)

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def sessions(self, msg: wire.SessionsQuery) -> wire.SessionsReply:
        """``llumnixctl sessions``: the sessions whose turns were placed, with where their KV is now."""
        table = self.dispatcher.sessions
        return wire.SessionsReply(msg.query_id, table.rows(self.cache_index.match_tiers, msg.limit), len(table))

    def snapshot(self, query_id: int, proxy: str = "") -> wire.Snapshot:
        now = self.clock.monotonic()
        rank, proxies = self.proxies.rank(proxy, now)
        p = self.policies
        return wire.Snapshot(query_id=query_id, instances=self.cluster.view(now), dispatch_policy=p.dispatch_policy,
                             uptime_s=round(now - self.started, 3), dispatched_total=self.dispatcher.dispatched_total,
                             pairing_policy=p.pairing_policy, request_selection=p.request_selection,
                             scaling_policy=p.scaling_policy, migrating=p.migrating, proxies=proxies, proxy_rank=rank,
                             adapters=self.adapters.served(), **self.resched.counters())

    def _impostor(self, msg, principal: str) -> bool:
        """With keys: a message about a live instance from a key other than the one it registered with."""
        rec = self.cluster.get(msg.instance_id)
        if rec is None or rec.state == "dead" or rec.principal == principal:
            return False
        M_REFUSED.inc()
        now = self.clock.monotonic()
        if self._refused_logged.due((principal, msg.instance_id), now):
            log.warning("refused %s about instance %s from key %s: it registered with key %s",
                        type(msg).__name__, msg.instance_id, principal or "(none)", rec.principal or "(none)")
        return True

    async def handle(self, ident: bytes, msg: wire.Message, principal: str = "") -> None:
        """One message from the connection ``ident``; ``principal``: its key's role:name (CURVE), "" without."""
        reply: wire.Message | None = None
        if (self.sec.enabled and isinstance(msg, (wire.LoadReport, wire.Goodbye, wire.RequestList, wire.MigrateResult,
                                                  wire.HandoverReady))
                and self._impostor(msg, principal)):
            if isinstance(msg, wire.LoadReport):  # it would wait forever to be asked to register: tell it why not
                reply = wire.RegisterAck(msg.instance_id, accepted=False, final=True,
                                         reason=f"instance id {msg.instance_id} is taken by another key's live instance")
                await self.sock.send_multipart([ident, wire.encode(reply)])
            return
        handler = self._handlers.get(type(msg))
        if handler is not None:
            reply = handler(ident, msg, principal)
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
        if ok and role == "reader" and isinstance(msg, wire.LoraQuery):
            ok = msg.op == "list"
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
                    try:
                        await self.handle(frames[0], msg, principal)
                    except Exception:  # one peer's message must not end the manager's loop
                        M_BAD_FRAMES.inc()
                        log.exception("a %s broke its handler; dropped it", type(msg).__name__)
            if dispatches:
                replies = self.dispatcher.on_dispatch_batch([m for _, m in dispatches])
                for (ident, _), reply in zip(dispatches, replies):
                    await self.sock.send_multipart([ident, wire.encode(reply)])
            await asyncio.sleep(0)  # under a backlog, let the pairing loop and the heartbeat watch run too

    async def run(self) -> None:
        self.sec.check_bind("manager.bind" if self.mc.bind else "manager.address", self.mc.bind or self.mc.address)
        self.bound = runtime.bind(self.sock, self.mc.bind or self.mc.address)
        metrics = runtime.start_metrics_server(self.mc.metrics_port, self.mc.metrics_host, security.metrics_token(self.cfg))
        stop = asyncio.Event()  # before "serving on": whoever reads that line may stop us cleanly at once
        runtime.install_stop_signals(asyncio.get_running_loop(), stop)
        p = self.policies
        log.info("serving on %s (dispatch %s, pairing %s, selection %s, scaling %s, heartbeat %.2fs, metrics %s)",
                 self.bound, p.dispatch_policy, p.pairing_policy if p.migrating else "drains only",
                 p.request_selection, p.scaling_policy, self.mc.heartbeat_interval_s, metrics or "off")
        runtime.sd_notify("READY=1")
        loops = [self.handover_links.run(stop)] if self.cfg.disagg.link_ahead else []
        tasks = [asyncio.create_task(c) for c in (self.serve(stop), self.liveness.watch_heartbeats(stop), *loops,
                                                  *self.resched.loops())]
        failure = await runtime.first_failure(stop, tasks)
        runtime.sd_notify("STOPPING=1")
        if failure is not None:
            log.error("an essential task failed: %r; exiting so that the service manager restarts us", failure)
        log.info("stopping")
        for t in [*tasks, *self._tasks]:
            t.cancel()
        await asyncio.gather(*tasks, *self._tasks, return_exceptions=True)
        self.liveness.links.close()
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
    dispatch_policy: Annotated[Optional[str], typer.Option(help=f"{policy.DISPATCH.listing()} (manager.dispatch_policy; see Dispatch in llumnix-manager(8))")] = None,
    metrics_port: Annotated[Optional[int], typer.Option(help="port of the Prometheus endpoint on manager.metrics_host; 0 picks a free port, -1 turns it off (manager.metrics_port)")] = None,
    log_level: LogLevel("manager") = None,
    set_: Overrides(" (see llumnix.toml(5))") = None,
) -> None:
    """Run the global scheduler until SIGTERM."""
    daemon_main("llumnix-manager", config, set_, {
        "manager.address": address, "manager.bind": bind, "manager.dispatch_policy": dispatch_policy,
        "manager.metrics_port": metrics_port, "manager.log_level": log_level,
    }, lambda cfg: Manager(cfg).run())


def entry() -> None:
    app()
