"""Sim-to-real at small size: one trace through real daemons (4 sim instances, real time) and through the
simulator, which takes this machine's fixed costs from a probe of ten requests, one at a time, before the
trace (llumnixctl/experiments/sim/sim2real.py).

The issue's bar (mean TTFT within 10%, P99 within 20%) is a measurement: ``bash scripts/sim2real.sh`` runs 400
requests and writes results/sim2real.json (its ``agree``). Here, 48 requests on a machine that CI shares with
other work: TTFT is some 30 ms of dispatch, queueing and prefill, and moves with whatever else runs (1% on
a quiet run here, 13% and 37% in two others). So this test holds the parts that the simulator's model
decides, decode steps (TPOT) and whole requests (E2EL), to 50%, which a step-time or batching model off
by a factor would cross; TTFT only to 75% (simulated between a quarter and 1.75 times the measured). It runs
alone (pytest.mark.alone: scripts/test.sh runs it after the others).
"""

from __future__ import annotations

import pytest

from llumnixctl.experiments.traces import gen as trace
from llumnixctl.experiments.sim.sim2real import compare

pytestmark = [pytest.mark.e2e, pytest.mark.alone, pytest.mark.timeout(300)]


def test_simulator_and_daemons_agree_on_a_small_trace():
    reqs = trace.generate(48, rate=3.0, prompt=(16, 512), output=(16, 128), seed=11)
    res = compare(reqs, instances=4)
    real, sim = res["real"], res["simulated"]
    assert real["completed"] == sim["completed"] == 48 and real["failed"] == 0
    assert res["calibration"]["probes"] == 10
    rel = res["relative_difference"]
    assert abs(rel["mean_tpot_ms"]) <= 0.5 and abs(rel["mean_e2el_ms"]) <= 0.5, (rel, real, sim)
    assert abs(rel["mean_ttft_ms"]) <= 0.75, (rel, real, sim)
