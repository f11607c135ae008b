"""llumnix-manager: the global scheduler.

Holds the cluster view (instances and their latest load reports, draining and cordoned flags), answers
dispatch queries by virtual usage, marks an instance dead when its connection says its process is gone
(daemons/links.py: a late report alone only makes it late), and serves admin queries. The rescheduler pairs
instances for migration, drains, removes and scales them. The manager keeps no durable state: after a
restart, instances re-register on their next report (the manager answers an unknown reporter with a
RegisterAck that asks for it), repeating the flags they were given.

``Manager`` (daemon.py) is a facade: the socket loop, who may send what, and a handler per message type that
hands each message to the one object that decides it. Each object owns its state and is given, when it is
built, only what it needs (the clock, its config section, the cluster view, a ``send`` to an instance):

- ``ClusterView`` (view.py): the one owner of the instance records; their scheduling states, the status
  view, the per-instance gauges. The rescheduler's parts see it through the ``Cluster`` protocol: records
  and states to read, verbs for the flags, the orders count, forgetting. ``ProxyRanks``: the proxies heard;
- ``Policies`` (records.py): the policies in force, changed by ``llumnixctl policy``; ``InstanceRecord``:
  what is held of each instance; the metrics;
- ``Registry`` (registry.py): registrations, reports, goodbyes, duplicates of a live id, the prefix index;
- ``Liveness`` (liveness.py): connections watched and reports timed: late, dead, forgotten;
- ``Dispatcher`` (dispatch.py): dispatch decisions and the pending-dispatch ledger;
- ``Queries`` (queries.py): request listings fanned out to the instances, and lookups;
- ``Rescheduler`` (rescheduler.py), built with one ``Shared`` (shared.py: the settings, the ``Cluster`` view,
  the policies, the clock, an order port, ``spawn``), not the manager, which it hands to each of its parts; it
  holds ``Orders`` (orders.py: the pairing loop, operators' migrations, their results), ``Lifecycle``
  (lifecycle.py: drain and cordon, remove, add), ``Scaling`` (scaling.py: auto-scaling), the
  ``Launcher`` (launcher.py: starting instances for scale-out and ``llumnixctl add``) and ``Roles`` (roles.py:
  prefill/decode roles, the handovers prefill instances offer, the adaptive rule);
- ``HandoverLinks`` (handover_links.py): the links each prefill instance makes ahead to the instances it may hand
  over to.

Imports go one way: records <- view <- shared <- (registry, liveness, dispatch, queries, orders, lifecycle,
scaling) <- rescheduler <- daemon.
"""

from daemons.manager.daemon import Manager, app, entry, main
from daemons.manager.queries import LOOKUP_TIMEOUT_S
from daemons.manager.records import InstanceRecord

__all__ = ["LOOKUP_TIMEOUT_S", "InstanceRecord", "Manager", "app", "entry", "main"]
