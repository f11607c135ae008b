"""Serving to an SLO on the harness (tests/support/cluster.py: real manager, sim instances and the proxy's cluster
client, virtual time). The instances learn their step times from their own steps; the proxy admits by the TTFT
they predict.

- Overload with a TTFT target: refused requests get a Retry-After from the predicted drain; admitted ones meet the
  target; once the arrivals stop, a request sent after its Retry-After is admitted.
- Displacement: high-priority requests that jump the queue push queued normal requests past their give-up time:
  those get 429 and leave the instance, nothing streamed; every request that started streams to its end.
"""

from __future__ import annotations

import asyncio

from daemons.proxy.cluster.client import Overloaded
from tests.support.cluster import VirtualCluster

SETS = ["sim.max_num_seqs=8", "sim.num_blocks=512", "sim.eos_rate=0"]
PROMPT, OUT = 64, 64


async def _warm(c: VirtualCluster) -> None:
    """A few requests on every instance, so that each has a step-time model and a finish rate."""
    streams = [await c.request(max_tokens=16 + 4 * k, prompt_tokens=PROMPT) for k in range(12)]
    for s in streams:
        await c.result(s)
    await c.until(lambda: all(b.load is not None and b.load.latency is not None for b in c.proxy.known.beats.values()),
                  5, "the instances did not report a step-time model")


def test_overload_is_refused_with_the_predicted_drain_and_the_admitted_meet_the_target():
    target = 1.0

    async def scenario(c: VirtualCluster):
        await _warm(c)
        ttfts, refusals = [], []

        async def one(at: float):
            await asyncio.sleep(at)
            rid = f"burst-{at:.4f}"
            try:
                verdict = c.proxy.admit(0, prompt_tokens=PROMPT, max_tokens=OUT, request_id=rid)
            except Overloaded as exc:
                refusals.append((c.loop.time(), exc.retry_after_s, exc.reason))
                return
            arrived = c.loop.time()
            # As the front end (daemons/proxy/service.py): admitted, it counts at once (until its dispatch), and it
            # is placed among the instances admission found fit.
            stream = await c.request(max_tokens=OUT, prompt_tokens=PROMPT, fits=verdict.fits, request_id=rid)
            first = await asyncio.wait_for(stream.take(), 60)
            ttfts.append(c.loop.time() - arrived)
            rest = await c.result(stream, within_s=120)
            assert [o.token_id for o in first + rest] == c.expected(stream, OUT), stream.request_id

        rate, duration = 60.0, 8.0  # about 4x what 2 instances of 8 slots serve at 64 tokens a request
        await asyncio.gather(*(one(k / rate) for k in range(int(rate * duration))))
        assert refusals and all(reason == "ttft" and after >= 1.0 for _, after, reason in refusals)
        assert ttfts and len(refusals) > len(ttfts)  # most of a 4x overload is refused
        late = [t for t in ttfts if t > target]
        assert len(late) <= 0.02 * len(ttfts), f"{len(late)} of {len(ttfts)} admitted missed the {target} s target"
        # The arrivals stopped: the last refusal's Retry-After is when the cluster takes a request again
        last_at, after, _ = refusals[-1]
        await asyncio.sleep(max(last_at + after * 1.1 - c.loop.time(), 0))
        assert c.proxy.admit(0, prompt_tokens=PROMPT).admitted
        print(f"admitted {len(ttfts)}, refused {len(refusals)}; admitted TTFT max {max(ttfts):.2f} s "
              f"(target {target} s); last Retry-After {after:.1f} s")

    VirtualCluster.run(scenario, sets=SETS + [f"slo.ttft_ms={target * 1000:g}"])


def _displacement(high: bool) -> dict:
    """One instance of 4 slots running 4 requests that end one after another; two normal requests queue behind
    them, giving up after 1.2 s with no token. ``high``: two high-priority requests arrive meanwhile and take
    the first slots that free up."""
    async def scenario(c: VirtualCluster):
        await _warm(c)
        running = [await c.request(max_tokens=40 + 30 * k, prompt_tokens=16) for k in range(4)]
        await c.until(lambda: all(s.next_index for s in running), 5, "the batch did not start")
        normal = [await c.request(max_tokens=OUT, prompt_tokens=16, give_up_s=1.2) for _ in range(2)]
        highs = [await c.request(max_tokens=OUT, prompt_tokens=16, priority=1) for _ in range(2)] if high else []
        out = {}
        for s in running + highs:
            got = await c.result(s, within_s=60)
            assert [o.token_id for o in got] == c.expected(s, len(got)) and len(got) == s.submit.sampling.max_tokens
        for s in normal:
            got = await c.result(s, within_s=60)
            out[s.request_id] = (s.status, len(got), c.holders(s.request_id))
        return out

    return VirtualCluster.run(scenario, instances=1, sets=SETS[1:] + ["sim.max_num_seqs=4"])


def test_high_priority_displaces_queued_normal_requests_with_a_429_never_a_broken_stream():
    alone = _displacement(high=False)
    assert all(status == 200 and n == OUT for status, n, _ in alone.values()), alone
    displaced = _displacement(high=True)
    # both waited past their give-up time behind the high-priority requests: 429, no token sent, gone from the instance
    assert all(status == 429 and n == 0 and not held for status, n, held in displaced.values()), displaced
