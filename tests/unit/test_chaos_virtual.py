"""Chaos in one process on virtual time (tests/support/cluster.py): streamed requests arrive at seeded random
moments on three sim instances while, at seeded random moments, operators migrate requests and drain and
undrain instances, the manager balances, and one instance is killed (mid-copy, often: KV copies take virtual
seconds). Every request must end with exactly the sim's tokens, and once the load is over no live instance
may hold a request, a KV block or a migration. Each seed runs the same way every time; the real-daemon
version (tests/e2e/test_chaos.py) adds SIGKILL, a restarted manager and auto-scaling.

LLUMNIX_CHAOS_SEEDS=1,2,3 runs other seeds."""

from __future__ import annotations

import asyncio
import os
import random

import pytest

from daemons import wire
from tests.support.cluster import VirtualCluster

SEEDS = [int(s) for s in os.environ.get("LLUMNIX_CHAOS_SEEDS", "1,2,3,4,5,6").split(",") if s.strip()]
REQUESTS = 24
SPAN_S = 12.0


@pytest.mark.parametrize("seed", SEEDS)
def test_virtual_chaos_every_stream_is_exact(seed):
    rng = random.Random(seed)

    async def scenario(c: VirtualCluster):
        results: list[tuple[object, list[wire.TokenOut]]] = []
        moves: list[asyncio.Task] = []

        async def client(at: float, max_tokens: int, prompt_tokens: int) -> None:
            await asyncio.sleep(at)
            s = await c.request(max_tokens=max_tokens, prompt_tokens=prompt_tokens)
            results.append((s, await c.result(s, within_s=600)))

        clients = [asyncio.ensure_future(client(rng.uniform(0, SPAN_S), rng.randint(20, 400), rng.randint(8, 400)))
                   for _ in range(REQUESTS)]
        killed = False
        now = 0.0
        for at in sorted(rng.uniform(1, SPAN_S) for _ in range(10)):
            await asyncio.sleep(at - now)
            now = at
            live = sorted(c.instances)
            running = [s for s in c.proxy.streams.values() if not s.done and s.instance_id in c.instances]
            action = rng.choice(["migrate", "migrate", "migrate", "drain", "kill"])
            if action == "migrate" and running and len(live) > 1:
                s = rng.choice(running)
                dst = rng.choice([i for i in live if i != s.instance_id])
                moves.append(asyncio.ensure_future(c.migrate(s.request_id, dst)))
            elif action == "drain" and len(live) > 1:
                iid = rng.choice(live)
                c.manager.resched.lifecycle.on_drain(wire.DrainQuery(0, iid))
                asyncio.get_running_loop().call_later(rng.uniform(0.5, 3), lambda iid=iid: iid in c.instances and
                                                      c.manager.resched.lifecycle.on_drain(wire.DrainQuery(0, iid, drain=False)))
            elif action == "kill" and not killed and len(live) > 2:
                killed = True
                c.kill(rng.choice(live))
        await asyncio.gather(*clients)
        await asyncio.gather(*moves, return_exceptions=True)
        for s, out in results:
            assert s.error is None, (s.request_id, s.error)
            assert [o.token_id for o in out] == c.expected(s, len(out)) and len(out) == s.submit.sampling.max_tokens, \
                s.request_id
        assert len(results) == REQUESTS
        committed = sum(1 for m in moves if isinstance(m.result(), wire.MigrateReply)
                        for o in m.result().outcomes if o.outcome == "committed")
        failovers = sum(s.failovers for s, _ in results)
        print(f"seed {seed}: killed {killed}, {committed} of {len(moves)} operator moves committed, "
              f"{failovers} failovers, {sum(s.given_back for s, _ in results)} given back, "
              f"manager orders {dict(c.manager.resched.orders.outcomes)}")
        assert committed + c.manager.resched.orders.outcomes["drain/committed"] >= 1  # the chaos moved requests

        def idle() -> dict:
            return {iid: (len(i.requests), i.engine.load().blocks_used, i.migrator.busy)
                    for iid, i in c.instances.items()}

        await c.until(lambda: all(v == (0, 0, 0) for v in idle().values()), 30, f"not idle: {idle()}")

    VirtualCluster.run(scenario, instances=3, sets=["instance.min_step_s=0.025", "migration.timeout_s=3"],
                       kv_bytes_per_s=200_000.0)
