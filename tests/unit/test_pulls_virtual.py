"""Prefix pulls on the harness (tests/support/cluster.py: real instances with sim engines and their host tiers, the
migrator's pulls over the in-memory KV transport, virtual time): a prompt cached on i0 is pulled by i1 for a request
placed there with ``pull_from``; its prefix is then served there as pulled tokens, its output is the unpulled one.
Failures (the holder killed mid-pull, a holder that holds nothing, a timeout) only mean a recompute: the request
completes, and nothing stays held on either side."""

from __future__ import annotations

from daemons.migration.telemetry import M_PULLS, OUTCOMES
from tests.support.cluster import VirtualCluster

SETS = ["sim.prefix_caching=true", "instance.min_step_s=0.02", "sim.num_blocks=512", "kv_tier.host_mb=1",
        "manager.dispatch_policy=llumnix"]
PROMPT = 256  # 16 blocks of 16


def place(c: VirtualCluster, on: str, pull_from: str = "", blocks: int = 0) -> None:
    """The proxy's next placements go to ``on``, with a pull of ``blocks`` from ``pull_from`` (as session dispatch
    orders one)."""
    d = c.proxy.dispatcher

    async def placed(stream):
        stream.pull = (pull_from, blocks)
        return on, d.known.address(on)

    d._place = placed


def outcomes() -> dict[str, float]:
    return {o: M_PULLS.labels(o)._value.get() for o in OUTCOMES}


def counted(before: dict[str, float]) -> dict[str, float]:
    """The pulls' outcomes since ``before``."""
    return {o: n - before[o] for o, n in outcomes().items() if n != before[o]}


def sources(c: VirtualCluster, iid: str) -> dict[str, int]:
    return dict(c.instances[iid].engine.cache.by_source)


def idle(c: VirtualCluster) -> bool:
    """Nothing held anywhere: no pull held, asked, served or in flight; no request in any engine."""
    for inst in c.instances.values():
        p = inst.migrator.pulls
        if p.held or p._offers or p._asked or p.serving or inst.engine.has_work():
            return False
        if inst.engine.load().blocks_used or inst.migrator.busy:
            return False
    return True


async def warm(c: VirtualCluster) -> list[int]:
    """A request on i0 that leaves its prompt cached there; its tokens."""
    place(c, "i0")
    s = await c.request(max_tokens=8, prompt_tokens=PROMPT, request_id="warm")
    return [o.token_id for o in await c.result(s)]


