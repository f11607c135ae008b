"""The proxy's HTTP front: the routes (the fast path's raw ASGI app, the framework's routes in
daemons/proxy/app.py), the guard (API keys, body limits, request counts), the checks a request must pass, the
per-key limits, the access log, and ``Call``/``Reply``, what the request logic reads and returns.

May import: daemons/proxy/api/ (the schema it decodes and answers in) and daemons/proxy/cluster/ (its metrics);
not daemons/proxy/service.py or app.py, which build it.
"""
