"""What makes the SLO's predictions hold on vLLM, without daemons: the output lengths an instance observes and what
its requests will still claim (daemons/instance/outlook.py), the slot and KV wait by that outlook, the bound past the
largest steps an instance has run (daemons/policy/slo.py), and admission that counts every proxy's admissions."""

from __future__ import annotations

from dataclasses import replace

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemons import policy, wire
from daemons.config import load_config
from daemons.instance.outlook import OutputLengths, outlook
from daemons.instance.predictor import StepFit
from daemons.policy import slo
from daemons.policy.lengths import expected_output
from daemons.proxy.cluster.client import ClusterClient, Overloaded

FIT = wire.LatencyFit(steps=100, prefill_ms=10, prefill_ms_per_token=0.1, decode_ms=15, decode_ms_per_seq=0.15,
                      decode_ms_per_token=0.0005, extra_ms=0, chunk_tokens=4096, finish_rate=10)


# ------------------------------------------------------------------ output lengths


def test_answers_cut_short_by_their_max_tokens_do_not_make_a_long_request_look_short():
    """A warm-up of short answers cut at 16 tokens says only "at least 16": a request that may run 300 tokens is
    expected to use all 300, not 16 (the finish rate of such a warm-up admitted a burst of long answers by it)."""
    lengths = OutputLengths()
    for _ in range(12):
        lengths.finished(16, natural=False)
    assert lengths.expected(0, 300) == 300
    assert lengths.expected(0, 8) == 8  # within what was seen: at most its own cap


def test_natural_lengths_give_the_mean_of_those_that_got_as_far():
    lengths = OutputLengths()
    for n in (10, 20, 30, 40):
        lengths.finished(n, natural=True)
    assert lengths.expected(0, 1000) == 25
    assert lengths.expected(25, 1000) == 35  # it already outlived 10 and 20
    assert lengths.expected(0, 15) == 14  # (10 + 15 + 15 + 15) / 4, capped at its max_tokens
    assert lengths.expected(45, 1000) == 1000  # it outlived them all: nothing bounds it but its cap
    assert expected_output([], 0, 77) == 77  # nothing observed: all of it


def test_the_window_forgets_old_finishes():
    lengths = OutputLengths(window=4)
    for _ in range(4):
        lengths.finished(100, natural=True)
    for _ in range(4):
        lengths.finished(10, natural=True)
    assert lengths.expected(0, 1000) == 10 and lengths.observed == 8


def test_a_step_fit_keeps_lengths_from_its_outputs_but_not_aborts():
    fit = StepFit(4096, lengths=OutputLengths())
    fit.outputs([wire.TokenOut("a", 9, 5, "stop"), wire.TokenOut("b", 3, 5, "abort"), wire.TokenOut("c", 1, 5)], 1.0)
    assert fit.lengths.snapshot()[0] == [10]


def test_the_outlook_counts_kv_at_final_lengths_and_orders_the_finishes():
    lengths = OutputLengths()  # nothing observed: every request uses its max_tokens
    rows = [wire.RequestLoad("a", "running", 1, 64, 100, max_tokens=300),  # 200 left, 364 tokens: 23 blocks
            wire.RequestLoad("b", "running", 1, 64, 290, max_tokens=300),  # 10 left
            wire.RequestLoad("c", "waiting", 0, 64, 0, max_tokens=300)]
    o = outlook(rows, lengths, block_size=16)
    assert o.committed_blocks == 3 * 23
    assert o.drain[0] == (10, 1, 23) and o.drain[-1] == (200, 2, 46)
    assert o.lengths == []


# ------------------------------------------------------------------ the wait by the outlook


def _state(committed: int, drain, total: int = 100, running: int = 4, batch: int = 64, **kw) -> policy.InstanceState:
    return policy.InstanceState("a", total, blocks_used=running * 4, running=running, batch_size=batch, block_size=16,
                                context_tokens=running * 64, latency=FIT,
                                outlook=wire.Outlook(committed, drain, []), **kw)


def test_no_wait_while_the_final_kv_fits():
    s = _state(committed=50, drain=[(100, 1, 23)])
    assert slo.slot_wait_s(s, FIT, slo.ahead_of(s, False), 64, 100) == 0.0  # 50 + 11 blocks of 100


