"""Request tracing end to end: a sim cluster exports its spans over OTLP/HTTP to a collector this test runs
itself (a plain HTTP server on 127.0.0.1 that decodes each export with opentelemetry-proto), and the span
trees of a migrated request and of a failed-over one are checked: every span in the client's trace, under
its ``traceparent``, the proxy's queue/dispatch/prefill/decode/failover spans under the request's, and the
source instance's migration span and its stages under the request's too."""

from __future__ import annotations

import os
import secrets
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)

from tests.e2e.test_e2e_migration import move
from tests.streams import Stream, proxy_metric, wait_for

pytestmark = pytest.mark.e2e

PROMPT = list(range(100, 180))
PACED = ["instance.min_step_s=0.02", "manager.dispatch_policy=flood"]  # flood: every request on i0


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Collector:
    """An OTLP/HTTP trace receiver: every span exported to it, decoded, by trace id."""

    def __init__(self):
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        self.bad: list[str] = []
        self.auth: set[str] = set()  # the authorization headers the exports came with
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                collector.auth.add(self.headers.get("authorization", ""))
                try:
                    assert self.path == "/v1/traces", self.path
                    assert self.headers.get("content-type") == "application/x-protobuf", self.headers
                    req = ExportTraceServiceRequest.FromString(body)
                    collector.add(req)
                except Exception as exc:  # noqa: BLE001 - reported by the test, not by the server thread
                    collector.bad.append(repr(exc))
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add(self, req) -> None:
        for rs in req.resource_spans:
            res = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    with self.lock:
                        self.spans.append({
                            "trace": s.trace_id.hex(), "id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                            "name": s.name, "service": res.get("service.name"),
                            "instance": res.get("service.instance.id"), "start": s.start_time_unix_nano,
                            "end": s.end_time_unix_nano, "error": s.status.code == 2, "kind": s.kind,
                            "attrs": {a.key: _value(a.value) for a in s.attributes},
                            "events": [(e.name, {a.key: _value(a.value) for a in e.attributes}) for e in s.events]})

    def trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["trace"] == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def collector():
    c = Collector()
    yield c
    c.close()


def traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def tree(collector: Collector, trace_id: str, want) -> dict:
    """Wait until the trace holds what ``want(spans)`` needs; the spans by name (lists)."""
    by_name: dict[str, list[dict]] = {}

    def ready():
        by_name.clear()
        for s in collector.trace(trace_id):
            by_name.setdefault(s["name"], []).append(s)
        return want(by_name)

    wait_for(ready, 30, f"trace {trace_id} incomplete: {sorted((k, len(v)) for k, v in by_name.items())}", every=0.1)
    assert not collector.bad, collector.bad
    return by_name


def within(inner: dict, outer: dict) -> bool:
    return outer["start"] <= inner["start"] <= inner["end"] <= outer["end"]


