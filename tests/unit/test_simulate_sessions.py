"""``llumnixctl simulate --sessions``: the session trace as a closed loop in virtual time, each turn naming its
session (sim/cache.py), and ``--compare``'s three systems on the same trace (sim/sessions.py)."""

from __future__ import annotations

import logging

import pytest

from daemons import wire
from daemons.config import load_config
from llumnixctl.experiments.sim import cache as simcache, sessions as simsessions
from llumnixctl.experiments.sim.parts import SimulatedRequest
from llumnixctl.experiments.sim.simulate import Network, Simulation
from llumnixctl.experiments.traces import sessions as tsessions

SMALL = ["sim.block_size=16", "sim.num_blocks=400", "sim.max_num_seqs=32", "sim.prefill_ms_per_token=0.2",
         "sim.prefill_ms=5", "sim.decode_ms=20", "sim.decode_ms_per_seq=0.3", "model.max_model_len=4096",
         "manager.log_level=warning"]


@pytest.fixture(autouse=True)
def quiet():
    logging.getLogger("llumnix").setLevel(logging.WARNING)


def trace(n: int = 6, seed: int = 0):
    return tsessions.sessions(n, session_rate=4.0, turns=(3, 5), agents=2, system_tokens=256, message=(16, 96),
                              reply=(8, 32), think=0.3, max_context=4096, seed=seed)


def test_the_turns_of_a_session_go_in_a_closed_loop_in_virtual_time():
    reqs = trace()
    cfg = load_config(None, SMALL + simsessions.system_sets("sessions"))
    sim = Simulation(cfg, 2, reqs, Network(), slo_admission=False, sessions=True, seed=0)
    res = sim.run()
    assert res["completed"] == len(reqs) and res["failed"] == 0 and res["leaked_blocks"] == 0
    by = {(r.trace.session, r.trace.turn): r for r in sim.requests.values()}
    later = [(by[(s, k - 1)], r) for (s, k), r in by.items() if k > 0]
    assert later
    for prev, cur in later:  # sent its think time after the answer before it ended, not at its nominal arrival
        assert cur.sent >= prev.last + cur.trace.think_s - 1e-9
        assert cur.sent <= prev.last + cur.trace.think_s + 0.01
    assert res["prefix_hit_rate"] > 0.5  # a turn's prompt is mostly the one before it


class Recorder:
    """The manager as SimCache asks it: what Dispatches it got (one instance answers)."""

    def __init__(self, pull: bool = False):
        self.asked: list[wire.Dispatch] = []
        self.cache_index = type("Index", (), {"_ask": None})()
        self.pull = pull

    def on_dispatch_batch(self, batch):
        self.asked.extend(batch)
        extra = {"pull_from": "i1", "pull_blocks": 3} if self.pull and simcache.REPLY_PULL else {}
        return [wire.DispatchReply(d.query_id, "i0", **extra) for d in batch]


def test_each_turn_names_its_session_on_its_submit_and_where_the_wire_has_it_its_dispatch():
    reqs = trace(2, seed=3)
    cfg = load_config(None, SMALL + ["sim.prefix_caching=true", "manager.dispatch_policy=llumnix-cache"])
    for keys in (True, False):
        mgr = Recorder(pull=True)
        cache = simcache.SimCache(cfg, mgr, reqs, 0.001, False, site=None, sessions=keys, seed=3)
        req = SimulatedRequest(reqs[-1], "r1")
        cache.ask(req, 1, 0, (), "")
        key = tsessions.session_key(3, reqs[-1].session)
        fields = cache.submit_fields(req)
        if keys:
            assert fields["session"] == key
            assert (mgr.asked[0].session == key) if simcache.DISPATCH_SESSION else True
        else:
            assert "session" not in fields
            assert not simcache.DISPATCH_SESSION or mgr.asked[0].session == ""
        assert mgr.asked[0].prefix_keys == cache.keys_of(req) != []
        if simcache.REPLY_PULL:  # a pull the manager ordered goes on the Submit
            assert (fields["pull_from"], fields["pull_blocks"]) == ("i1", 3)
        wire.Submit("r1", [1], wire.SamplingParams(max_tokens=1), "inproc://x", **fields)  # (they are Submit's)


def test_compare_runs_the_three_systems_on_one_trace():
    reqs = trace(5, seed=1)
    res = simsessions.compare(Simulation, None, SMALL + ["slo.ttft_ms=400", "slo.tpot_ms=100"], 2, reqs, Network(), 1,
                              kv_tokens=2 * 400 * 16, processes=1)
    rows = {r["system"]: r for r in res["systems"]}
    assert set(rows) == set(simsessions.SYSTEMS)
    for r in rows.values():
        assert r["completed"] == len(reqs) and r["failed"] == 0 and r["leaked_blocks"] == 0
        assert 0 < r["goodput_rps"] and 0 <= r["attainment"] <= 1 and r["p99_ttft_ms"] >= r["mean_ttft_ms"] > 0
    assert "manager.dispatch_policy=infaas++" in rows["infaas++"]["settings"]
    # the manager placed the sessions' turns knowing their sessions; the others' turns named none
    assert rows["sessions"]["sessions_known"] == (5 if simcache.DISPATCH_SESSION else 0)
    assert rows["llumnix-cache"]["sessions_known"] == rows["infaas++"]["sessions_known"] == 0
    assert rows["llumnix-cache"]["prefix_hit_rate"] >= rows["infaas++"]["prefix_hit_rate"]
    assert res["trace"]["turns"] == len(reqs) and res["trace"]["working_set_over_kv"] > 0
    assert "P99 TTFT ms" in simsessions.compare_block(res)


def test_turn_bounds_parse_or_say_what_is_wrong():
    assert simsessions.parse_turns("20-40") == (20, 40) and simsessions.parse_turns("7") == (7, 7)
    for bad in ("x", "40-20", "0-3"):
        with pytest.raises(ValueError, match="--turns"):
            simsessions.parse_turns(bad)
