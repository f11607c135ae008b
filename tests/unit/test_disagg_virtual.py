"""Prefill/decode disaggregation on the harness (tests/support/cluster.py: real manager, sim instances and the
proxy's cluster client, virtual time).

- Long prompts prefill on the prefill instance and are handed over, by live migration, to a decode instance at
  their first token; short ones prefill where they decode; every stream is the unmigrated one; nothing is left
  held anywhere.
- A role change under load moves what decodes on the instance by migration (reason "role"), never by abort.
- With no decode instance, prefill instances serve whole requests (no hang); a handover with no room keeps
  decoding where it is.
"""

from __future__ import annotations

import asyncio

from daemons import wire
from tests.support.cluster import VirtualCluster

SETS = ["sim.max_num_seqs=16", "sim.num_blocks=512", "sim.eos_rate=0", "disagg.min_uncached_tokens=256"]
LONG, SHORT, OUT = 600, 32, 40


async def _roles(c: VirtualCluster, *roles: str) -> None:
    for k, role in enumerate(roles):
        await c.join(f"i{k}", f"instance.role={role}")
    await _heard(c, sum(1 for r in roles if r != "mixed"))


async def _heard(c: VirtualCluster, n: int) -> None:
    await c.until(lambda: sum(1 for b in c.proxy.known.beats.values() if b.load is not None and b.load.role != "mixed")
                  == n, 5, "the proxy did not hear the roles")


def _outcomes(c: VirtualCluster) -> dict[str, int]:
    return dict(c.manager.resched.orders.outcomes)


def _held(c: VirtualCluster) -> dict[str, int]:
    return {iid: inst.engine.load().blocks_used for iid, inst in c.instances.items()}


def test_long_prompts_are_handed_over_at_their_first_token_and_stream_as_unmigrated():
    async def scenario(c: VirtualCluster):
        await _roles(c, "prefill", "decode", "decode")
        longs = [await c.request(max_tokens=OUT, prompt_tokens=LONG) for _ in range(6)]
        shorts = [await c.request(max_tokens=OUT, prompt_tokens=SHORT) for _ in range(4)]
        for s in longs:
            assert s.tried[0] == "i0", f"{s.request_id} (long) was not prefilled on the prefill instance: {s.tried}"
            assert s.disagg == "remote"
        for s in shorts:
            assert s.tried[0] in ("i1", "i2"), f"{s.request_id} (short) did not prefill where it decodes: {s.tried}"
            assert s.disagg == "local_short"
        for s in longs + shorts:
            got = await c.result(s)
            assert [o.token_id for o in got] == c.expected(s, OUT), s.request_id
        for s in longs:
            assert s.instance_id in ("i1", "i2"), f"{s.request_id} ended on {s.instance_id}, not a decode instance"
        await c.until(lambda: not any(_held(c).values()), 5, f"blocks left held: {_held(c)}")
        out = _outcomes(c)
        assert out.get("handover/committed") == len(longs), out
        assert not any(k.endswith("/aborted") or k.endswith("/lost") for k in out), out
        assert {s.instance_id for s in longs} == {"i1", "i2"}  # the destination is chosen per handover, by load
        print("outcomes", out)

    VirtualCluster.run(scenario, instances=0, sets=SETS)


def test_a_role_change_under_load_moves_the_decoding_requests_by_migration():
    async def scenario(c: VirtualCluster):
        await _roles(c, "mixed", "mixed")
        streams = [await c.request(max_tokens=120, prompt_tokens=SHORT) for _ in range(8)]
        await c.until(lambda: all(s.next_index >= 5 for s in streams), 10, "the batch did not start")
        on_i0 = [s for s in streams if s.instance_id == "i0"]
        assert on_i0, "nothing ran on i0"
        reply = c.manager.resched.roles.on_role(wire.RoleQuery(1, "i0", "prefill"))
        assert isinstance(reply, wire.RoleReply) and reply.previous == "mixed" and reply.role == "prefill"
        for s in streams:
            got = await c.result(s)
            assert [o.token_id for o in got] == c.expected(s, 120), s.request_id
        assert all(s.instance_id == "i1" for s in on_i0), [(s.request_id, s.instance_id) for s in on_i0]
        out = _outcomes(c)
        assert out.get("role/committed") == len(on_i0) and not any("aborted" in k for k in out), out
        await c.until(lambda: not any(_held(c).values()), 5, f"blocks left held: {_held(c)}")

    VirtualCluster.run(scenario, instances=0, sets=SETS)