def test_spans_of_a_migrated_and_a_failed_over_request(start_cluster, collector):
    c = start_cluster(instances=2, sets=PACED + [f"tracing.otlp_endpoint={collector.url}",
                                                 "tracing.export_interval_s=0.1"])

    # ---- migrated: i0 -> i1 while it decodes
    tp, trace_id, client_span = traceparent()
    s = Stream(c.url, 150, prompt=PROMPT, ignore_eos=True, headers={"traceparent": tp})
    s.wait_tokens(10)
    out = move(c, s.rid, "i1")
    assert out["outcome"] == "committed", out
    s.check_sim(150, prompt_tokens=len(PROMPT))

    spans = tree(collector, trace_id, lambda t: {"llumnix.request", "llumnix.decode", "llumnix.migration"} <= t.keys())
    (req,) = spans["llumnix.request"]
    assert req["parent"] == client_span and req["service"] == "llumnix-proxy" and req["kind"] == 2  # SERVER
    assert req["attrs"]["llumnix.request_id"] == s.rid and req["attrs"]["http.response.status_code"] == 200
    assert not req["error"]
    for name in ("llumnix.dispatch", "llumnix.prefill", "llumnix.decode"):
        (span,) = spans[name]
        assert span["parent"] == req["id"] and within(span, req), (name, span, req)
    dispatch, prefill, decode = spans["llumnix.dispatch"][0], spans["llumnix.prefill"][0], spans["llumnix.decode"][0]
    assert dispatch["attrs"]["llumnix.instance"] == "i0" and prefill["attrs"]["llumnix.instance"] == "i0"
    assert dispatch["end"] <= prefill["start"] + 1 and prefill["end"] <= decode["start"] + 1
    assert decode["attrs"]["llumnix.tokens"] == 150 and decode["attrs"]["llumnix.instance"] == "i1"
    moved = [attrs for name, attrs in decode["events"] if name == "migrated"]
    assert moved and moved[0]["llumnix.migration.src"] == "i0" and moved[0]["llumnix.migration.dst"] == "i1", decode
    assert "llumnix.failover" not in spans and "llumnix.redispatch" not in spans

    (mig,) = spans["llumnix.migration"]  # recorded by the source instance, under the proxy's request span
    assert mig["service"] == "llumnix-instance" and mig["instance"] == "i0" and mig["parent"] == req["id"]
    assert mig["attrs"]["llumnix.migration.outcome"] == "committed" and mig["attrs"]["llumnix.migration.dst"] == "i1"
    stage_spans = sorted((v[0] for k, v in spans.items() if k.startswith("llumnix.migration.stage ")),
                         key=lambda x: x["attrs"]["llumnix.migration.stage"])
    assert len(stage_spans) == mig["attrs"]["llumnix.migration.stages"] >= 2, stage_spans
    assert [x["attrs"]["llumnix.migration.stage_kind"] for x in stage_spans][0] == "reserve"
    assert stage_spans[-1]["attrs"]["llumnix.migration.stage_kind"] == "last"
    assert all(x["parent"] == mig["id"] and within(x, mig) for x in stage_spans)
    assert sum(x["attrs"]["llumnix.migration.blocks"] for x in stage_spans) == mig["attrs"]["llumnix.migration.blocks"] \
        - mig["attrs"].get("llumnix.migration.cached_blocks", 0)
    assert decode["start"] <= mig["start"] and mig["end"] <= req["end"]

    # ---- failed over: kill -9 the instance that serves it, mid-stream
    failovers = proxy_metric(c.url, "llumnix_proxy_failovers_total")
    tp, trace_id, client_span = traceparent()
    s = Stream(c.url, 150, prompt=PROMPT, ignore_eos=True, headers={"traceparent": tp})
    s.wait_tokens(10)
    os.kill(c.proc("instance-i0").pid, signal.SIGKILL)
    s.check_sim(150, prompt_tokens=len(PROMPT))
    assert proxy_metric(c.url, "llumnix_proxy_failovers_total") == failovers + 1

    spans = tree(collector, trace_id, lambda t: {"llumnix.request", "llumnix.failover", "llumnix.decode"} <= t.keys()
                 and len(t.get("llumnix.dispatch", [])) == 2)
    (req,) = spans["llumnix.request"]
    assert req["parent"] == client_span and not req["error"], req
    assert req["attrs"]["llumnix.instances"] == "i0,i1", req["attrs"]
    first, second = sorted(spans["llumnix.dispatch"], key=lambda x: x["start"])
    (fo,) = spans["llumnix.failover"]
    assert first["attrs"]["llumnix.instance"] == "i0" and first["attrs"]["llumnix.from_token"] == 0
    assert second["attrs"]["llumnix.instance"] == "i1" and second["attrs"]["llumnix.from_token"] >= 10
    assert fo["parent"] == req["id"] and fo["attrs"]["llumnix.failover.from_instance"] == "i0"
    assert fo["attrs"]["llumnix.failover.at_token"] == second["attrs"]["llumnix.from_token"]
    assert first["end"] <= fo["start"] <= second["end"] <= fo["end"] + 1 and not fo["error"], fo
    (decode,) = spans["llumnix.decode"]
    assert decode["attrs"]["llumnix.tokens"] == 150 and decode["attrs"]["llumnix.instance"] == "i1"
    assert all(x["parent"] == req["id"] for v in spans.values() for x in v if x is not req)


def test_sampling_zero_follows_the_client_and_exports_with_the_headers_file(start_cluster, collector, tmp_path):
    (tmp_path / "otlp-headers").write_text("Authorization: Bearer collector-secret\n")
    c = start_cluster(instances=1, sets=[f"tracing.otlp_endpoint={collector.url}", "tracing.export_interval_s=0.1",
                                         "tracing.sample_ratio=0", f"tracing.headers_file={tmp_path / 'otlp-headers'}"])
    # Not sampled here (ratio 0), and a malformed traceparent is no parent: nothing is exported for these ...
    for headers in ({}, {"traceparent": "00-xyz-1-01"}):
        Stream(c.url, 5, prompt=PROMPT, headers=headers).check_sim(5)
    # ... but a client's sampled traceparent is followed whatever the ratio.
    tp, trace_id, client_span = traceparent()
    s = Stream(c.url, 5, prompt=PROMPT, headers={"traceparent": tp})
    s.check_sim(5)
    spans = tree(collector, trace_id, lambda t: "llumnix.decode" in t and "llumnix.request" in t)
    assert spans["llumnix.request"][0]["parent"] == client_span
    with collector.lock:
        assert {x["trace"] for x in collector.spans} == {trace_id}, "an unsampled request was exported"
    assert collector.auth == {"Bearer collector-secret"}, collector.auth
