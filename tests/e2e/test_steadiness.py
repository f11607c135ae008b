"""Steady on a busy host: slowness is not taken for death, a request that finds no instance free waits for one,
and overload is refused at once with 429 and Retry-After (real daemons on the sim engine).

Each test waits on conditions (a log line, a metric, the manager's view), never on a sleep.
"""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from tests.conftest import ctl_json
from tests.streams import Stream, proxy_metric, samples, metric, wait_for

pytestmark = pytest.mark.e2e

PROMPT = list(range(100, 180))
PACED = ["instance.min_step_s=0.02", "manager.dispatch_policy=flood"]  # flood: every request on i0


def log_of(c, name: str) -> str:
    return Path(c.proc(name).log).read_text(errors="replace")


def test_an_instance_whose_interpreter_is_busy_is_late_not_dead(start_cluster, monkeypatch):
    """One step of i0 keeps its interpreter busy for 4 s (as a long CPU prefill holding the GIL would): no
    heartbeat, report or token leaves it meanwhile, past the manager's 3 heartbeats (0.6 s) and the proxy's
    instance_timeout_s (3 s). Its connection still answers keepalives, so it is late, not dead: no stream fails
    over, the manager never marks it dead, and every stream completes exactly."""
    monkeypatch.setenv("LLUMNIX_FAULTS", "i0:busy_step_after=40;i0:busy_step_s=4")
    c = start_cluster(instances=2, sets=PACED)
    streams = [Stream(c.url, 200, prompt=PROMPT, ignore_eos=True) for _ in range(3)]
    for s in streams:
        s.check_sim(200, prompt_tokens=len(PROMPT))
    assert "keeps the interpreter busy" in log_of(c, "instance-i0")
    manager = log_of(c, "manager")
    assert "late, not dead" in manager, manager[-3000:]
    assert "marked dead" not in manager, manager[-3000:]
    assert proxy_metric(c.url, "llumnix_proxy_failovers_total") == 0
    assert {v.instance_id: v.state for v in c.admin().status().instances} == {"i0": "alive", "i1": "alive"}


def test_a_killed_instance_is_dead_at_once_by_its_connection(start_cluster):
    """kill -9 closes the instance's connections: the manager marks it dead from that, and says so."""
    c = start_cluster(instances=2, sets=["manager.dead_after_missed=1000"])  # silence alone would take 200 s
    c.proc("instance-i1").process().kill()
    wait_for(lambda: {v.instance_id: v.state for v in c.admin().status().instances}["i1"] == "dead", 20,
             "i1 not marked dead")
    assert "its connection went down" in log_of(c, "manager")
    assert Stream(c.url, 5, ignore_eos=True).result().error is None


def _post(url: str, timeout: float = 30, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "llumnix-sim", "prompt": "x", "max_tokens": 5,
                                                      "ignore_eos": True, **extra}, timeout=timeout)


def test_a_request_waits_for_an_instance_instead_of_503(start_cluster):
    """Every instance cordoned: a request waits (counted), and is served once one takes requests again."""
    c = start_cluster(instances=1, sets=["admission.queue_timeout_s=60"])
    ctl_json("cordon", "i0", "--run-dir", str(c.run_dir))
    wait_for(lambda: _takers(c) == 0, 20, "the proxy never saw the cordon")
    got: list[httpx.Response] = []
    t = threading.Thread(target=lambda: got.append(_post(c.url, timeout=90)))
    t.start()
    try:
        wait_for(lambda: proxy_metric(c.url, "llumnix_proxy_dispatch_waits_total") >= 1, 30, "the request did not wait")
        assert not got, got  # still waiting, not refused
        ctl_json("uncordon", "i0", "--run-dir", str(c.run_dir))
    finally:
        t.join(90)
    assert got and got[0].status_code == 200, got and got[0].text


def _takers(c) -> int:
    """Instances that take requests in the proxy's own view (its /health)."""
    return httpx.get(c.url + "/health", timeout=10).json()["instances_alive"]


def test_waiting_is_bounded_then_503_with_retry_after(start_cluster):
    c = start_cluster(instances=1, sets=["admission.queue_timeout_s=0.5", "admission.retry_after_s=7"])
    ctl_json("cordon", "i0", "--run-dir", str(c.run_dir))
    wait_for(lambda: _takers(c) == 0, 20, "the proxy never saw the cordon")
    r = _post(c.url)
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "7"
    err = r.json()["error"]
    assert err["code"] == "wait_timeout" and "admission.queue_timeout_s" in err["message"], err
    m = samples(httpx.get(c.url + "/metrics").text)
    assert metric(m, "llumnix_proxy_admission_rejections_total", reason="wait_timeout") >= 1


