"""What the parts of one instance share (``Shared``): built once by the ``Instance`` (daemon.py), or by the
simulator for each of its instances (llumnixctl/experiments/sim/llumlet.py), and handed to each part, which
takes from it what it reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from daemons import metrics, wire
from daemons.clock import Clock
from daemons.engine.base import Engine
from daemons.instance.mailbox import Mailbox
from daemons.instance.standing import Identity, Standing
from daemons.requests import RequestTable

if TYPE_CHECKING:
    from daemons.migration import Migrator


@dataclass(frozen=True)
class Shared:
    """The engine (read between steps only: ``mailbox``), the request table, who the instance is (``ident``)
    and where it stands (``standing``), the step-boundary mailbox, the requests' phase times, the line to the
    manager (``tell_manager``), the migrator (``migrator()``: None until the instance has started it) and the
    clock every part reads time from."""

    engine: Engine
    requests: RequestTable
    ident: Identity
    standing: Standing
    mailbox: Mailbox
    phases: metrics.RequestPhases
    tell_manager: Callable[[wire.Message], None]
    migrator: Callable[[], Migrator | None]
    clock: Clock
