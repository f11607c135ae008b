"""llumnix-instance: one engine plus its llumlet.

The llumlet owns the step loop: between steps it applies the requests and aborts that proxies sent, after
each step it pushes every token straight to the proxy that owns the request, and it reports load to the
manager on change (coalesced to a bounded rate) and at least once per heartbeat interval. It runs live
migrations in and out (daemons/migration/); their engine calls wait for a step boundary (``boundary``).
When the manager orders migrations out, the llumlet picks which requests go (policy.select_migrants).
While draining (told by the manager, or after SIGTERM) it gives queued requests that produced nothing back
to their proxies for re-dispatch, and its running requests migrate out as the manager orders.

Every request's owner, placement epoch and progress live in one table (daemons/requests.py); the links to
proxies (token path, backlog, proxy liveness) in daemons/proxylinks.py; liveness by progress in
daemons/watchdog.py. Each heartbeat the instance tells every proxy it serves that it is alive and healthy,
and aborts the requests of proxies that are gone.

One concern per file: ``daemon.py`` (the Instance, its life cycle, the CLI), ``tokens.py`` (the token path),
``intake.py`` (requests and aborts from proxies), ``steps.py`` (the step loop and its boundaries),
``control.py`` (manager protocol, reports, heartbeats, proxies' liveness), ``selection.py`` (migration orders:
which requests go), ``telemetry.py`` (metrics and tuning constants).
"""

from daemons.instance.daemon import Instance, app, entry, main
from daemons.instance.selection import keep_for, migrants_for

__all__ = ["Instance", "app", "entry", "keep_for", "main", "migrants_for"]