def test_a_prefix_cached_on_one_instance_is_pulled_by_another_and_served_from_it():
    async def scenario(c: VirtualCluster):
        await warm(c)
        place(c, "i1", "i0", PROMPT // 16)
        s = await c.request(max_tokens=8, prompt_tokens=PROMPT, request_id="turn")
        out = [o.token_id for o in await c.result(s)]
        assert s.instance_id == "i1"
        assert out == c.expected(s, 8)
        await c.until(lambda: idle(c), 5, "something stayed held")
        i1 = c.instances["i1"]  # its reports carry its blocks' bytes (what pricing a pull reads)
        assert i1.reporter.current_load().block_nbytes == i1.engine.tier.block_nbytes > 0
        return sources(c, "i1")

    before = outcomes()
    got = VirtualCluster.run(scenario, instances=2, sets=SETS)
    assert counted(before) == {"pulled": 1}
    assert got["pulled"] == PROMPT - 1, got  # every leading block but the last token's, which is recomputed
    assert got["recomputed"] == 1 and got["engine"] == 0 and got["host"] == 0, got


def test_without_a_pull_the_prefix_is_recomputed():
    async def scenario(c: VirtualCluster):
        await warm(c)
        place(c, "i1")
        s = await c.request(max_tokens=8, prompt_tokens=PROMPT, request_id="turn")
        assert [o.token_id for o in await c.result(s)] == c.expected(s, 8)
        return sources(c, "i1")

    got = VirtualCluster.run(scenario, instances=2, sets=SETS)
    assert got["pulled"] == 0 and got["recomputed"] == PROMPT, got


def _failed(scenario_mid, outcomes_: tuple[str, ...], sets=(), kv_bytes_per_s: float = 0.0):
    """A pull that fails (``scenario_mid(c)`` makes it fail after the request was sent): the request completes on
    i1 with its prefix recomputed, and nothing stays held."""
    async def scenario(c: VirtualCluster):
        await warm(c)
        place(c, "i1", "i0", PROMPT // 16)
        s = await c.request(max_tokens=8, prompt_tokens=PROMPT, request_id="turn")
        await scenario_mid(c)
        out = [o.token_id for o in await c.result(s)]
        assert out == c.expected(s, 8)
        assert s.instance_id == "i1"
        await c.until(lambda: idle(c), 30, "something stayed held")
        return sources(c, "i1")

    before = outcomes()
    got = VirtualCluster.run(scenario, instances=2, sets=SETS + list(sets), kv_bytes_per_s=kv_bytes_per_s)
    got_outcomes = counted(before)
    assert len(got_outcomes) == 1 and got_outcomes.get(next(iter(got_outcomes))) == 1, got_outcomes
    assert next(iter(got_outcomes)) in outcomes_, got_outcomes
    assert got["pulled"] == 0 and got["recomputed"] == PROMPT, got


def test_a_holder_that_holds_nothing_means_a_recompute():
    async def scenario(c: VirtualCluster):
        await warm(c)
        c.instances["i0"].engine.cache.clear()  # (its cache and tier lose the prompt)
        place(c, "i1", "i0", PROMPT // 16)
        s = await c.request(max_tokens=8, prompt_tokens=PROMPT, request_id="turn")
        assert [o.token_id for o in await c.result(s)] == c.expected(s, 8)
        await c.until(lambda: idle(c), 5, "something stayed held")
        return sources(c, "i1")

    before = outcomes()
    got = VirtualCluster.run(scenario, instances=2, sets=SETS)
    assert counted(before) == {"none_held": 1}
    assert got["pulled"] == 0 and got["recomputed"] == PROMPT, got


def test_the_holder_killed_mid_pull_means_a_recompute():
    async def kill(c: VirtualCluster):
        await c.until(lambda: c.instances["i0"].migrator.pulls.serving, 5, "the holder did not start sending")
        c.kill("i0")

    # a slow link: the copy is still under way when the holder dies
    _failed(kill, ("failed", "holder_dead"), kv_bytes_per_s=1e5)  # (its transfer breaks, or it is declared dead)


def test_a_pull_past_its_timeout_means_a_recompute():
    async def slow(c: VirtualCluster):
        pass

    _failed(slow, ("timeout",), sets=["kv_tier.pull_timeout_s=0.5"], kv_bytes_per_s=1e5)


def test_a_pull_given_up_before_its_offer_came_leaves_the_pair_in_step():
    """The holder answers a pull late, after the asker gave up on it (a timeout): the asker still takes that
    transfer's bytes (and drops them), so the next pull's receive meets its own send. Skipping it put every later
    transfer on the pair one behind: over Gloo a receive met a larger send and the process aborted."""
    import asyncio

    from daemons import wire

    async def scenario(c: VirtualCluster):
        token = c.proxy.token_address
        params = wire.SamplingParams(max_tokens=4, ignore_eos=True)
        first, second = list(range(1000, 1000 + PROMPT)), list(range(3000, 3000 + PROMPT // 2))
        place(c, "i0")
        for rid, prompt in (("w1", first), ("w2", second)):  # both prompts cached on i0
            await c.result(await c.proxy.submit(wire.Submit(rid, prompt, params, token), "", 1.0, 0.0))
        holder = c.instances["i0"].migrator.pulls
        boundary, slowed = holder.boundary, []

        async def slow_once(fn):  # the holder's first export waits past the asker's timeout
            if not slowed:
                slowed.append(False)
                await asyncio.sleep(1.0)
                slowed[0] = True  # (its offer goes out now)
            return await boundary(fn)

        holder.boundary = slow_once
        place(c, "i1", "i0", PROMPT // 16)
        late = await c.proxy.submit(wire.Submit("late", first, params, token), "", 1.0, 0.0)
        await c.result(late)
        await c.until(lambda: slowed and slowed[0] and not holder.serving, 5,
                      "the late transfer did not complete (its bytes were not taken)")
        place(c, "i1", "i0", PROMPT // 32)
        s = await c.proxy.submit(wire.Submit("next", second, params, token), "", 1.0, 0.0)
        await c.result(s)
        await c.until(lambda: idle(c), 5, "something stayed held")
        return sources(c, "i1")

    before = outcomes()
    got = VirtualCluster.run(scenario, instances=2, sets=SETS + ["kv_tier.pull_timeout_s=0.5"])
    assert counted(before) == {"timeout": 1, "pulled": 1}
    assert got["pulled"] == PROMPT // 2 - 1, got


def test_blocks_received_in_time_are_used_and_counted_pulled_however_long_their_import_waits():
    """The timeout bounds the wait for the holder's blocks, not their import (a step boundary away on a busy
    instance): before, an import that waited past it counted the pull as a timeout while the request used its
    blocks (an e2e run under load saw 256 pulled tokens and no pull counted)."""
    import asyncio

    async def scenario(c: VirtualCluster):
        await warm(c)
        asker = c.instances["i1"].migrator.pulls
        boundary = asker.boundary

        async def slow_import(fn):  # the asker's import of the blocks waits past the timeout
            if getattr(fn, "__name__", "") == "<lambda>" and "import_blocks" in fn.__code__.co_names:
                await asyncio.sleep(1.0)
            return await boundary(fn)

        asker.boundary = slow_import
        place(c, "i1", "i0", PROMPT // 16)
        s = await c.request(max_tokens=8, prompt_tokens=PROMPT, request_id="turn")
        out = [o.token_id for o in await c.result(s)]
        assert out == c.expected(s, 8)
        await c.until(lambda: idle(c), 5, "something stayed held")
        return sources(c, "i1")

    before = outcomes()
    got = VirtualCluster.run(scenario, instances=2, sets=SETS + ["kv_tier.pull_timeout_s=0.5"])
    assert counted(before) == {"pulled": 1}
    assert got["pulled"] == PROMPT - 1, got
