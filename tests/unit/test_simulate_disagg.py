"""``llumnixctl simulate`` with prefill/decode roles (llumnixctl/experiments/sim/disagg.py): dispatch by
``disagg.decide``, the handover at the first token by the instances' own migrators to the destination
``disagg.handover_destination`` chooses, balance never onto a prefill instance, an empty pool degrades to mixed
serving, adaptive roles by the pure rule, and the result's figures."""

from __future__ import annotations

import pytest

from daemons.config import load_config
from llumnixctl.experiments.sim.disagg import parse_roles
from llumnixctl.experiments.sim.parts import PROXY_ADDRESS
from llumnixctl.experiments.sim.simulate import Simulation
from llumnixctl.experiments.traces import gen as trace

SMALL = ["sim.num_blocks=1200", "sim.max_num_seqs=32", "instance.log_level=warning"]


def _trace(n=80, rate=8.0, prompt=(600, 2000), output=(20, 60), seed=3):
    return trace.generate(n, rate=rate, arrival="poisson", cv=1.0, prompt=prompt, output=output, alpha=1.0,
                          high_fraction=0.0, seed=seed)


def _run(roles, sets=(), instances=3, **kw):
    cfg = load_config(None, SMALL + list(sets))
    sim = Simulation(cfg, instances, _trace(**kw), roles=roles)
    moves = []
    sim.observe(lambda kind, _, d: kind == "migration" and moves.append(d))
    return sim, sim.run(), moves


def test_roles_parse_from_a_split_or_a_list_and_bad_ones_are_named():
    assert parse_roles("2:3", 5) == ["prefill"] * 2 + ["decode"] * 3
    assert parse_roles("p,decode,m", 3) == ["prefill", "decode", "mixed"]
    for spec, n, why in (("2:2", 5, r"P \+ D"), ("x:1", 2, "two counts"), ("p,q", 2, "unknown role 'q'"),
                         ("p,d", 3, "2 roles for 3")):
        with pytest.raises(ValueError, match=why):
            parse_roles(spec, n)


def test_long_prompts_prefill_on_the_prefill_instance_and_decode_where_they_were_handed_over():
    sim, res, moves = _run(["prefill", "decode", "decode"], rate=3.0)  # (the prefill instance is not saturated)
    d = res["disagg"]
    n = len(sim.trace)
    assert res["completed"] == n and res["failed"] == 0 and res["leaked_blocks"] == 0
    assert d["decisions"] == {"remote": n}
    assert d["handovers"] == {"handover/committed": n} and d["handovers_committed"] == n
    assert d["handover_ms"]["median"] > 0
    handovers = [m for m in moves if m["reason"] == "handover"]
    assert len(handovers) == n and all(m["src"] == "i0" and m["dst"] in ("i1", "i2") for m in handovers)
    assert {m["dst"] for m in handovers} == {"i1", "i2"}  # the destination is chosen at handover time
    # The decode instances took no request from the proxy (nothing prefilled there), and every request ended
    # on one of them.
    assert sim.instances["i1"].taken.get(PROXY_ADDRESS, 0) == sim.instances["i2"].taken.get(PROXY_ADDRESS, 0) == 0
    assert all(r.owner in ("i1", "i2") for r in sim.requests.values())
    assert res["migrations"]["handover/committed"] == n  # counted with the migrations, by reason
    assert not [m for m in moves if m["reason"] not in ("handover", "role") and m["dst"] == "i0"]


def test_short_prompts_prefill_where_they_decode_and_no_roles_change_nothing():
    sim, res, moves = _run(["prefill", "decode", "decode"], prompt=(16, 200))
    d = res["disagg"]
    assert d["decisions"] == {"local_short": len(sim.trace)} and not d["handovers"]
    assert sim.instances["i0"].taken.get(PROXY_ADDRESS, 0) == 0
    assert res["completed"] == len(sim.trace) and res["leaked_blocks"] == 0
    _, plain, _ = _run(None, prompt=(16, 200))
    assert "disagg" not in plain and plain["completed"] == len(sim.trace)


def test_an_empty_decode_pool_serves_whole_requests_on_the_prefill_instances():
    sim, res, moves = _run(["prefill", "prefill"], instances=2, n=40)
    d = res["disagg"]
    assert d["decisions"] == {"no_decode_pool": 40} and res["completed"] == 40 and res["leaked_blocks"] == 0
    assert d["handovers"].get("handover/committed", 0) == 0  # nowhere to hand over: they decode where they are


def test_adaptive_roles_convert_a_decode_instance_when_prefill_is_short():
    # Admission holds the predicted TTFT of what it admits under slo.admit_at of the target, so a short prefill
    # pool shows as a prediction at that level (and refusals), never far past the target: admitted up to the
    # target itself and with a narrow hysteresis, this short trace lets the rule see it. (Judging the pools by
    # their refusals is the open part of adaptive roles under admission.)
    sets = ["slo.ttft_ms=1500", "slo.tpot_ms=200", "disagg.adaptive=true", "disagg.adapt_interval_s=3",
            "disagg.adapt_sustain_s=1", "disagg.min_decode=1", "disagg.adapt_margin=0.05", "slo.admit_at=1"]
    sim, res, moves = _run(["prefill", "decode", "decode", "decode"], sets, instances=4, n=160, rate=14.0,
                           prompt=(1500, 3000), output=(8, 24))
    d = res["disagg"]
    assert d["adaptive"] and d["role_changes"] >= 1
    first = d["changes"][0]
    assert (first["from"], first["to"]) == ("decode", "prefill") and "prefill short" in first["reason"]
    times = [c["t"] for c in d["changes"]]
    assert all(b - a >= 3.0 - 1e-6 for a, b in zip(times, times[1:])), times  # one change per interval
    assert first["t"] >= 1.0
    assert d["roles_at_end"].get("decode", 0) >= 1
    assert res["completed"] + res["slo"]["all"]["refused"] + res["slo"]["all"]["gave_up"] == len(sim.trace)
    assert res["leaked_blocks"] == 0


def test_the_fleet_figure_writes_its_table_and_goals_and_can_be_run_in_pieces(tmp_path):
    import json

    from llumnixctl.experiments.figs import disagg_fleet

    assert list(disagg_fleet.systems_for(8)) == ["adaptive", "2P6D", "3P5D", "4P4D", "5P3D", "6P2D", "llumnix", "slo"]
    assert list(disagg_fleet.systems_for(16))[1:6] == ["4P12D", "6P10D", "8P8D", "10P6D", "12P4D"]
    parts = tmp_path / "parts"
    data = disagg_fleet.main(["--quick", "--out", str(tmp_path / "a"), "--loads", "1", "--systems",
                              "adaptive,4P4D,llumnix", "--processes", "1", "--requests", "30", "--parts", str(parts)])
    assert json.loads((tmp_path / "a" / "disagg-fleet.json").read_text())["points"] == data["points"]
    rows = data["points"]["8"]["1"]
    assert list(rows) == ["adaptive", "4P4D", "llumnix"]
    assert rows["4P4D"]["handovers"].get("handover/committed", 0) > 0 and rows["llumnix"]["handover_ms"] is None
    assert all(r["met"] + r["missed_ttft"] + r["missed_tpot"] + r["missed_both"] == 30 for r in rows.values())
    goal = data["goals"]["8"]["per_load"][0]
    assert goal["best_fixed"] == "4P4D" and goal["adaptive_goodput"] == rows["adaptive"]["goodput"]
    again = disagg_fleet.main(["--quick", "--out", str(tmp_path / "b"), "--collect", str(parts)])
    assert again["points"] == data["points"]
