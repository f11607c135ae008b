"""SLO attainment on the instances (daemons/instance/attainment.py): the sliding window, the judgement of one
request, and requests judged where they finish, a migrated one with what its source measured (the real
instances, proxy client and manager on virtual time, tests/support/cluster.py)."""

from __future__ import annotations

from daemons import wire
from daemons.clock import Clock
from daemons.instance.attainment import Attainment, SloWindow, judge
from daemons.policy.slo import REFERENCE_PROMPT_TOKENS, reference_prediction
from daemons.requests import SloMark, slo_mark
from tests.support.cluster import VirtualCluster


class ManualClock(Clock):
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


def test_the_window_counts_the_judgements_of_its_last_seconds_only():
    clock = ManualClock()
    w = SloWindow(60.0, clock)
    assert w.counts() == (0, 0)
    w.add(True)
    clock.now += 30
    w.add(False)
    w.add(True)
    assert w.counts() == (2, 3)
    clock.now += 30  # the first is 60 s old: out
    assert w.counts() == (1, 2)
    clock.now += 29.9
    assert w.counts() == (1, 2)
    clock.now += 0.1
    assert w.counts() == (0, 0)


def test_a_request_meets_its_slo_only_when_both_targets_hold():
    mark = SloMark(ttft_s=1.0, tpot_s=0.1, arrival=100.0, first_time=100.9, first_index=0)
    assert judge(mark, 10, 100.9 + 10 * 0.099)  # TTFT 0.9 s, TPOT 99 ms
    assert not judge(mark, 10, 100.9 + 10 * 0.11)  # TPOT 110 ms
    late = SloMark(1.0, 0.1, 100.0, 101.5, 0)
    assert not judge(late, 10, 101.5 + 0.5)  # TTFT 1.5 s
    assert judge(SloMark(1.0, 0.1, 100.0, 100.5, 0), 0, 100.5)  # one token: no TPOT to judge
    assert judge(SloMark(0.0, 0.1, 100.0, 500.0, 0), 4, 500.2)  # no TTFT target: TTFT is not judged
    # A migrated request: TPOT over the tokens since its first, wherever they were made.
    assert judge(SloMark(1.0, 0.1, 100.0, 100.5, 0), 20, 100.5 + 20 * 0.09)
    assert slo_mark(0.0, 0.0, 5.0) is None and slo_mark(500.0, 0.0, 5.0) == SloMark(0.5, 0.0, 5.0)


def test_attainment_takes_the_first_token_time_and_judges_at_the_finish_not_an_abort():
    clock = ManualClock()
    a = Attainment(60.0, clock)
    arrival = clock.now
    ok, slow, aborted = (SloMark(1.0, 0.05, arrival) for _ in range(3))
    clock.now += 0.5
    for mark, rid in ((ok, "ok"), (slow, "slow"), (aborted, "ab")):
        a.token(mark, wire.TokenOut(rid, 0, 7))
    assert ok.first_time == arrival + 0.5 and a.counts() == (0, 0)
    clock.now += 0.04 * 4
    a.token(ok, wire.TokenOut("ok", 4, 7, "length"))  # 40 ms per token
    a.token(aborted, wire.TokenOut("ab", 4, 7, "abort"))
    clock.now += 1.0
    a.token(slow, wire.TokenOut("slow", 4, 7, "stop"))
    assert a.counts() == (1, 2)


def test_requests_are_judged_where_they_finish_a_migrated_one_with_what_its_source_measured():
    async def scenario(c: VirtualCluster):
        def submit(rid: str, ttft_ms: float, tpot_ms: float, tokens: int) -> wire.Submit:
            return wire.Submit(rid, list(range(100, 132)), wire.SamplingParams(max_tokens=tokens, ignore_eos=True),
                               c.proxy.token_address, arrival_time=c.clock.time(), slo_ttft_ms=ttft_ms,
                               slo_tpot_ms=tpot_ms)

        moved = await c.proxy.submit(submit("moved", 60_000, 10_000, 60), "", 1.0)
        await c.tokens(moved, 5)
        src = c.holders("moved")[0]
        dst = "i1" if src == "i0" else "i0"
        outcome = (await c.migrate("moved", dst)).outcomes[0]
        assert outcome.outcome == "committed", outcome
        await c.result(moved)
        # Its source kept nothing of it; the destination judged it with the targets and first token it carried.
        assert c.instances[src].attainment.counts() == (0, 0)
        assert c.instances[dst].attainment.counts() == (1, 1)
        # A TPOT target no step meets, and a request without an SLO (not judged).
        missed = await c.proxy.submit(submit("missed", 60_000, 0.001, 8), "", 1.0)
        free = await c.proxy.submit(submit("free", 0, 0, 8), "", 1.0)
        await c.result(missed)
        await c.result(free)
        counts = [inst.attainment.counts() for inst in c.instances.values()]
        assert sum(m for m, _ in counts) == 1 and sum(j for _, j in counts) == 2
        # The load report carries the window's counts to the manager (llumnixctl status shows them).
        await c.until(lambda: sum(v.load.slo_judged for v in c.manager.snapshot(0).instances) == 2, 10,
                      "the manager did not see the judgements")
        view = next(v for v in c.manager.snapshot(0).instances if v.load.latency is not None)
        ttft, tpot = reference_prediction(view.instance_id, view.load)
        assert ttft > 0 and tpot > 0 and REFERENCE_PROMPT_TOKENS == 512
        # A minute later (virtual), the window is empty again.
        await c.until(lambda: sum(v.load.slo_judged for v in c.manager.snapshot(0).instances) == 0, 90,
                      "the judgements did not leave the window")

    VirtualCluster.run(scenario, instances=2, sets=["sim.max_num_seqs=4", "slo.window_s=60"])
