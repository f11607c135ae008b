"""Virtual-usage scheduling on the harness (tests/support/cluster.py): load balancing, de-fragmentation and
priorities with the real manager, sim instances and the proxy's cluster client on virtual time. Each run is
the same run on every machine: the figures compared here (freeness spread, first-token waits, TPOT) are
virtual-time figures of the sim's step model, so a busy test machine cannot move them, and every stream is
checked token by token."""

from __future__ import annotations

import asyncio
import statistics

from daemons import wire
from tests.support.cluster import VirtualCluster


def ids(outs: list[wire.TokenOut]) -> list[int]:
    return [o.token_id for o in outs]


def serving(c: VirtualCluster) -> list[wire.InstanceView]:
    return [v for v in c.manager.view(c.clock.monotonic()) if v.state == "alive" and not v.draining]


def spread(c: VirtualCluster) -> float:
    """Freeness spread over the serving instances, relative to their mean."""
    fs = [v.freeness for v in serving(c)]
    return (max(fs) - min(fs)) / (sum(fs) / len(fs))


def running(c: VirtualCluster) -> dict[str, int]:
    return {iid: inst.engine.load().running for iid, inst in c.instances.items()}


class Timed:
    """A request's stream with the virtual times of its arrival, its first token and its end."""

    def __init__(self, c: VirtualCluster, **kw) -> None:
        self.c, self.kw = c, kw
        self.task = asyncio.ensure_future(self._run())

    async def _run(self):
        c = self.c
        self.arrived = c.loop.time()
        self.stream = await c.request(**self.kw)
        await c.tokens(self.stream, 1, within_s=120)
        self.first = c.loop.time()
        self.outs = await c.result(self.stream, within_s=600)
        self.end = c.loop.time()
        return self

    @property
    def ttft(self) -> float:
        return self.first - self.arrived

    @property
    def tpot(self) -> float:
        return (self.end - self.first) / max(len(self.outs) - 1, 1)

    def exact(self) -> bool:
        return ids(self.outs) == self.c.expected(self.stream, self.kw["max_tokens"])


PACED = ["instance.min_step_s=0.02", "scheduling.migration_interval_s=0.2"]


def test_flood_then_llumnix_equalizes_freeness():
    async def scenario(c: VirtualCluster):
        streams = [await c.request(max_tokens=500, prompt_tokens=64) for _ in range(24)]
        await c.until(lambda: running(c)["i0"] == 24, 5, "the 24 streams did not start on i0")
        await c.until(lambda: {v.instance_id: v.load.running for v in serving(c)}["i0"] == 24, 2,
                      "the manager's view did not show them")
        assert running(c) == {"i0": 24, "i1": 0, "i2": 0}
        assert spread(c) > 1.0
        await asyncio.sleep(1.0)
        assert c.manager.resched.orders.outcomes.get("balance/committed", 0) == 0  # flood never migrates to balance
        reply = c.manager.policies.change(wire.PolicyQuery(1, dispatch_policy="llumnix"))
        assert reply.dispatch_policy == "llumnix" and reply.migrating
        took = await c.until(lambda: spread(c) < 0.5, 30 * 0.2, "freeness not equalized within 30 intervals")
        assert all(n >= 4 for n in running(c).values()), running(c)
        for s in streams:
            assert ids(await c.result(s)) == c.expected(s, 500), s.request_id
        committed = c.manager.resched.orders.outcomes.get("balance/committed", 0)
        assert committed >= 8
        assert sum(inst.migrator.committed for inst in c.instances.values()) == committed
        print(f"balanced in {took:.2f} virtual s with {committed} migrations")

    VirtualCluster.run(scenario, instances=3, sets=PACED + [
        "manager.dispatch_policy=flood", "sim.num_blocks=512",
        # every instance may shed and take: balance until the imbalance stops falling
        "scheduling.migrate_out_threshold=inf", "scheduling.migrate_in_threshold=-inf"])


def _long_prompt_wait(dispatch: str) -> tuple[float, int]:
    """Two instances of 256 blocks, each running 6 requests of 17+ blocks; then a 2600-token prompt (163
    blocks) that fits neither instance's free blocks, though the cluster has room for it. Returns its wait for
    the first token (virtual s) and the balancing migrations committed."""
    async def scenario(c: VirtualCluster):
        load = [Timed(c, max_tokens=120, prompt_tokens=256) for _ in range(12)]
        await c.until(lambda: list(running(c).values()) == [6, 6], 5, "6 streams did not start on each instance")
        await c.until(lambda: [v.load.running for v in serving(c)] == [6, 6], 2, "the manager's view did not show them")
        free = [v.load.blocks_total - v.load.blocks_used for v in serving(c)]
        assert max(free) < 163 + 3 <= sum(free), free  # fits nowhere, though the cluster has the room
        long = Timed(c, max_tokens=8, prompt_tokens=2600)
        for t in await asyncio.gather(long.task, *(t.task for t in load)):
            assert t.exact(), t.stream.request_id
        return long.ttft, c.manager.resched.orders.outcomes.get("balance/committed", 0)

    return VirtualCluster.run(scenario, sets=PACED + [f"manager.dispatch_policy={dispatch}", "sim.num_blocks=256"])


def test_a_long_prompt_is_admitted_after_migrations_make_room():
    waited, moved = _long_prompt_wait("llumnix")
    baseline, baseline_moved = _long_prompt_wait("infaas++")
    print(f"long prompt's first token: llumnix {waited:.2f} s ({moved} migrations), infaas++ {baseline:.2f} s")
    assert moved >= 1 and baseline_moved == 0
    assert waited < 0.6 * baseline


def _priority_run(tag_high: bool) -> tuple[list[Timed], list[Timed], dict]:
    """40 normal requests over 3.2 s on 2 instances that queue (12 slots each) and decode slower with a bigger
    batch (2 ms per request in the batch), and 4 more requests, tagged high or not."""
    async def scenario(c: VirtualCluster):
        async def at(t: float, **kw) -> Timed:
            await asyncio.sleep(t)
            return await Timed(c, **kw).task

        normal = [at(i * 0.08, max_tokens=100) for i in range(40)]
        high = [at(0.6 + 0.5 * k, max_tokens=100, priority=1 if tag_high else 0) for k in range(4)]
        done = await asyncio.gather(*normal, *high)
        assert all(t.exact() for t in done)
        return done[:40], done[40:], dict(c.manager.resched.orders.outcomes)

    return VirtualCluster.run(scenario, sets=[
        "sim.time_scale=1", "sim.decode_ms=5", "sim.decode_ms_per_seq=2", "sim.max_num_seqs=12", "sim.num_blocks=512",
        "scheduling.migration_interval_s=0.2", "scheduling.high_priority_headroom=0.5"])


def test_high_priority_requests_get_lower_latency():
    normal, high, orders = _priority_run(True)
    _, untagged, _ = _priority_run(False)
    ttft = {k: statistics.mean(t.ttft for t in v) for k, v in (("normal", normal), ("high", high), ("untagged", untagged))}
    tpot = {k: statistics.mean(t.tpot for t in v) for k, v in (("normal", normal), ("high", high), ("untagged", untagged))}
    print("TTFT ms", {k: round(v * 1e3) for k, v in ttft.items()}, "TPOT ms", {k: round(v * 1e3, 1) for k, v in tpot.items()},
          "migrations", orders)
    assert ttft["high"] < 0.8 * ttft["normal"] and ttft["high"] < 0.8 * ttft["untagged"]  # queued ahead
    assert tpot["high"] < 0.9 * tpot["normal"] and tpot["high"] < 0.9 * tpot["untagged"]  # smaller batch
