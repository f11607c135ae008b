"""The proxy's cluster client: what it knows of the instances and the manager, dispatch (its own view or the
manager's answer), admission and the fair gate between API keys, stream ownership by epoch, failover and
fencing, the token path from the instances, and the proxy's metrics, goodput and spans. client.py's
``ClusterClient`` is the facade, and its docstring says what each part owns.

May import: the daemons' shared modules (daemons/policy/, wire, clock, links, tracing); nothing of
daemons/proxy/front/ or daemons/proxy/api/, nor the facade or the app.
"""
