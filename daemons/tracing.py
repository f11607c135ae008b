"""Request tracing: W3C ``traceparent`` in, spans out over OTLP/HTTP (the ``[tracing]`` settings).

Off by default: with no ``tracing.otlp_endpoint`` a daemon's ``Tracer`` is ``None``, nothing of OpenTelemetry
is imported, and the request path pays one ``is None`` test per event. On, the proxy opens a span per
request (``llumnix.request``, the child of the client's ``traceparent`` when it sent one) and records its
queueing, dispatches, prefill, decode and failovers under it (daemons/proxy/cluster/traces.py); the request's
``traceparent`` travels to the instance in ``wire.Submit`` and on with a migration
(``wire.MigratingRequest``), so that each migration's span and its stages (daemons/migration/move.py)
join the same trace.

Spans are recorded once the times are known (start and end in nanoseconds of the wall clock), so nothing
stays open across an await; a batch processor exports them every ``tracing.export_interval_s`` from its own
thread, and a full queue drops spans rather than memory or the event loop.
"""

from __future__ import annotations

import logging
import re
import time

log = logging.getLogger("llumnix.tracing")

# version-traceid-parentid-flags (https://www.w3.org/TR/trace-context/#traceparent-header)
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


def valid_traceparent(value: str) -> bool:
    """A well-formed ``traceparent`` whose ids are not all zeros (an invalid one starts a new trace)."""
    return (len(value) == 55 and _TRACEPARENT.match(value) is not None and value[:2] != "ff"
            and value[3:35] != "0" * 32 and value[36:52] != "0" * 16)


def now_ns() -> int:
    return time.time_ns()


class Tracer:
    """One daemon's span exporter. ``Tracer.create`` returns None when tracing is off."""

    @classmethod
    def create(cls, cfg, service: str, instance: str = "") -> "Tracer | None":
        """``cfg``: the ``[tracing]`` section; ``service``: llumnix-proxy, llumnix-instance, ...;
        ``instance``: this daemon's name (service.instance.id)."""
        if not cfg.otlp_endpoint:
            return None
        return cls(cfg, service, instance)

    def __init__(self, cfg, service: str, instance: str):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._kind_server, self._kind_internal = SpanKind.SERVER, SpanKind.INTERNAL
        self._error = lambda msg: Status(StatusCode.ERROR, msg)
        self._propagator = TraceContextTextMapPropagator()
        attrs = {"service.name": service}
        if instance:
            attrs["service.instance.id"] = instance
        # A client's sampled flag is followed; a trace that starts here is sampled at sample_ratio.
        self._provider = TracerProvider(resource=Resource.create(attrs),
                                        sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)))
        headers = {}
        if cfg.headers_file:
            headers = _read_headers(cfg.headers_file)
        exporter = OTLPSpanExporter(endpoint=cfg.otlp_endpoint, headers=headers or None,
                                    timeout=cfg.export_timeout_s)
        self._provider.add_span_processor(BatchSpanProcessor(
            exporter, max_queue_size=cfg.max_queued_spans, schedule_delay_millis=int(cfg.export_interval_s * 1000),
            export_timeout_millis=int(cfg.export_timeout_s * 1000)))
        self._tracer = self._provider.get_tracer("llumnix")
        log.info("tracing: spans of %s go to %s (sampled at %g)", service, cfg.otlp_endpoint, cfg.sample_ratio)

    def context(self, traceparent: str):
        """The OpenTelemetry context of a ``traceparent`` (None for none or a malformed one)."""
        if not traceparent or not valid_traceparent(traceparent):
            return None
        return self._propagator.extract({"traceparent": traceparent})

    def start(self, name: str, parent=None, start_ns: int | None = None, attributes: dict | None = None,
              server: bool = False):
        """A span left open (``end`` it); ``parent``: a context (``context``/``child_context``) or None."""
        return self._tracer.start_span(name, context=parent, kind=self._kind_server if server else self._kind_internal,
                                       attributes=attributes, start_time=start_ns)

    def record(self, name: str, parent, start_ns: int, end_ns: int, attributes: dict | None = None,
               error: str = "") -> None:
        """A span whose times are known: started and ended at once."""
        span = self._tracer.start_span(name, context=parent, attributes=attributes, start_time=start_ns)
        if error:
            span.set_status(self._error(error))
        span.end(end_time=max(end_ns, start_ns))

    def end(self, span, end_ns: int | None = None, error: str = "") -> None:
        if error:
            span.set_status(self._error(error))
        span.end(end_time=end_ns)

    def child_context(self, span):
        """The context whose spans are children of ``span``."""
        from opentelemetry import trace

        return trace.set_span_in_context(span)

    def traceparent(self, span) -> str:
        """``span`` as a ``traceparent`` to send along (empty when it is not sampled: nothing downstream
        records it)."""
        if not span.get_span_context().trace_flags.sampled:
            return ""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self.child_context(span))
        return carrier.get("traceparent", "")

    def shutdown(self) -> None:
        """Export what is queued (bounded by the export timeout) and stop the exporter's thread."""
        try:
            self._provider.shutdown()
        except Exception:  # noqa: BLE001 - a collector that is gone must not hold the daemon's exit
            log.warning("tracing: the last spans could not be exported", exc_info=True)


def _read_headers(path: str) -> dict[str, str]:
    """``name: value`` lines (an OTLP collector's authorization, say), kept out of the config file."""
    from daemons.runtime import StartupError

    try:
        text = open(path, encoding="utf-8").read()
    except OSError as exc:
        raise StartupError(f"tracing.headers_file: cannot read {path}: {exc.strerror}") from None
    headers = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, sep, value = line.partition(":")
        if not sep or not name.strip():
            raise StartupError(f"tracing.headers_file: {path} line {n}: expected 'name: value'")
        headers[name.strip().lower()] = value.strip()
    return headers
