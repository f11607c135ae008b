"""Re-homing idle sessions on the harness (tests/support/cluster.py: the real manager, instances with sim engines,
host tiers and retention, the proxy's session dispatch, virtual time): a hot instance's idle session (retained after
its turn, none running) moves into the cool instance's host tier by the pull machinery; the hot one stops retaining
it; the prefix index shows it on the cool one's tier; the session's next turn goes there and finds its prefix there,
with no pull. The decision is a pure function (daemons/policy/rehome.py)."""

from __future__ import annotations

from daemons import prefix, wire
from daemons.migration.telemetry import M_PULLS, M_REHOMED
from daemons.policy.rehome import rehome_pairs
from daemons.policy.usage import InstanceState
from tests.support.cluster import VirtualCluster

SETS = ["sim.prefix_caching=true", "instance.min_step_s=0.02", "sim.num_blocks=512", "kv_tier.host_mb=1",
        "manager.dispatch_policy=llumnix-cache", "kv_tier.retain_s=60", "sessions.rehome_interval_s=0.5",
        "scheduling.migrate_out_threshold=508", "scheduling.migrate_in_threshold=510"]
PROMPT = list(range(2000, 2256))  # 16 blocks of 16
# (512 blocks: an idle instance is 512 free; one running a request, under 508: hot; over 510: cool)


async def turn(c: VirtualCluster, rid: str, session: str, prompt: list[int], max_tokens: int = 8, on: str = ""):
    params = wire.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return await c.proxy.submit(wire.Submit(rid, list(prompt), params, c.proxy.token_address, session=session),
                                fits=(on,) if on else ())


def test_a_hot_instances_idle_session_moves_to_the_cool_instances_tier_and_its_next_turn_follows():
    async def scenario(c: VirtualCluster):
        first = await turn(c, "t1", "chat-1", PROMPT)
        hot = first.instance_id
        cool = next(i for i in c.instances if i != hot)
        await c.result(first)
        src, dst = c.instances[hot].engine, c.instances[cool].engine
        hashes = prefix.block_hashes(PROMPT, 16)
        assert src.tier.retention.sessions() == 1
        # the hot one runs on: two long requests (its session's next turn would pass sessions.bound there)
        busy = [await turn(c, f"busy{k}", "", list(range(5000 + 50 * k, 5040 + 50 * k)), max_tokens=3000, on=hot)
                for k in range(2)]
        assert {b.instance_id for b in busy} == {hot}
        await c.until(lambda: all(h in dst.tier for h in hashes), 10, "the session did not reach the cool tier")
        await c.until(lambda: src.tier.retention.sessions() == 0, 5, "the hot instance still retains the session")
        assert dst.tier.retention.sessions() == 1
        keys = prefix.keys(hashes)
        await c.until(lambda: c.manager.cache_index.match_tiers(keys).get(cool, (0, 0))[1] == len(keys), 5,
                      "the index does not show the session on the cool instance's tier")
        pulls = {o: M_PULLS.labels(o)._value.get() for o in ("pulled",)}
        before = dict(dst.cache.by_source)
        nxt = await turn(c, "t2", "chat-1", PROMPT + [7, 8, 9])
        await c.result(nxt)
        assert nxt.instance_id == cool
        got = {k: v - before[k] for k, v in dst.cache.by_source.items()}
        assert M_PULLS.labels("pulled")._value.get() == pulls["pulled"]  # no pull at dispatch: it was there
        for b in busy:
            c.proxy.finish(b)
        return got

    rehomed = M_REHOMED.labels()._value.get()
    got = VirtualCluster.run(scenario, instances=2, sets=SETS)
    assert M_REHOMED.labels()._value.get() == rehomed + 1
    assert got["pulled"] + got["host"] == len(PROMPT) and got["recomputed"] == 3, got


def _state(iid: str, running: int, retained: int = 0, tier: int = 0, **kw) -> InstanceState:
    return InstanceState(iid, 100, blocks_used=running * 10, running=running, retained_blocks=retained,
                         tier_capacity=tier, **kw)


def test_rehome_pairs_the_hottest_holder_of_idle_sessions_with_the_coolest_instance_that_has_a_tier():
    states = [_state("a", 9, retained=20), _state("b", 5, retained=5, tier=50), _state("c", 1, tier=50),
              _state("d", 0), _state("e", 8, retained=0, tier=50)]
    # freeness: a (10/9) < e < b < c (90/1); d (no tier) is never a destination; e retains nothing
    pairs = rehome_pairs(states, 0.0, out_threshold=50.0, in_threshold=5.0, count=3)
    assert [(p.src, p.dst, p.count) for p in pairs] == [("a", "c", 3)]
    assert rehome_pairs(states, 0.0, 50.0, 5.0, count=0) == []
    cordoned = [s if s.instance_id != "c" else _state("c", 1, tier=50, cordoned=True) for s in states]
    assert [(p.src, p.dst) for p in rehome_pairs(cordoned, 0.0, 50.0, 5.0, 1)] == [("a", "b")]
