"""llumnix-instance: one engine plus its llumlet.

The llumlet owns the step loop: between steps it applies the requests and aborts that proxies sent, after
each step it pushes every token straight to the proxy that owns the request, and it reports load to the
manager on change (coalesced to a bounded rate) and at least once per heartbeat interval. It runs live
migrations in and out (daemons/migration/); their engine calls wait for a step boundary. When the manager
orders migrations out, the llumlet picks which requests go (policy.select_migrants). While draining (told by
the manager, or after SIGTERM) it gives queued requests that produced nothing back to their proxies for
re-dispatch, and its running requests migrate out as the manager orders.

The ``Instance`` (``daemon.py``, with its life cycle and the CLI) is a facade: it builds one object per
concern, gives each what it needs, and starts their loops. Each owns its state; the others use its verbs.

- ``Intake`` (``intake.py``): the request socket and the inbox of Submits and Aborts, applied to the engine
  at each boundary; requests that leave (aborted, given back, orphaned); Submits taken in per proxy.
- ``Mailbox`` (``mailbox.py``): calls that wait for a step boundary, whether a step is in flight, and the
  event that wakes the step loop.
- ``StepLoop`` (``steps.py``): schedule -> run -> postprocess; the engine thread. One step path for vLLM's
  blocking steps (back to back on the thread) and the sim's modelled ones (on the loop, as tests/support runs).
- ``TokenPath`` and ``ManagerLine`` (``tokens.py``): tokens, failures, moves and give-backs to the proxies;
  messages to the manager.
- ``Reporter`` and ``Heartbeats`` (``reports.py``): the last load and the reports to the manager, heartbeats
  to the proxies, which proxies are gone; ``CacheReports`` (``cache.py``): the prefix cache published.
- ``Attainment`` (``attainment.py``): the requests with an SLO judged where they finish, over a sliding window
  (``SloWindow``) the load reports carry; the step-time model they carry is ``StepFit`` (``predictor.py``).
- ``Listings`` (``listings.py``): the manager's request listings, answered at once from the request table (with the engine rows they keep).
- ``Orders`` (``selection.py``): migration orders, which requests go (with the pure ``migrants_for``, also
  run by the simulator).
- ``Shared`` (``shared.py``): what the parts share (the engine, the request table, the mailbox, the clock, ...),
  built once and handed to each part, which takes what it reads.
- ``Control`` (``control.py``): the manager protocol (its handler table, registration, drain, stop) and
  ``Standing``/``Identity`` (``standing.py``): where the instance stands and who it is.
- ``Handovers`` (``handover.py``): in role prefill, each request that decodes here offered to the manager for a
  handover to a decode instance.

Every request's owner, placement epoch and progress live in one table (daemons/requests.py); the links to
proxies (token path, backlog, proxy liveness) in daemons/proxylinks.py; liveness by progress in
daemons/watchdog.py. Metrics and tuning constants are in ``telemetry.py``. Every part reads time from the
instance's ``daemons.clock.Clock``.
"""

from daemons.instance.daemon import Instance, app, entry, main
from daemons.instance.selection import keep_for, migrants_for

__all__ = ["Instance", "app", "entry", "keep_for", "main", "migrants_for"]
