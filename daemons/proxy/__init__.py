"""llumnix-proxy: the OpenAI-compatible HTTP front end, in three layers.

One request's way, and the object that owns each step (each gets what it needs in its constructor, never
the object that holds it):

- ``front/``, the HTTP front: ``FastPath`` (front/fastpath.py: the completion routes as a raw ASGI app) in
  front of the FastAPI app (app.py, the daemon's entry: every route, and the completion routes with
  ``proxy.fast_path = false``). One ``Guard`` (front/guard.py) decides for both: API keys, body limits, request
  counts, and the access line of a request refused before its route runs. Either way the request becomes a
  ``Call`` and its answer a ``Reply`` (front/call.py). ``Checks`` (what a request must be), ``TenantLimits``
  (each API key's limits), ``AccessLog`` and ``Routes`` (models, tokenize, detokenize, health) live there too.
- ``api/``, the OpenAI surface: the request and response schema (api/protocol.py), structured output and tool
  calls, the tokenizer, and how token outputs become OpenAI text (api/render.py's ``Job``, api/output.py's
  ``collect`` and ``sse``).
- ``cluster/``, the cluster client: ``ClusterClient`` (cluster/client.py), a facade over ``KnownInstances``,
  ``DispatchView``, ``InstancePort``, ``ManagerLink``, ``Streams``, ``Dispatcher``, ``Failover``, ``FairGate``,
  ``Admission`` and ``Placing``; cluster/client.py's docstring says what each owns.
- ``Proxy`` (service.py), the facade that joins them: a request is checked (front), tokenized (api), admitted
  and dispatched (cluster), and its tokens rendered (api) and written (front).

Imports go one way: front may import api and cluster; api may import cluster's ``Stream`` (what it renders)
and nothing of front; cluster imports neither (tests/unit/test_structure.py checks it).

Time: every part reads the ``daemons.clock.Clock`` the daemon (or a test harness) passes in.
"""
