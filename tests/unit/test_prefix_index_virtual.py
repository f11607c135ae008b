"""The cluster's prefix index on the harness (tests/support/cluster.py: real manager, sim instances with
sim.prefix_caching, the proxy's cluster client, virtual time): every instance publishes what its cache
stores and removes; the proxy's and the manager's indexes say exactly what each instance's cache holds, and a
restarted proxy or manager learns it all again from the instances within a heartbeat."""

from __future__ import annotations

from daemons import prefix
from tests.support.cluster import VirtualCluster

SETS = ["sim.prefix_caching=true", "sim.num_blocks=64", "instance.min_step_s=0.02"]
BEAT = 0.2  # manager.heartbeat_interval_s of the harness


def agrees(c: VirtualCluster, follower: prefix.Follower) -> bool:
    """The follower's index holds, for every instance, exactly the keys its sim cache holds."""
    return all(set(follower.index._held.get(iid, ())) == set(inst.engine.cache.snapshot())
               for iid, inst in c.instances.items())


def test_proxy_and_manager_index_every_instances_cache_and_learn_it_again_after_a_restart():
    async def scenario(c: VirtualCluster):
        # The harness's prompts are 100, 101, ...: every request shares its leading blocks with the others.
        streams = [await c.request(max_tokens=30, prompt_tokens=64 + 8 * k) for k in range(6)]
        for s in streams:
            assert [o.token_id for o in await c.result(s)] == c.expected(s, 30)
        await c.until(lambda: agrees(c, c.proxy.cache_index) and agrees(c, c.manager.cache_index), 5,
                      "the indexes did not come to agree with the instances' caches")
        bs = c.cfg.sim.block_size
        keys = prefix.keys(prefix.block_hashes(list(range(100, 164)), bs))
        served = {iid for iid, inst in c.instances.items() if inst.engine.cache.hit_tokens or len(inst.engine.cache)}
        match = c.proxy.cache_index.index.match(keys)
        assert served and all(match[iid] == 64 // bs for iid in served), (match, served)
        assert c.manager.cache_index.index.match(keys) == match

        # More traffic, with evictions (64 blocks an instance): the indexes follow the removals too.
        more = [await c.request(max_tokens=40, prompt_tokens=200) for _ in range(8)]
        for s in more:
            await c.result(s)
        await c.until(lambda: agrees(c, c.proxy.cache_index) and agrees(c, c.manager.cache_index), 5,
                      "the indexes did not follow the evictions")

        # kill -9 and restart of the proxy, then of the manager: each asks every instance for its whole
        # cache at the instance's first heartbeat (report) and agrees again within about one heartbeat.
        before = {iid: set(inst.engine.cache.snapshot()) for iid, inst in c.instances.items()}
        proxy = await c.restart_proxy()
        assert len(proxy.cache_index.index) == 0
        took = await c.until(lambda: agrees(c, proxy.cache_index), 5, "the restarted proxy did not learn the caches")
        assert took <= 2 * BEAT, took
        manager = await c.restart_manager()
        took = await c.until(lambda: agrees(c, manager.cache_index) and len(manager.cache_index.index) > 0, 5,
                             "the restarted manager did not learn the caches")
        assert took <= 3 * BEAT, took  # (it first has the instances register again)
        assert {iid: set(inst.engine.cache.snapshot()) for iid, inst in c.instances.items()} == before

    VirtualCluster.run(scenario, sets=SETS)
