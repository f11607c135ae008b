"""``llumnixctl simulate`` with prefix caching: the manager's prefix index from the instances' published
batches, cache-aware dispatch through the manager (Dispatch.prefix_keys), the oracle, closed-loop sessions."""

from __future__ import annotations

import logging

import pytest

from daemons.config import load_config
from llumnixctl.experiments.traces import cache as tracecache
from llumnixctl.experiments.sim.simulate import Network, Simulation

SMALL = ["sim.block_size=16", "sim.num_blocks=600", "sim.max_num_seqs=64", "sim.prefill_ms_per_token=0.2",
         "sim.prefill_ms=5", "sim.decode_ms=20", "sim.decode_ms_per_seq=0.3", "sim.prefix_caching=true",
         "model.max_model_len=4096", "manager.log_level=warning"]


@pytest.fixture(autouse=True)
def quiet():
    logging.getLogger("llumnix").setLevel(logging.WARNING)


def run(trace, policy: str, instances: int = 6, linger_s: float = 0.0):
    oracle = policy == "oracle-cache"
    cfg = load_config(None, SMALL + [f"manager.dispatch_policy={'llumnix' if oracle else policy}"])
    sim = Simulation(cfg, instances, trace, Network(), oracle=oracle)
    return sim, sim.run(linger_s)


def test_cache_aware_dispatch_through_the_manager_finds_the_warm_instances():
    # 150 prompts of 128 tokens, alike in popularity: twice what one instance's cache holds, a third of six.
    trace = tracecache.shared_prefix(300, rate=30, prefixes=150, prefix_tokens=128, skew=0.0, suffix=(16, 64),
                                     output=(16, 64), seed=0)
    blind_sim, blind = run(trace, "llumnix")
    sim, aware = run(trace, "llumnix-cache", linger_s=1.0)
    _, oracle = run(trace, "oracle-cache")
    for res in (blind, aware, oracle):
        assert res["completed"] == 300 and res["failed"] == 0 and res["leaked_blocks"] == 0
    assert aware["prefix_hit_rate"] > blind["prefix_hit_rate"] + 0.2, (aware["prefix_hit_rate"], blind["prefix_hit_rate"])
    assert oracle["prefix_hit_rate"] >= aware["prefix_hit_rate"] - 0.05
    # The manager's index is what the instances hold (published batch by batch, asked for whole once).
    index = sim.mgr.cache_index.index  # (run with linger_s=1: what was on its way when the trace ended arrived)
    for iid, inst in sim.instances.items():
        inst.pub.add(inst.engine.cache_events())
        batch = inst.pub.take()
        if batch is not None:
            sim.mgr.on_cache_events(inst.ident, batch)
        assert index.blocks(iid) == len(inst.engine.cache) > 0
    assert blind_sim.mgr.cache_index.index.entries() > 0  # published whatever the policy


def test_a_later_turn_is_sent_after_the_turn_before_it_ended():
    trace = tracecache.multi_turn(120, rate=20, turns=(2, 4), system_prompts=2, system_tokens=64, think=0.5, seed=1)
    sim, res = run(trace, "llumnix-cache", instances=3)
    assert res["failed"] == 0 and res["completed"] == 120
    prev = tracecache.previous_turns(trace)
    assert prev
    for i, p in prev.items():
        r, before = sim.requests[f"r{i}"], sim.requests[f"r{p}"]
        assert r.sent >= before.last + trace[i].think_s - 1e-9
    assert res["prefix_hit_rate"] > 0.3
