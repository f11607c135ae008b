"""llumnix-manager: the global scheduler.

Holds the cluster view (instances and their latest load reports), answers dispatch queries, marks
instances dead after missed heartbeats, and serves admin queries. It keeps no durable state: after a
restart, instances re-register on their next report (the manager answers an unknown reporter with a
RegisterAck that asks for it).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Annotated, Optional

import typer
import zmq
import zmq.asyncio
from prometheus_client import Counter, Gauge

from daemons import policy, runtime, wire
from daemons.cli import load_or_exit
from daemons.config import Config

log = logging.getLogger("llumnix.manager")

M_INSTANCES = Gauge("llumnix_manager_instances", "Instances in the cluster view, by state", ["state"])
M_DISPATCHES = Counter("llumnix_manager_dispatches_total", "Dispatch decisions, by instance", ["instance"])
M_NO_INSTANCE = Counter("llumnix_manager_dispatch_failures_total", "Dispatch queries with no eligible instance")
M_DEATHS = Counter("llumnix_manager_instance_deaths_total", "Instances marked dead after missed heartbeats")
M_FREENESS = Gauge("llumnix_instance_freeness", "Freeness (M - sum V) / B as the manager computes it", ["instance"])
M_BLOCKS_USED = Gauge("llumnix_instance_blocks_used", "KV blocks in use, as last reported", ["instance"])
M_RUNNING = Gauge("llumnix_instance_running", "Running requests, as last reported", ["instance"])
M_WAITING = Gauge("llumnix_instance_waiting", "Waiting requests, as last reported", ["instance"])
M_BAD_FRAMES = Counter("llumnix_manager_malformed_frames_total", "Frames dropped because they did not decode")


@dataclass
class InstanceRecord:
    info: wire.Register
    identity: bytes
    load: wire.InstanceLoad
    last_seen: float
    state: str = "alive"
    draining: bool = False
    # Dispatches not yet visible in the instance's reports: (dispatch number, blocks, time). They count as
    # usage so that a burst between two reports does not all land on the same "freest" instance.
    dispatched_n: int = 0
    pending: deque = field(default_factory=deque)

    @property
    def instance_id(self) -> str:
        return self.info.instance_id

    def candidate(self, excluded: bool = False) -> policy.Candidate:
        return policy.candidate(self.instance_id, self.load, sum(b for _, b, _ in self.pending), len(self.pending),
                                alive=self.state == "alive" and not excluded, draining=self.draining)

    def freeness(self) -> float:
        c = self.candidate()
        return policy.freeness(c.blocks_total, c.usage, c.batch_size)

    def retire_pending(self, now: float, ttl: float) -> None:
        received = self.load.requests_received
        while self.pending and (self.pending[0][0] <= received or now - self.pending[0][2] > ttl):
            self.pending.popleft()


class Manager:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.mc = cfg.manager
        self.instances: dict[str, InstanceRecord] = {}
        self.turn = 0
        self.dispatched_total = 0
        self.started = time.monotonic()
        self.ctx = zmq.asyncio.Context()
        self.sock = runtime.tune(self.ctx.socket(zmq.ROUTER))
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.bound = ""
        self._query_ids = itertools.count(1)
        self._fanouts: dict[int, tuple[asyncio.Future, set[str], list]] = {}
        self._migrations: dict[int, tuple[asyncio.Future, str]] = {}  # MigrateStart id -> (result, source id)
        self._tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ view

    def dead_after(self) -> float:
        return self.mc.heartbeat_interval_s * self.mc.dead_after_missed

    def view(self, now: float) -> list[wire.InstanceView]:
        return [
            wire.InstanceView(
                instance_id=r.instance_id, host=r.info.host, pid=r.info.pid, state=r.state,
                request_address=r.info.request_address, backend=r.info.backend, model=r.info.model,
                load=r.load, freeness=round(r.freeness(), 4), last_report_age_s=round(now - r.last_seen, 3),
                metrics_address=r.info.metrics_address, draining=r.draining,
                pending_dispatches=len(r.pending), max_model_len=r.info.max_model_len,
            )
            for r in sorted(self.instances.values(), key=lambda r: r.instance_id)
        ]

    def snapshot(self, query_id: int) -> wire.Snapshot:
        now = time.monotonic()
        return wire.Snapshot(query_id=query_id, instances=self.view(now), dispatch_policy=self.mc.dispatch_policy,
                             uptime_s=round(now - self.started, 3), dispatched_total=self.dispatched_total)

    def _update_gauges(self, r: InstanceRecord) -> None:
        iid = r.instance_id
        M_FREENESS.labels(iid).set(r.freeness())
        M_BLOCKS_USED.labels(iid).set(r.load.blocks_used)
        M_RUNNING.labels(iid).set(r.load.running)
        M_WAITING.labels(iid).set(r.load.waiting)
        self._update_gauges_states()

    def _update_gauges_states(self) -> None:
        for state in ("alive", "stopping", "dead"):
            M_INSTANCES.labels(state).set(sum(1 for x in self.instances.values() if x.state == state))

    # ------------------------------------------------------------------ handlers

    def on_register(self, ident: bytes, msg: wire.Register) -> wire.Message:
        if msg.wire_version != wire.WIRE_VERSION:
            log.warning("instance %s speaks wire version %d, we speak %d: refused", msg.instance_id, msg.wire_version, wire.WIRE_VERSION)
            return wire.RegisterAck(msg.instance_id, accepted=False, reason=f"wire version {msg.wire_version} != {wire.WIRE_VERSION}")
        now = time.monotonic()
        old = self.instances.get(msg.instance_id)
        rec = InstanceRecord(info=msg, identity=ident, load=msg.load, last_seen=now)
        rec.dispatched_n = msg.load.requests_received
        if old is not None:
            rec.draining = old.draining
            log.info("instance %s re-registered (pid %d, was %s)", msg.instance_id, msg.pid, old.state)
        else:
            log.info("instance %s registered: %s pid %d at %s, %d blocks", msg.instance_id, msg.host, msg.pid,
                     msg.request_address, msg.load.blocks_total)
        self.instances[msg.instance_id] = rec
        self._update_gauges(rec)
        return wire.RegisterAck(msg.instance_id)

    def on_report(self, ident: bytes, msg: wire.LoadReport) -> wire.Message | None:
        rec = self.instances.get(msg.instance_id)
        if rec is None:
            # We restarted, or it was removed: ask it to register again.
            return wire.RegisterAck(msg.instance_id, accepted=False, reason="unknown instance: register again")
        now = time.monotonic()
        rec.identity, rec.load, rec.last_seen = ident, msg.load, now
        if rec.state == "dead":
            log.info("instance %s is reporting again: alive", msg.instance_id)
            rec.state = "alive"
        rec.retire_pending(now, self.mc.pending_dispatch_ttl_s)
        self._update_gauges(rec)
        return None

    def on_goodbye(self, msg: wire.Goodbye) -> None:
        """The instance is stopping: no more dispatches, but it still finishes what it runs."""
        rec = self.instances.get(msg.instance_id)
        if rec is not None and rec.state != "stopping":
            rec.state = "stopping"
            rec.pending.clear()
            log.info("instance %s is stopping (%s); no more dispatches to it", msg.instance_id, msg.reason or "shutdown")
            self._update_gauges(rec)

    def _forget(self, rec: InstanceRecord, why: str) -> None:
        del self.instances[rec.instance_id]
        log.info("instance %s forgotten: %s", rec.instance_id, why)
        for gauge in (M_FREENESS, M_BLOCKS_USED, M_RUNNING, M_WAITING):
            try:
                gauge.remove(rec.instance_id)
            except KeyError:  # never reported
                pass
        self._update_gauges_states()

    def on_dispatch(self, msg: wire.Dispatch) -> wire.DispatchReply:
        now = time.monotonic()
        excluded = set(msg.exclude)
        cands = []
        for r in self.instances.values():
            r.retire_pending(now, self.mc.pending_dispatch_ttl_s)
            cands.append(r.candidate(excluded=r.instance_id in excluded))
        chosen = policy.dispatch(self.mc.dispatch_policy, cands, self.turn)
        self.turn += 1
        if chosen is None:
            M_NO_INSTANCE.inc()
            return wire.DispatchReply(msg.query_id, reason="no live instance can take requests")
        rec = self.instances[chosen]
        rec.dispatched_n += 1
        rec.pending.append((rec.dispatched_n, policy.blocks_for(msg.prompt_tokens + 1, rec.load.block_size), now))
        self.dispatched_total += 1
        M_DISPATCHES.labels(chosen).inc()
        log.debug("request %s -> %s (freeness %.2f)", msg.request_id, chosen, rec.freeness())
        return wire.DispatchReply(msg.query_id, instance_id=chosen, request_address=rec.info.request_address)

    async def on_requests(self, msg: wire.RequestsQuery) -> wire.RequestsReply:
        alive = {r.instance_id: r for r in self.instances.values() if r.state != "dead"}  # stopping ones still serve
        qid = next(self._query_ids)
        fut = asyncio.get_running_loop().create_future()
        results: list[wire.RequestList] = []
        self._fanouts[qid] = (fut, set(alive), results)
        for r in alive.values():
            await self.sock.send_multipart([r.identity, wire.encode(wire.ListRequests(qid))])
        try:
            if alive:
                await asyncio.wait_for(asyncio.shield(fut), self.mc.query_timeout_s)
        except asyncio.TimeoutError:
            pass
        finally:
            _, missing, _ = self._fanouts.pop(qid)
        reqs = [
            wire.RequestInfo(request_id=q.request_id, instance_id=rl.instance_id, state=q.state,
                             output_tokens=q.output_tokens, prompt_tokens=q.prompt_tokens, blocks=q.blocks,
                             priority=q.priority)
            for rl in results for q in rl.requests
        ]
        return wire.RequestsReply(msg.query_id, requests=reqs, unreachable=sorted(missing))

    def on_request_list(self, msg: wire.RequestList) -> None:
        entry = self._fanouts.get(msg.query_id)
        if entry is None:
            return  # late answer to a finished query
        fut, missing, results = entry
        if msg.instance_id in missing:
            missing.discard(msg.instance_id)
            results.append(msg)
        if not missing and not fut.done():
            fut.set_result(None)

    def migrate_timeout(self, count: int) -> float:
        """How long a source may take to report ``count`` migrations (each step has its own timeout there)."""
        mig = self.cfg.migration
        return 5.0 + max(count, 1) * mig.timeout_s * (mig.max_stages + 3)

    async def on_migrate(self, msg: wire.MigrateQuery) -> wire.Message:
        dst = self.instances.get(msg.dst)
        if dst is None or dst.state != "alive":
            return wire.ErrorReply(msg.query_id, f"destination {msg.dst!r} is not a live instance (see llumnixctl status)")
        if msg.request_id:
            held = await self.on_requests(wire.RequestsQuery(0))
            src_id = next((q.instance_id for q in held.requests if q.request_id == msg.request_id), None)
            if src_id is None:
                return wire.ErrorReply(msg.query_id, f"request {msg.request_id!r} is not on any instance "
                                                     "(finished, or never started; see llumnixctl requests)")
        else:
            src_id = msg.src
        src = self.instances.get(src_id)
        if src is None or src.state == "dead":
            return wire.ErrorReply(msg.query_id, f"source {src_id!r} is not a live instance (see llumnixctl status)")
        if src_id == msg.dst:
            return wire.ErrorReply(msg.query_id, f"the request is already on {msg.dst}")
        qid = next(self._query_ids)
        fut = asyncio.get_running_loop().create_future()
        self._migrations[qid] = (fut, src_id)
        start = wire.MigrateStart(qid, dst=msg.dst, dst_address=dst.info.request_address,
                                  request_ids=[msg.request_id] if msg.request_id else [],
                                  count=0 if msg.request_id else msg.count, blocking=msg.blocking)
        try:
            await self.sock.send_multipart([src.identity, wire.encode(start)])
            result = await asyncio.wait_for(fut, self.migrate_timeout(1 if msg.request_id else msg.count))
        except asyncio.TimeoutError:
            return wire.ErrorReply(msg.query_id, f"instance {src_id} did not report the migration's outcome in time")
        finally:
            self._migrations.pop(qid, None)
        if result is None:
            return wire.ErrorReply(msg.query_id, f"source instance {src_id} died during the migration")
        return wire.MigrateReply(msg.query_id, result.outcomes)

    def on_migrate_result(self, msg: wire.MigrateResult) -> None:
        fut, _ = self._migrations.get(msg.query_id, (None, ""))
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def _fail_migrations_from(self, instance_id: str) -> None:
        for fut, src in self._migrations.values():
            if src == instance_id and not fut.done():
                fut.set_result(None)

    # ------------------------------------------------------------------ loops

    async def handle(self, ident: bytes, frame: bytes) -> None:
        msg = wire.decode(frame)
        if msg is None:
            M_BAD_FRAMES.inc()
            return
        reply: wire.Message | None = None
        if isinstance(msg, wire.LoadReport):
            reply = self.on_report(ident, msg)
        elif isinstance(msg, wire.Dispatch):
            reply = self.on_dispatch(msg)
        elif isinstance(msg, wire.Register):
            reply = self.on_register(ident, msg)
        elif isinstance(msg, (wire.StatusQuery, wire.SnapshotQuery)):
            reply = self.snapshot(msg.query_id)
        elif isinstance(msg, wire.RequestsQuery):
            task = asyncio.create_task(self._reply_later(ident, self.on_requests(msg)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif isinstance(msg, wire.RequestList):
            self.on_request_list(msg)
        elif isinstance(msg, wire.MigrateQuery):
            task = asyncio.create_task(self._reply_later(ident, self.on_migrate(msg)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif isinstance(msg, wire.MigrateResult):
            self.on_migrate_result(msg)
        elif isinstance(msg, wire.Goodbye):
            self.on_goodbye(msg)
        else:
            log.warning("dropped unexpected %s from a peer", type(msg).__name__)
            M_BAD_FRAMES.inc()
        if reply is not None:
            await self.sock.send_multipart([ident, wire.encode(reply)])

    async def _reply_later(self, ident: bytes, coro) -> None:
        reply = await coro
        await self.sock.send_multipart([ident, wire.encode(reply)])

    async def serve(self, stop: asyncio.Event) -> None:
        async for batch in runtime.receive(self.sock, multipart=True):
            for frames in batch:
                if len(frames) != 2:
                    M_BAD_FRAMES.inc()
                    log.warning("dropped a message of %d frames (expected 2)", len(frames))
                    continue
                await self.handle(frames[0], frames[1])

    async def watch_heartbeats(self, stop: asyncio.Event) -> None:
        period = self.mc.heartbeat_interval_s / 2
        while not stop.is_set():
            before = time.monotonic()
            await asyncio.sleep(period)
            now = time.monotonic()
            if now - before > 2 * period:
                # We were stalled (no CPU, swapped out): reports may be waiting unread in the socket. Judge
                # nobody on a stale view; read them first.
                log.warning("manager stalled for %.2fs; re-checking heartbeats after reading reports", now - before)
                continue
            for r in list(self.instances.values()):
                if r.state == "stopping" and now - r.last_seen > self.dead_after():
                    self._forget(r, "it stopped")
                elif r.state == "dead" and now - r.last_seen > self.mc.dead_instance_ttl_s:
                    self._forget(r, f"dead for over {self.mc.dead_instance_ttl_s:g}s")
                elif r.state == "alive" and now - r.last_seen > self.dead_after():
                    r.state = "dead"
                    r.pending.clear()
                    self._fail_migrations_from(r.instance_id)
                    M_DEATHS.inc()
                    log.warning("instance %s marked dead: no report for %.2fs (%d heartbeats)", r.instance_id,
                                now - r.last_seen, self.mc.dead_after_missed)
                    self._update_gauges(r)

    async def run(self) -> None:
        self.bound = runtime.bind(self.sock, self.mc.bind or self.mc.address)
        metrics = runtime.start_metrics_server(self.mc.metrics_port)
        log.info("serving on %s (dispatch policy %s, heartbeat %.2fs, metrics %s)", self.bound,
                 self.mc.dispatch_policy, self.mc.heartbeat_interval_s, metrics or "off")
        stop = asyncio.Event()
        runtime.install_stop_signals(asyncio.get_running_loop(), stop)
        runtime.sd_notify("READY=1")
        tasks = [asyncio.create_task(self.serve(stop)), asyncio.create_task(self.watch_heartbeats(stop))]
        await stop.wait()
        runtime.sd_notify("STOPPING=1")
        log.info("stopping")
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.ctx.destroy(linger=0)


app = typer.Typer(add_completion=False, help="llumnix-manager: the Llumnix global scheduler.")


@app.command()
def main(
    config: Annotated[Optional[str], typer.Option("--config", "-c", help="llumnix.toml (default: $LLUMNIX_CONFIG)")] = None,
    address: Annotated[Optional[str], typer.Option(help="ZeroMQ address to serve on (manager.address)")] = None,
    bind: Annotated[Optional[str], typer.Option(help="address to bind if it differs from --address (manager.bind)")] = None,
    dispatch_policy: Annotated[Optional[str], typer.Option(help="llumnix, rr or flood (manager.dispatch_policy)")] = None,
    metrics_port: Annotated[Optional[int], typer.Option(help="Prometheus port; 0 any, -1 off (manager.metrics_port)")] = None,
    log_level: Annotated[Optional[str], typer.Option(help="debug, info, warning, error (manager.log_level)")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override any setting: section.key=value")] = None,
) -> None:
    """Run the global scheduler until SIGTERM."""
    cfg = load_or_exit("llumnix-manager", config, set_, {
        "manager.address": address, "manager.bind": bind, "manager.dispatch_policy": dispatch_policy,
        "manager.metrics_port": metrics_port, "manager.log_level": log_level,
    })
    runtime.setup_logging(cfg.manager.log_level, "llumnix-manager")
    runtime.exit_on_startup_error("llumnix-manager", Manager(cfg).run())


def entry() -> None:
    app()


if __name__ == "__main__":
    entry()