def test_kv_that_the_batch_will_grow_into_makes_a_new_request_wait_for_finishes():
    """The blocks held now are few (4 a request), but the four will grow to 23 each: the new one waits until
    enough of them finish, at the decode step's time per token."""
    s = _state(committed=92, drain=[(10, 1, 23), (50, 2, 46), (200, 4, 92)])
    step_s = slo.decode_ms(FIT, 4, 256) / 1000
    assert slo.slot_wait_s(s, FIT, slo.ahead_of(s, False), 64, 300) == pytest.approx(10 * step_s)
    # our own pending dispatches count at their final lengths too: then two must finish
    s2 = _state(committed=92, drain=s.outlook.drain, pending_final_blocks=23)
    assert slo.slot_wait_s(s2, FIT, slo.ahead_of(s2, False), 64, 300) == pytest.approx(50 * step_s)


def test_past_every_running_request_the_queue_runs_whole_answers_first():
    s = _state(committed=300, drain=[(10, 1, 23)], running=1)
    step_s = slo.decode_ms(FIT, 1, 64) / 1000
    assert slo.slot_wait_s(s, FIT, slo.ahead_of(s, False), 64, 300) >= 10 * step_s + 300 * step_s


def test_the_outlook_gives_the_waiting_requests_mean_expected_answer():
    lengths = OutputLengths()
    rows = [wire.RequestLoad("a", "running", 1, 64, 100, max_tokens=300),
            wire.RequestLoad("b", "waiting", 0, 64, 0, max_tokens=16),
            wire.RequestLoad("c", "preempted", 0, 64, 10, max_tokens=58)]  # 48 left
    assert outlook(rows, lengths, block_size=16).waiting_output == 32
    assert outlook(rows[:1], lengths, block_size=16).waiting_output == 0


def test_a_queue_waits_for_the_answers_of_those_ahead_not_its_own():
    """Eight queued ahead of a full batch of two: they run the instance's waiting answers (16 tokens), not this
    request's max_tokens (128), once the running ones free their slots."""
    drain = [(10, 1, 8), (20, 2, 16)]
    s = _state(committed=16, drain=drain, running=2, batch=2, waiting=8, total=10_000)
    step_s = slo.decode_ms(FIT, 2, 128) / 1000
    short = replace(s, outlook=wire.Outlook(16, drain, [], waiting_output=16))
    # slots free at 10 and 20 steps, then each every 16: the 9th (8 ahead and this one) at 10 + 4 x 16 steps
    assert slo.slot_wait_s(short, FIT, slo.ahead_of(short, False), 64, 128) == pytest.approx(74 * step_s, rel=1e-6)
    unknown = slo.slot_wait_s(s, FIT, slo.ahead_of(s, False), 64, 128)  # (no waiting figure: its own answer)
    assert unknown == pytest.approx((10 + 4 * 128) * step_s, rel=1e-6)


def test_slots_free_at_staggered_times_not_in_whole_batches():
    """A batch of 4 whose requests finish after 1, 2, 3 and 100 steps, answers of 10 steps: the 4th slot comes at
    step 11 (the first slot's second answer), not after the last running request."""
    drain = [(1, 1, 0), (2, 2, 0), (3, 3, 0), (100, 4, 0)]
    assert slo.slots_free_s(drain, 0, 3, 1.0, 10.0) == pytest.approx(3.0)
    assert slo.slots_free_s(drain, 0, 4, 1.0, 10.0) == pytest.approx(11.0, rel=1e-6)
    assert slo.slots_free_s(drain, 0, 7, 1.0, 10.0) == pytest.approx(21.0, rel=1e-6)
    assert slo.slots_free_s(drain, 2, 2, 1.0, 10.0) == pytest.approx(2.0)  # free slots' first answers end at 10
    assert slo.slots_free_s([], 4, 5, 1.0, 10.0) == pytest.approx(20.0, rel=1e-6)  # idle: waves of the batch


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 400), st.integers(1, 5)), min_size=0, max_size=8), st.integers(0, 6),
       st.integers(1, 300), st.integers(1, 90))
