"""Schemathesis against the running proxy's /openapi.json: every route, valid and invalid inputs.

Whatever a client sends, the proxy answers without a 5xx, every 4xx body is OpenAI-style, and afterwards
it still serves. Bounded: a few examples per route and mode, no shrinking, no example database.
"""

from __future__ import annotations

import json

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

pytestmark = pytest.mark.e2e

MAX_EXAMPLES = 25
# /metrics is plain text and /openapi.json describes itself; neither takes input
SKIP = {("GET", "/metrics")}


def _check(case, response) -> None:
    where = f"{case.method} {case.formatted_path} body={case.body!r} headers={case.headers!r}"
    assert response.status_code < 500, f"{where} -> {response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        try:
            body = json.loads(response.text)
        except ValueError:
            raise AssertionError(f"{where} -> {response.status_code} with a non-JSON body: {response.text[:300]}")
        err = body.get("error") if isinstance(body, dict) else None
        assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, \
            f"{where} -> {response.status_code}, not an OpenAI error body: {response.text[:300]}"
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    """The shared cluster's settings, but steps take no model time and the context is 512 tokens: a fuzzed
    n * max_tokens cannot make the run long."""
    from llumnixctl.lab import localcluster
    from tests.conftest import FAST, Cluster

    run_dir = tmp_path_factory.mktemp("fuzz")
    cluster = Cluster(localcluster.up(run_dir, 2, "sim", 0, None, FAST + ["sim.time_scale=0", "model.max_model_len=512"],
                                      timeout_s=60), run_dir)
    try:
        yield cluster
    finally:
        cluster.stop()


def test_no_input_makes_the_proxy_fail(fuzzed):
    cluster = fuzzed
    schema = schemathesis.openapi.from_url(cluster.url + "/openapi.json")
    tested = []
    for result in schema.get_all_operations():
        operation = result.ok()
        if (operation.method.upper(), operation.path) in SKIP:
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                      suppress_health_check=list(HealthCheck))
            def fuzz(case):
                response = case.call(base_url=cluster.url, timeout=60)
                _check(case, response)

            try:
                fuzz()
            except Unsatisfiable:  # nothing to make invalid: a route without parameters or body
                assert mode is GenerationMode.NEGATIVE
        tested.append(f"{operation.method.upper()} {operation.path}")
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "POST /detokenize",
            "GET /v1/models/{model_id}"} <= set(tested)
    # still alive and serving
    assert httpx.get(cluster.url + "/health", timeout=10).status_code == 200
    r = httpx.post(cluster.url + "/v1/completions", timeout=60,
                   json={"model": "llumnix-sim", "prompt": "still there", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
