"""The proxy's spans of a request (daemons/tracing.py has the exporter and the settings).

``RequestTrace``: one per API request, ``llumnix.request`` (a SERVER span, the child of the client's
``traceparent`` when it sent a valid one), from arrival to the answer's end; its ``traceparent`` goes to
the instance in ``wire.Submit``, so the instances' migration spans are its children too.

``StreamTrace``: one per placed choice, its spans under the request's, each recorded when its end is
known:

- ``llumnix.queue``     waiting in the fair queue between API keys (daemons/proxy/cluster/fairgate.py)
- ``llumnix.dispatch``  choosing an instance and sending it the request (once per placement: epoch, instance)
- ``llumnix.prefill``   from the request's placement to its first token
- ``llumnix.decode``    from the first token to the end; a migration that moved it is an event on it
- ``llumnix.failover``  from the owner's failure (death, stall, error) to its placement elsewhere, when
                        tokens had streamed; ``llumnix.redispatch`` the same before the first token (a
                        retry, or a draining instance that gave it back)
"""

from __future__ import annotations

from daemons.tracing import Tracer, now_ns


class RequestTrace:
    __slots__ = ("tracer", "span", "traceparent", "ended")

    def __init__(self, tracer: Tracer, client_traceparent: str, request_id: str, chat: bool, key_name: str):
        self.tracer = tracer
        self.span = tracer.start("llumnix.request", tracer.context(client_traceparent), None, {
            "llumnix.request_id": request_id, "http.route": "/v1/chat/completions" if chat else "/v1/completions",
            "llumnix.api_key": key_name}, server=True)
        self.traceparent = tracer.traceparent(self.span)
        self.ended = False

    def end(self, status: int, attributes: dict) -> None:
        if self.ended:
            return
        self.ended = True
        self.span.set_attribute("http.response.status_code", status)
        for k, v in attributes.items():
            if v is not None:
                self.span.set_attribute(k, v)
        self.tracer.end(self.span, error=f"HTTP {status}" if status >= 400 else "")


class StreamTrace:
    __slots__ = ("tracer", "parent", "placed_at", "instance", "epoch", "first_at", "failing", "moves", "ended")

    def __init__(self, tracer: Tracer, traceparent: str):
        self.tracer = tracer
        self.parent = tracer.context(traceparent)
        self.placed_at = 0  # ns: the current placement's dispatch ended (its prefill began)
        self.instance, self.epoch = "", 0
        self.first_at = 0  # ns: its first token
        self.failing: tuple | None = None  # (ns, cause, message, instance, tokens): a failover under way
        self.moves: list[tuple[int, dict]] = []  # (ns, attributes) of each migration the proxy heard of
        self.ended = False

    def queued(self, since_ns: int, tenant: str, admitted: bool) -> None:
        self.tracer.record("llumnix.queue", self.parent, since_ns, now_ns(), {"llumnix.api_key": tenant},
                           error="" if admitted else "ended while queued")

    def dispatched(self, since_ns: int, instance_id: str, epoch: int, tokens: int) -> None:
        now = now_ns()
        if self.failing is not None:
            self._failover(now, "")
        self.tracer.record("llumnix.dispatch", self.parent, since_ns, now,
                           {"llumnix.instance": instance_id, "llumnix.epoch": epoch, "llumnix.from_token": tokens})
        self.placed_at, self.instance, self.epoch = now, instance_id, epoch

    def failed(self, cause: str, message: str, instance_id: str, tokens: int) -> None:
        """The owner failed the stream and it is placed again (a span once it is, or once it ends)."""
        now = now_ns()
        if self.first_at == 0 and self.placed_at:  # its prefill ended here
            self.tracer.record("llumnix.prefill", self.parent, self.placed_at, now,
                               {"llumnix.instance": self.instance, "llumnix.epoch": self.epoch}, error=message[:200])
            self.placed_at = 0
        if self.failing is None:
            self.failing = (now, cause, message, instance_id, tokens)

    def _failover(self, end_ns: int, error: str) -> None:
        at, cause, message, instance_id, tokens = self.failing
        self.failing = None
        self.tracer.record("llumnix.failover" if tokens else "llumnix.redispatch", self.parent, at, end_ns, {
            "llumnix.failover.cause": cause, "llumnix.failover.reason": message[:300],
            "llumnix.failover.from_instance": instance_id, "llumnix.failover.at_token": tokens}, error=error)

    def first_token(self) -> None:
        now = self.first_at = now_ns()
        if self.placed_at:
            self.tracer.record("llumnix.prefill", self.parent, self.placed_at, now,
                               {"llumnix.instance": self.instance, "llumnix.epoch": self.epoch})

    def moved(self, src: str, dst: str, epoch: int, from_token: int) -> None:
        self.moves.append((now_ns(), {"llumnix.migration.src": src, "llumnix.migration.dst": dst,
                                      "llumnix.epoch": epoch, "llumnix.from_token": from_token}))
        self.instance, self.epoch = dst, epoch

    def finished(self, tokens: int, error: str | None) -> None:
        if self.ended:
            return
        self.ended = True
        now = now_ns()
        error = (error or "")[:300]
        if self.failing is not None:
            self._failover(now, error or "ended before it was placed again")
        if self.first_at:
            span = self.tracer.start("llumnix.decode", self.parent, self.first_at,
                                     {"llumnix.instance": self.instance, "llumnix.epoch": self.epoch,
                                      "llumnix.tokens": tokens})
            for at, attrs in self.moves:
                span.add_event("migrated", attrs, timestamp=at)
            self.tracer.end(span, now, error)
        elif self.placed_at:
            self.tracer.record("llumnix.prefill", self.parent, self.placed_at, now,
                               {"llumnix.instance": self.instance, "llumnix.epoch": self.epoch},
                               error=error or "ended before its first token")