def test_slots_free_at_the_need_th_of_every_slots_freeings(ranks, free, need, answer):
    """Against the freeings listed one by one: each running rank's requests at its time, then every answer_s."""
    drain, done = [], 0
    for remaining, count in sorted(ranks):
        done += count
        drain.append((remaining, done, 0))
    if not drain and not free:
        return
    step_s, answer_s = 0.01, answer * 0.01
    times = []
    prev = 0
    for remaining, d, _ in drain:
        times += [remaining * step_s + q * answer_s for _ in range(d - prev) for q in range(need + 1)]
        prev = d
    times += [answer_s + q * answer_s for _ in range(free) for q in range(need + 1)]
    assert slo.slots_free_s(drain, free, need, step_s, answer_s) == pytest.approx(sorted(times)[need - 1])


# ------------------------------------------------------------------ past the largest steps run


def test_a_model_fitted_one_request_at_a_time_does_not_call_a_large_batch_free():
    """A warm-up one request at a time cannot tell a step's fixed cost from its per-request cost; past the largest
    batch and prefill an instance has run, the predictions take no less per request or token than there."""
    fit = StepFit(4096)
    for k in range(40):
        fit.stepped(64, 0, 0, 0.036)  # 64-token prefills: 36 ms
        fit.stepped(0, 1, 80, 0.004)  # decodes of one request: 4 ms
    model = fit.fit()
    assert model.decode_seen == 1 and model.prefill_seen == 64
    assert slo.decode_ms(model, 128, 128 * 80) >= 128 * 4 * 0.95
    assert slo.prefill_step_ms(model, 4096) >= 4096 / 64 * 36 * 0.95
    assert slo.extrapolated(model, 4096, 1) and not slo.extrapolated(model, 64, 1)
    unbounded = msgspec.structs.replace(model, decode_seen=0, prefill_seen=0)  # (an instance that says nothing)
    assert slo.decode_ms(unbounded, 128, 128 * 80) < slo.decode_ms(model, 128, 128 * 80)


def test_a_step_of_a_few_tokens_bounds_as_if_it_were_a_step_of_64():
    """Prefills of 2 tokens at 20 ms are their fixed cost: a 25-token prompt is not bounded at 250 ms (the failure:
    an idle instance predicted 370 ms and refused a one-word request against a 400 ms target)."""
    model = msgspec.structs.replace(FIT, prefill_ms=20.0, prefill_ms_per_token=0.0, prefill_seen=2)
    assert slo.prefill_step_ms(model, 25) == pytest.approx(20.0)
    assert slo.prefill_step_ms(model, 640) == pytest.approx(200.0)  # past 64 tokens, the bound applies


def test_within_what_was_run_the_bound_changes_nothing():
    model = msgspec.structs.replace(FIT, decode_seen=64, prefill_seen=4096)
    assert slo.decode_ms(model, 32, 1000) == pytest.approx(15 + 0.15 * 32 + 0.0005 * 1000)
    assert slo.prefill_step_ms(model, 2048) == pytest.approx(10 + 0.1 * 2048)


# ------------------------------------------------------------------ every proxy's admissions


@pytest.fixture
def clients():
    made = []
    yield made
    for c in made:
        c.pull.close(0)
        c.manager.close(0)


def _beat() -> wire.Heartbeat:
    load = wire.InstanceLoad(blocks_total=100, blocks_used=0, running=0, waiting=0, batch_size=64, block_size=16,
                             latency=msgspec.structs.replace(FIT, finish_rate=1.0),
                             outlook=wire.Outlook(0, [], []))
    return wire.Heartbeat("a", "tcp://127.0.0.1:1001", True, load, True)


def _admitted(c: ClusterClient, n: int) -> int:
    """Admit and dispatch (as the proxy would) up to ``n`` requests of 64 prompt and 300 output tokens (23 blocks
    at their final length); how many were admitted."""
    got = 0
    for _ in range(n):
        try:
            c.admit(0, prompt_tokens=64, max_tokens=300)
        except Overloaded:
            continue
        c.view.sent_to("a", c.known.beats["a"].load, 64, 300)
        got += 1
    return got


