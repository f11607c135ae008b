"""Tracing's off state costs nothing (no OpenTelemetry import, no span objects), and its settings and inputs
are checked where they enter: the endpoint URL at load, the traceparent's form, the headers file."""

from __future__ import annotations

import subprocess
import sys

import pytest

from daemons import wire
from daemons.config import ConfigError, load_config
from daemons.runtime import StartupError
from daemons.tracing import Tracer, _read_headers, valid_traceparent

GOOD = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_off_by_default_and_nothing_of_opentelemetry_is_imported():
    cfg = load_config(None, [])
    assert cfg.tracing.otlp_endpoint == "" and Tracer.create(cfg.tracing, "llumnix-proxy") is None
    code = ("import sys, daemons.proxy.app, daemons.instance.daemon; from daemons.config import load_config; "
            "from daemons.proxy.service import Proxy; p = Proxy(load_config(None, [])); assert p.tracer is None; "
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("value", ["127.0.0.1:4318", "tcp://127.0.0.1:4318", "http://", "http://h:port/v1/traces"])
def test_a_bad_endpoint_names_the_key(value):
    with pytest.raises(ConfigError, match="tracing.otlp_endpoint"):
        load_config(None, [f"tracing.otlp_endpoint={value}"])


def test_traceparent_form():
    assert valid_traceparent(GOOD)
    for bad in ["", GOOD.upper(), GOOD[:-1], "ff" + GOOD[2:], GOOD.replace("0af7651916cd43dd8448eb211c80319c", "0" * 32),
                GOOD.replace("b7ad6b7169203331", "0" * 16), "00-xyz-1-01"]:
        assert not valid_traceparent(bad), bad
    # On the wire, anything but a traceparent's length is refused with the message (dropped and logged).
    ok = wire.Submit("r", [1], wire.SamplingParams(), "tcp://127.0.0.1:1", traceparent=GOOD)
    assert wire.decode(wire.encode(ok)).traceparent == GOOD
    with pytest.raises(ValueError, match="traceparent"):
        wire.Submit("r", [1], wire.SamplingParams(), "tcp://127.0.0.1:1", traceparent="x" * 5000)


def test_headers_file(tmp_path):
    f = tmp_path / "h"
    f.write_text("# the collector's key\nAuthorization: Bearer abc\n\nx-tenant: t1\n")
    cfg = load_config(None, ["tracing.otlp_endpoint=http://127.0.0.1:9/v1/traces", f"tracing.headers_file={f}"])
    assert _read_headers(str(f)) == {"authorization": "Bearer abc", "x-tenant": "t1"}  # sent: tests/e2e/test_tracing.py
    Tracer.create(cfg.tracing, "llumnix-proxy").shutdown()  # no span is made: nothing goes to port 9
    f.write_text("no colon here\n")
    with pytest.raises(StartupError, match="line 1"):
        Tracer.create(cfg.tracing, "llumnix-proxy")
    cfg.tracing.headers_file = str(tmp_path / "missing")
    with pytest.raises(StartupError, match="cannot read"):
        Tracer.create(cfg.tracing, "llumnix-proxy")
