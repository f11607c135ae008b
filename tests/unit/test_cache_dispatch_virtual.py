"""llumnix-cache dispatch on the harness (tests/support/cluster.py: real manager, 4 sim instances with
sim.prefix_caching, the proxy's cluster client, virtual time). The harness's prompts all start 100, 101, ...
so every request shares its leading blocks with every other: the hotspot case by construction.

- One request after another: llumnix-cache sends each where the first one left its prompt cached (and its
  prefill is skipped there), where llumnix spreads them over the idle instances.
- A burst of long requests: affinity gives way to balance; no instance runs more than 60% of them.
Every stream is checked token by token."""

from __future__ import annotations

from tests.support.cluster import VirtualCluster

SETS = ["sim.prefix_caching=true", "instance.min_step_s=0.02", "sim.num_blocks=512",
        "scheduling.migration_interval_s=0.2"]


def _sequential(dispatch_policy: str) -> tuple[list[str], int]:
    async def scenario(c: VirtualCluster):
        placed = []
        for _ in range(6):
            s = await c.request(max_tokens=20, prompt_tokens=256)
            placed.append(s.instance_id)
            assert [o.token_id for o in await c.result(s)] == c.expected(s, 20)
        return placed, sum(inst.engine.cache.hit_tokens for inst in c.instances.values())

    return VirtualCluster.run(scenario, instances=4, sets=SETS + [f"manager.dispatch_policy={dispatch_policy}"])


def test_one_request_after_another_goes_where_its_prefix_is_cached():
    placed, hit = _sequential("llumnix-cache")
    assert len(set(placed)) == 1, placed
    assert hit == 5 * 256 - 5  # every later request found the whole prompt cached but its last token
    blind, blind_hit = _sequential("llumnix")
    assert len(set(blind)) >= 2 and blind_hit < hit, (blind, blind_hit)


def test_a_burst_sharing_one_prefix_spreads_rather_than_piling_onto_the_warm_instance():
    async def scenario(c: VirtualCluster):
        first = await c.request(max_tokens=10, prompt_tokens=256)
        await c.result(first)  # its instance now caches the prefix
        streams = [await c.request(max_tokens=300, prompt_tokens=256 + 16 * k) for k in range(24)]
        peak = 0.0

        def share() -> bool:
            nonlocal peak
            running = [inst.engine.load().running for inst in c.instances.values()]
            if sum(running) >= 12:
                peak = max(peak, max(running) / sum(running))
            return all(s.done for s in streams)

        await c.until(share, 300, "the burst did not finish")
        for s in streams:
            assert [o.token_id for o in await c.result(s)] == c.expected(s, 300)
        hit = sum(inst.engine.cache.hit_tokens for inst in c.instances.values())
        return peak, hit

    peak, hit = VirtualCluster.run(scenario, instances=4, sets=SETS + ["manager.dispatch_policy=llumnix-cache"])
    assert peak <= 0.6, peak
    assert hit >= 256, hit  # the cache still served some of the burst
