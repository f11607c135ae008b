"""What the parts of the proxy's cluster client that place requests share (``Shared``): built once by the
``ClusterClient`` (client.py) and handed to its dispatcher (dispatch.py) and its failover (failover.py), which
take from it what they read."""

from __future__ import annotations

from dataclasses import dataclass

from daemons.clock import Clock
from daemons.config import Config
from daemons.proxy.cluster.known import KnownInstances
from daemons.proxy.cluster.streams import Port
from daemons.proxy.cluster.view import DispatchView


@dataclass(frozen=True)
class Shared:
    """The settings, the clock, the instances as the proxy knows them (``known``), its dispatch view (``view``)
    and the port to the instances (``port``)."""

    cfg: Config
    clock: Clock
    known: KnownInstances
    view: DispatchView
    port: Port
