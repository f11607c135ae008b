"""The instance's side of the manager protocol: the socket loop and its handler table, registration, the
drain flags (and the give-back of queued requests they start), and the manager's order to stop."""

from __future__ import annotations

import logging
import os
import socket
from typing import Callable

from daemons import runtime, wire
from daemons.config import Config
from daemons.instance.reports import Reporter
from daemons.instance.shared import Shared
from daemons.instance.telemetry import M_BAD_FRAMES
from daemons.instance.tokens import ManagerLine

log = logging.getLogger("llumnix.instance")

Handler = Callable[[wire.Message], None]


class Control:
    """Owns where the instance stands (``standing``: the one place that changes it) and when it started.
    ``give_back_queued()``: queued requests go back to their proxies (posted for the next boundary);
    ``stop(reason)``: the instance stops."""

    def __init__(self, shared: Shared, cfg: Config, line: ManagerLine, reporter: Reporter,
                 give_back_queued: Callable[[], object], stop: Callable[[str], None]):
        self.standing, self.ident, self.engine, self.clock = shared.standing, shared.ident, shared.engine, shared.clock
        self.line = line
        self.reporter = reporter
        self.cfg = cfg
        self.give_back_queued = give_back_queued
        self.stop = stop
        self.started = self.clock.monotonic()
        self.kv_spec: str | None = None  # its KV layout, with its tensor-parallel size (wire.Register)

    def register_msg(self) -> wire.Register:
        ic = self.cfg.instance
        if self.kv_spec is None:  # asked once, at the first registration, before the first step
            self.kv_spec = self.engine.kv_blocks().spec
        return wire.Register(
            instance_id=self.ident.instance_id, host=ic.host or socket.gethostname(), pid=os.getpid(),
            request_address=self.ident.request_address, backend=self.engine.backend, model=self.cfg.model.name,
            load=self.reporter.last, metrics_address=self.ident.metrics_address,
            max_model_len=self.engine.max_model_len, drain_reason=self.standing.register_reason(),
            cordoned=self.standing.cordoned, uptime_s=round(self.clock.monotonic() - self.started, 3),
            scale_in_protected=ic.scale_in_protected, kv_spec=self.kv_spec,
        )

    def register(self) -> None:
        self.line.tell(self.register_msg())

    async def serve(self, handlers: dict[type, Handler]) -> None:
        """Each message from the manager to its handler (``handlers``: by message type, with this object's own
        for RegisterAck, SetDraining and Shutdown)."""
        table: dict[type, Handler] = {wire.RegisterAck: self.on_register_ack, wire.SetDraining: self.set_draining,
                                      wire.Shutdown: self.on_shutdown, wire.SetRole: self.set_role, **handlers}
        while True:
            msg = await self.line.recv()
            handler = table.get(type(msg))
            if handler is None:
                M_BAD_FRAMES.inc()
            else:
                handler(msg)

    def on_register_ack(self, msg: wire.RegisterAck) -> None:
        if not msg.accepted and msg.final:
            raise runtime.StartupError(f"the manager refused our registration: {msg.reason}")
        if not msg.accepted:
            log.info("manager asks us to register (%s)", msg.reason)
            self.register()

    def on_shutdown(self, msg: wire.Shutdown) -> None:
        log.info("the manager asks us to stop (%s)", msg.reason or "no reason given")
        self.stop(f"stopped by the manager ({msg.reason})" if msg.reason else "stopped by the manager")

    def set_draining(self, msg: wire.SetDraining) -> None:
        was = self.standing.drain(msg)
        draining = self.standing.draining
        self.reporter.changed()  # proxies dispatching from their own views hear of it with the next report
        if draining and not was:
            log.info("draining (%s): running requests migrate out; queued ones go back to their proxies%s",
                     draining, "" if msg.elsewhere else " once another instance takes requests")
            if msg.elsewhere:  # else the manager's drain orders give them back when there is a destination
                self.give_back_queued()
        elif was and not draining:
            log.info("no longer draining")

    def set_role(self, msg: wire.SetRole) -> None:
        if msg.role not in ("mixed", "prefill", "decode"):
            log.warning("ignored SetRole to unknown role %r", msg.role)
            return
        was = self.standing.set_role(msg)
        if was != msg.role:
            log.info("role %s -> %s (%s)%s", was, msg.role, msg.reason or "manager",
                     ": requests decoding here move to decode instances" if msg.role == "prefill" else "")
        self.reporter.changed()

    def stop_accepting(self, reason: str) -> None:
        """Shutting down: leave the dispatch set, and tell the manager why."""
        self.standing.stop_accepting()
        self.line.tell(wire.Goodbye(self.ident.instance_id, reason))