def test_with_no_decode_instance_prefill_instances_serve_whole_requests():
    async def scenario(c: VirtualCluster):
        await _roles(c, "prefill", "prefill")
        streams = [await c.request(max_tokens=OUT, prompt_tokens=LONG) for _ in range(4)]
        for s in streams:
            got = await c.result(s, within_s=30)
            assert [o.token_id for o in got] == c.expected(s, OUT)
        assert not _outcomes(c)  # nowhere to hand over: nothing moved, nothing lost

    VirtualCluster.run(scenario, instances=0, sets=SETS)


def test_a_handover_with_no_room_keeps_decoding_at_the_prefill_instance():
    async def scenario(c: VirtualCluster):
        await c.join("i0", "instance.role=prefill")
        await c.join("i1", "instance.role=decode", "sim.num_blocks=8")  # too small for a 600-token prompt
        await _heard(c, 2)
        s = await c.request(max_tokens=OUT, prompt_tokens=LONG)
        got = await c.result(s)
        assert [o.token_id for o in got] == c.expected(s, OUT)
        assert s.instance_id == "i0" and not _outcomes(c)

    VirtualCluster.run(scenario, instances=0, sets=SETS)


def test_draining_the_last_decode_instance_moves_its_requests_to_the_prefill_one():
    async def scenario(c: VirtualCluster):
        await _roles(c, "prefill", "decode")
        streams = [await c.request(max_tokens=200, prompt_tokens=SHORT) for _ in range(3)]
        await c.until(lambda: all(s.next_index >= 3 for s in streams), 10, "the batch did not start")
        assert {s.instance_id for s in streams} == {"i1"}  # short prompts prefill where they decode
        c.manager.resched.lifecycle.on_drain(wire.DrainQuery(1, "i1"))
        for s in streams:
            got = await c.result(s)
            assert [o.token_id for o in got] == c.expected(s, 200)
            assert s.instance_id == "i0"  # no decode instance left: the prefill one serves whole requests
        out = _outcomes(c)
        assert out.get("drain/committed") == 3 and not any("aborted" in k for k in out), out

    VirtualCluster.run(scenario, instances=0, sets=SETS)


def test_adaptive_roles_give_a_ttft_bound_cluster_another_prefill_instance():
    """One prefill and two decode instances with targets: long prompts queue on the prefill instance (TTFT far over
    its target) while decoding has slack; after the imbalance has held adapt_sustain_s, one decode instance (the
    least loaded) becomes prefill, once; every stream is exact."""
    sets = SETS + ["slo.ttft_ms=300", "slo.tpot_ms=500", "disagg.adaptive=true", "disagg.adapt_interval_s=30",
                   "disagg.adapt_sustain_s=1", "disagg.prefill_busy_tokens=1000000"]

    async def scenario(c: VirtualCluster):
        await _roles(c, "prefill", "decode", "decode")
        warm = [await c.request(max_tokens=8, prompt_tokens=LONG) for _ in range(2)]
        for s in warm:
            await c.result(s)
        streams = [await c.request(max_tokens=OUT, prompt_tokens=1500) for _ in range(24)]
        await c.until(lambda: c.manager.resched.roles.memory.last_change is not None, 20, "no role changed")
        roles = {iid: inst.standing.role for iid, inst in c.instances.items()}
        assert sorted(roles.values()) == ["decode", "prefill", "prefill"], roles
        for s in streams:
            got = await c.result(s, within_s=300)
            assert [o.token_id for o in got] == c.expected(s, OUT)
        assert sorted(inst.standing.role for inst in c.instances.values()) == ["decode", "prefill", "prefill"]

    VirtualCluster.run(scenario, instances=0, sets=sets)


def test_a_scaled_out_instance_takes_the_role_that_is_short():
    async def scenario(c: VirtualCluster):
        await _roles(c, "prefill", "decode")
        reply = await c.manager.resched.lifecycle.on_add(wire.AddQuery(1, 1))
        assert isinstance(reply, wire.AddReply), reply
        (iid,) = reply.instance_ids
        await c.until(lambda: c.instances[iid].standing.role == "decode", 5, f"{iid} got no role")  # no targets: decode

    VirtualCluster.run(scenario, instances=0, sets=SETS + ["scaling.launcher=start {id}"])
