"""What the parts of the manager's rescheduling share (``Shared``): built once by the ``Rescheduler``'s maker
(the ``Manager``, daemon.py) and handed to each part (orders.py, lifecycle.py, scaling.py, roles.py), which
takes from it what it reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable

from daemons import wire
from daemons.clock import Clock
from daemons.config import Config
from daemons.manager.records import InstanceRecord, Policies
from daemons.manager.view import Cluster

Send = Callable[[InstanceRecord, wire.Message], None]


@dataclass(frozen=True)
class Shared:
    """The settings, the cluster (the ``Cluster`` protocol of view.py), the policies in force, the clock, the
    order port (``send``: a message to an instance) and ``spawn`` (run a coroutine as a task of the manager's)."""

    cfg: Config
    cluster: Cluster
    policies: Policies
    clock: Clock
    send: Send
    spawn: Callable[[Awaitable], object]
