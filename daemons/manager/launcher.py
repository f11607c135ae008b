"""The scale-out hook: a shell command template that starts one instance (``scaling.launcher``).

``{n}`` becomes the lowest index no known instance uses (neither as ``i{n}`` nor as a ``...-{n}`` suffix,
the systemd units' HOST-N), ``{id}`` becomes ``i{n}`` and ``{manager}`` the manager's address. The command
should start the instance and return (``systemctl start llumnix-instance@{n}``, the local cluster's
``llumnixctl local-instance``); its output goes to the manager's log. A launch is done when a new instance
registers: the one with the launch's id, or else the oldest launch waiting (for launchers that name their
instances themselves). It fails when the command exits non-zero first, or nothing registers in time.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from daemons import metrics
from daemons.clock import Clock
from daemons.config import ScalingConfig

log = logging.getLogger("llumnix.launcher")

M_LAUNCHES = metrics.counter("manager", "llumnix_manager_launches_total",
                             "Instances launched by the scaling launcher, by outcome", ["outcome"])


class LaunchError(Exception):
    """A launch that did not give an instance; the message says why, in one line."""


@dataclass
class Launch:
    n: int
    instance_id: str
    started: float
    registered: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


# Runs one launch's command: (command, instance id) -> the command's exit status, once it exited.
Start = Callable[[str, str], Awaitable[int]]


class Launcher:
    def __init__(self, cfg: ScalingConfig, manager_address: str, known_ids: Callable[[], set[str]],
                 clock: Clock | None = None, start: Start | None = None):
        """``start``: how a command runs (default: a shell, its output relayed to the log); tests/support
        starts instances in process instead. ``clock``: the manager's."""
        self.cfg = cfg
        self.manager_address = manager_address
        self.known_ids = known_ids
        self.clock = clock or Clock()
        self.start = start or self.run_shell
        self.launches: dict[str, Launch] = {}  # by the id given to the command, in launch order

    def _free_index(self) -> int:
        taken = set()
        for iid in self.known_ids():
            m = re.fullmatch(r"i(\d+)", iid) or re.search(r"-(\d+)$", iid)
            if m:
                taken.add(int(m.group(1)))
        taken.update(x.n for x in self.launches.values())
        n = 0
        while n in taken:
            n += 1
        return n

    def command(self, n: int, instance_id: str) -> str:
        # Plain replacement, not str.format: a shell command has braces of its own (${VAR}).
        return (self.cfg.launcher.replace("{n}", str(n)).replace("{id}", instance_id)
                .replace("{manager}", self.manager_address))

    async def launch(self, timeout_s: float = 0.0) -> str:
        """Start one instance and wait until it registers (``timeout_s``, 0: scaling.launch_timeout_s);
        returns its id. Raises LaunchError."""
        if not self.cfg.launcher.strip():
            raise LaunchError("no launcher is configured: set scaling.launcher (e.g. "
                              "\"systemctl start llumnix-instance@{n}\")")
        n = self._free_index()
        launch = Launch(n, f"i{n}", self.clock.monotonic())
        self.launches[launch.instance_id] = launch
        cmd = self.command(n, launch.instance_id)
        log.info("launching instance %s: %s", launch.instance_id, cmd)
        try:
            exited = asyncio.ensure_future(self.start(cmd, launch.instance_id))
            timeout_s = timeout_s or self.cfg.launch_timeout_s
            deadline = launch.started + timeout_s
            pending = {launch.registered, exited}
            while not launch.registered.done():
                done, pending = await asyncio.wait(pending, timeout=max(0.0, deadline - self.clock.monotonic()),
                                                   return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    raise LaunchError(f"launch of {launch.instance_id} timed out: nothing registered within "
                                      f"{timeout_s:g}s")
                if exited in done and exited.result() != 0 and not launch.registered.done():
                    raise LaunchError(f"launcher for {launch.instance_id} exited with status {exited.result()} "
                                      "before an instance registered (its output is in the manager's log)")
            M_LAUNCHES.labels("registered").inc()
            registered = launch.registered.result()
            log.info("launched instance %s registered (%.1fs)", registered, self.clock.monotonic() - launch.started)
            return registered
        except OSError as exc:
            M_LAUNCHES.labels("failed").inc()
            raise LaunchError(f"cannot run the launcher: {exc}") from None
        except LaunchError:
            M_LAUNCHES.labels("failed").inc()
            raise
        finally:
            self.launches.pop(launch.instance_id, None)

    async def run_shell(self, cmd: str, instance_id: str) -> int:
        """The default ``start``: the command in a shell of its own session, its output in the log."""
        proc = await asyncio.create_subprocess_shell(
            cmd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        relay = asyncio.ensure_future(self._relay(instance_id, proc))  # (an instance it starts may keep the pipe)
        status = await proc.wait()
        if status != 0:
            await asyncio.wait({relay}, timeout=2.0)  # its last words in the log before the error
        return status

    async def _relay(self, instance_id: str, proc) -> None:
        async for line in proc.stdout:
            log.info("launcher %s: %s", instance_id, line.decode(errors="replace").rstrip())

    def registered(self, instance_id: str) -> bool:
        """A new instance registered: the launch that named it, or else the oldest one waiting, is done. Whether
        it was one of our launches."""
        launch = self.launches.get(instance_id)
        if launch is None or launch.registered.done():
            launch = next((x for x in self.launches.values() if not x.registered.done()), None)
        if launch is not None:
            launch.registered.set_result(instance_id)
        return launch is not None
