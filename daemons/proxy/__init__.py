"""llumnix-proxy: the OpenAI-compatible HTTP front end.

One request's way, and the object that owns each step (each gets what it needs in its constructor, never
the object that holds it):

- HTTP front: ``FastPath`` (fastpath.py: the completion routes as a raw ASGI app) in front of the FastAPI app
  (app.py: every route, and the completion routes with ``proxy.fast_path = false``). One ``Guard`` (guard.py)
  decides for both: API keys, body limits, request counts, and the access line of a request refused before
  its route runs. Either way the request becomes a ``Call`` and its answer a ``Reply`` (call.py).
- ``Proxy`` (service.py), a facade: ``Checks`` (checks.py: what a request must be), ``TenantLimits``
  (tenants.py: each API key's limits), ``AccessLog`` (access.py), ``Routes`` (routes.py: models, tokenize,
  detokenize, health); the answer goes out through output.py's ``collect`` or ``sse`` and render.py's ``Job``.
- ``ClusterClient`` (cluster.py), a facade over the cluster's side: ``KnownInstances`` (known.py),
  ``DispatchView`` (view.py), ``InstancePort`` (tokens.py), ``ManagerLink`` (managerlink.py), ``Streams``
  (streams.py: stream ownership by epoch), ``Dispatcher`` (dispatch.py), ``Failover`` (failover.py),
  ``FairGate`` (fairgate.py), ``Admission`` and ``Placing`` (admission.py). cluster.py's docstring says what
  each owns.

Time: every part reads the ``daemons.clock.Clock`` the daemon (or a test harness) passes in.
"""
