"""llumnix-manager: the global scheduler.

Holds the cluster view (instances and their latest load reports, draining and cordoned flags), answers
dispatch queries by virtual usage, marks an instance dead when its connection says its process is gone
(daemons/links.py: a late report alone only makes it late), and serves admin queries. The rescheduler pairs
instances for migration, drains, removes and scales them. The manager keeps no durable state: after a
restart, instances re-register on their next report (the manager answers an unknown reporter with a
RegisterAck that asks for it), repeating the flags they were given.

One concern per file:

- ``daemon.py``: the ``Manager`` (its state, socket loop, handler per message type, who may send what) and
  the CLI;
- ``records.py``: what it holds of each instance, and its metrics;
- ``view.py``: the instances' scheduling states, the view for status and proxies, gauges;
- ``registry.py``: registration, reports, goodbyes, forgetting;
- ``liveness.py``: connections watched and reports timed: late, dead;
- ``dispatch.py``: dispatch decisions and the pending-dispatch ledger;
- ``queries.py``: request listings fanned out to the instances, policy changes;
- ``rescheduler.py``: migration orders (its own and operators');
- ``lifecycle.py``: drain and cordon, remove, add (the rescheduler's);
- ``scaling.py``: auto-scaling (the rescheduler's);
- ``launcher.py``: starting instances for scale-out and ``llumnixctl add``.
"""

from daemons.manager.daemon import Manager, app, entry, main
from daemons.manager.queries import LOOKUP_TIMEOUT_S
from daemons.manager.records import InstanceRecord

__all__ = ["LOOKUP_TIMEOUT_S", "InstanceRecord", "Manager", "app", "entry", "main"]