def test_overload_is_refused_at_once_with_429_and_high_priority_still_admitted(start_cluster):
    """One instance of batch 2 with two long streams running: requests queue behind them; past
    admission.max_queued_requests (2 per instance) a normal request gets 429 with Retry-After at once, while a
    high-priority one is still admitted (its bound is twice as large) and served."""
    c = start_cluster(instances=1, sets=["sim.max_num_seqs=2", "admission.max_queued_requests=2",
                                         "instance.min_step_s=0.02"])
    running = [Stream(c.url, 3000, ignore_eos=True) for _ in range(2)]  # a minute: they outlast every check
    for s in running:
        s.wait_tokens(1)
    queued = [Stream(c.url, 3, ignore_eos=True) for _ in range(2)]
    wait_for(lambda: c.admin().status().instances[0].load.waiting == 2, 20, "the two requests did not queue")
    # The proxy hears the same load from the instance's heartbeat: wait until it refuses.
    r = wait_for(lambda: (lambda r: r if r.status_code == 429 else None)(_quick(c.url)), 20, "never refused with 429")
    assert r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert err["type"] == "rate_limit_exceeded" and err["code"] == "rate_limit_exceeded", err
    assert "admission.max_queued_requests: 2 in all" in err["message"], err
    high = Stream(c.url, 3, ignore_eos=True, priority="high")
    wait_for(lambda: c.admin().status().instances[0].load.waiting == 3, 20, "the high-priority request did not queue")
    assert _quick(c.url).status_code == 429  # normal still refused while high is admitted
    for s in running:
        s.stop_after = 0  # the clients leave: their requests are aborted, and the queued ones run, high first
    high.result()
    assert high.error is None, high.error
    for s in queued:
        assert s.result().error is None, s.error
    m = samples(httpx.get(c.url + "/metrics").text)
    assert metric(m, "llumnix_proxy_admission_rejections_total", reason="queued_requests") >= 2


def test_with_an_slo_status_shows_attainment_and_overload_is_refused_by_predicted_ttft(start_cluster):
    """[slo] set: the requests are judged where they finish (llumnixctl status --json shows the attainment and
    the instance's predictions); with both batch slots held by long streams, a new request is predicted to wait
    past its TTFT target, and is refused at once with 429 and Retry-After (reason ttft, counted as refused)."""
    c = start_cluster(instances=1, sets=["sim.max_num_seqs=2", "instance.min_step_s=0.02", "slo.ttft_ms=400",
                                         "slo.tpot_ms=1000"])
    for _ in range(6):
        r = _post(c.url)
        assert r.status_code == 200, r.text

    def judged() -> dict | None:
        st = ctl_json("status", "--run-dir", str(c.run_dir))
        return st if st["totals"]["slo_judged"] >= 6 else None

    st = wait_for(judged, 20, "status never showed the six requests judged")
    i0 = st["instances"][0]
    assert (i0["slo_met"], i0["slo_judged"], i0["slo_attainment"], st["totals"]["slo_attainment"]) == (6, 6, 1.0, 1.0)
    assert i0["predicted_ttft_s"] is not None and i0["predicted_tpot_s"] > 0  # the model it fitted from its steps
    running = [Stream(c.url, 3000) for _ in range(2)]  # a minute: they outlast every check
    for s in running:
        s.wait_tokens(1)
    r = wait_for(lambda: (lambda r: r if r.status_code == 429 else None)(_quick(c.url)), 30, "never refused with 429")
    assert int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    m = samples(httpx.get(c.url + "/metrics").text)
    assert metric(m, "llumnix_proxy_admission_rejections_total", reason="ttft") >= 1
    assert metric(m, "llumnix_proxy_slo_requests_total", **{"class": "normal", "outcome": "refused"}) >= 1
    for s in running:
        s.stop_after = 0


def _quick(url: str) -> httpx.Response:
    """A request whose answer, if it is admitted, is not waited for: the client leaves after 0.5 s (the proxy
    then aborts it), which is all a refusal needs (it comes at once)."""
    try:
        return _post(url, timeout=0.5)
    except httpx.TimeoutException:
        return httpx.Response(200)