def test_admissions_between_two_reports_count_at_once_and_for_every_proxy(clients):
    """Four requests' final KV fits in 100 blocks; the fifth would wait for a finish (a second at least). With
    two proxies each counts the other's admissions as many as its own, so the two together admit no more."""
    one = ClusterClient(load_config(None, ["slo.ttft_ms=500"]))
    clients.append(one)
    one.known.beats = {"a": _beat()}
    assert _admitted(one, 10) == 4
    two = ClusterClient(load_config(None, ["slo.ttft_ms=500"]))
    clients.append(two)
    two.known.beats = {"a": _beat()}
    two.known.proxies = 2
    assert _admitted(two, 10) == 2


# ------------------------------------------------------------------ a refusal does not wait for the body


def test_a_large_body_is_refused_before_it_is_read():
    """Admission checks a large body's best case (one token in, one out, the highest priority its caller may send)
    before reading it: a cluster that would refuse even that answers 429 at once; a small body is read first."""
    import asyncio

    from daemons.proxy.api.protocol import ApiError
    from daemons.proxy.front.call import Call
    from daemons.proxy.service import Proxy

    p = Proxy(load_config(None, ["slo.ttft_ms=500"]))
    try:
        load = wire.InstanceLoad(blocks_total=100, blocks_used=100, running=64, waiting=50, batch_size=64,
                                 block_size=16, latency=FIT, context_tokens=64 * 100,
                                 outlook=wire.Outlook(200, [(10_000, 64, 100)], []))
        p.cluster.known.beats = {"a": wire.Heartbeat("a", "tcp://127.0.0.1:1001", True, load, True)}
        reads = []

        async def body() -> bytes:
            reads.append(1)
            return b'{"model": "llumnix-sim", "prompt": [5, 6, 7], "max_tokens": 4}'

        from daemons.proxy.cluster.telemetry import M_REFUSAL

        def observed() -> float:
            return sum(s.value for m in M_REFUSAL.family.collect() for s in m.samples if s.name.endswith("_count"))

        for length, read in (("100000", False), ("60", True)):
            reads.clear()
            before = observed()
            with pytest.raises(ApiError) as refused:
                asyncio.run(p.handle(Call({"content-length": length}, None, None, body), chat=False))
            assert refused.value.status == 429 and refused.value.headers["Retry-After"]
            assert bool(reads) == read
            assert observed() == before + 1  # its time, in llumnix_proxy_refusal_seconds
    finally:
        p.cluster.pull.close(0)
        p.cluster.manager.close(0)


# ------------------------------------------------------------------ the prediction's error, as operators see it


def test_the_instance_judges_the_predicted_ttft_at_the_first_token_and_reports_its_error():
    """The proxy's predicted TTFT travels in the Submit; where the first token goes out, |predicted - actual| /
    actual joins the window that the load report (and so `llumnixctl status`) carries. A request with a prediction
    and no targets is not counted in the attainment."""
    from daemons.clock import Clock
    from daemons.instance.attainment import Attainment
    from daemons.requests import slo_mark
    from llumnixctl.statusview import _error

    class Fixed(Clock):
        def __init__(self):
            self.t = 1000.0

        def time(self) -> float:
            return self.t

        def monotonic(self) -> float:
            return self.t

    clock = Fixed()
    a = Attainment(60.0, clock)
    for predicted_ms, actual_s in ((500, 1.0), (900, 1.0), (1000, 1.0), (2000, 1.0)):
        mark = slo_mark(0, 0, clock.t - actual_s, predicted_ttft_ms=predicted_ms)
        a.token(mark, wire.TokenOut("r", 0, 5, "length"))
    p50, p90, n = a.errors.stats()
    assert (n, p50, p90) == (4, 0.5, 1.0)  # errors 0.5, 0.1, 0.0, 1.0
    assert a.counts() == (0, 0)
    assert slo_mark(0, 0, 1.0) is None  # nothing to judge
    assert _error({"ttft_error_judged": 4, "ttft_error_p50": 0.5, "ttft_error_p90": 1.0}) == "50%/100%"
    clock.t += 61
    assert a.errors.stats() == (0.0, 0.0, 0)
