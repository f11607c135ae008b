"""``llumnixctl simulate`` serving to an SLO: the simulated proxy admits with the proxy's own Admission
(daemons.policy.slo.admit), refused requests are counted and not served, queued ones give up past
slo.give_up_factor x their TTFT target (aborted where they queue: nothing leaks), and the result counts per class
what met both targets, what missed which, goodput and the prediction error."""

from __future__ import annotations

import pytest

from daemons.config import load_config
from daemons.policy import slo
from llumnixctl.experiments.sim.result import result_block
from llumnixctl.experiments.sim.simulate import Simulation
from llumnixctl.experiments.traces import gen as trace

SMALL = ["sim.num_blocks=400", "sim.max_num_seqs=32", "instance.log_level=warning"]
TARGETS = ["slo.ttft_ms=150", "slo.tpot_ms=60"]


def _trace(n=240, rate=60.0):
    return trace.generate(n, rate=rate, arrival="gamma", cv=2.0, prompt=(16, 512), output=(8, 128), alpha=1.0,
                          high_fraction=0.2, seed=5)


def _run(sets, admission=True, n=240, rate=60.0):
    cfg = load_config(None, SMALL + list(sets))
    sim = Simulation(cfg, 2, _trace(n, rate), slo_admission=admission)
    return sim, sim.run()


def _accounted(c: dict) -> None:
    assert c["admitted"] == c["gave_up"] + c["failed"] + c["met"] + c["missed_ttft"] + c["missed_tpot"] + c["missed_both"]


@pytest.mark.parametrize("dispatch", ["local", "manager"])
def test_an_overloaded_cluster_refuses_by_the_proxys_own_rule_and_serves_the_rest(monkeypatch, dispatch):
    judged = []
    inner = slo.admit

    def admit(*a, **kw):
        judged.append(inner(*a, **kw))
        return judged[-1]

    monkeypatch.setattr(slo, "admit", admit)  # the proxy's Admission calls it through the module
    sim, res = _run(TARGETS + ["manager.dispatch_policy=slo", f"proxy.dispatch={dispatch}"])
    s = res["slo"]
    n = len(sim.trace)
    assert s["admission"] and s["targets_ms"]["normal"] == {"ttft": 150.0, "tpot": 60.0}
    both = s["all"]
    assert both["admitted"] + both["refused"] == n
    assert both["refused"] > 0 and both["refused"] == sum(not v.admitted for v in judged)
    assert len(judged) >= both["refused"]  # judged once each, except before any instance had a model
    refused = [r for r in sim.requests.values() if r.slo == "refused"]
    assert all(r.tokens == 0 and r.dispatches == 0 for r in refused)  # never served
    assert res["completed"] == both["admitted"] - both["gave_up"] - both["failed"]
    for name in ("normal", "high", "all"):
        _accounted(s[name])
    assert s["normal"]["admitted"] + s["high"]["admitted"] == both["admitted"]
    assert both["attainment"] == pytest.approx(both["met"] / both["admitted"])
    assert both["goodput"] == pytest.approx(both["met"] / res["duration"])
    assert both["prediction_error"]["ttft_samples"] > 0.5 * res["completed"]  # predicted at dispatch
    assert 0 <= both["prediction_error"]["ttft"] < 10
    assert res["leaked_blocks"] == 0
    if dispatch == "local":  # the slo policy's TPOT targets reach the proxy's view, as in the proxy
        assert sim.proxy.view.tpot_targets == {0: 0.06, 1: 0.06}
    text = result_block(res)
    assert "Serving to an SLO" in text and "Attainment (met / admitted)" in text


def test_queued_requests_give_up_past_the_factor_and_free_their_place(monkeypatch):
    # Admit everything (as a proxy whose predictions were wrong): the queue grows, and requests that waited
    # give_up_factor x the TTFT target with no token are aborted where they queue.
    monkeypatch.setattr(slo, "admit", lambda states, *a, **kw: slo.Verdict(True, 0.0))
    sim, res = _run(TARGETS + ["slo.give_up_factor=2"])
    both = res["slo"]["all"]
    assert both["refused"] == 0 and both["gave_up"] > 0
    _accounted(both)
    gave_up = [r for r in sim.requests.values() if r.slo == "gave_up"]
    assert all(r.tokens == 0 and not r.finish for r in gave_up)  # no token counted after it gave up
    assert res["leaked_blocks"] == 0  # aborted on its instance
    assert all(not i.engine.has_work() for i in sim.instances.values())
    # the admitted that finished got their first token within the give-up time, or before it was up
    assert all(r.first - r.sent <= 2 * 0.150 + 1e-9 for r in sim.requests.values() if r.finish)


def test_queue_everything_only_measures_and_admission_raises_attainment():
    _, off = _run(TARGETS + ["manager.dispatch_policy=llumnix"], admission=False)
    _, on = _run(TARGETS + ["manager.dispatch_policy=slo"])
    a, b = off["slo"]["all"], on["slo"]["all"]
    assert not off["slo"]["admission"] and a["refused"] == 0 and a["gave_up"] == 0
    assert off["completed"] == len(_trace())
    _accounted(a)
    assert a["met"] < a["admitted"]  # overloaded: queueing everything misses
    assert b["attainment"] > a["attainment"]


def test_without_targets_every_finished_request_meets_and_nothing_is_refused():
    sim, res = _run([], n=60, rate=5.0)
    s = res["slo"]
    assert not s["admission"] and s["all"]["refused"] == 0
    assert s["all"]["met"] == res["completed"] == 60 and s["all"]["attainment"] == 1.0
    assert sim.proxy is not None and not sim.proxy.by_slo  # proxy.dispatch = local: its view, no admission
