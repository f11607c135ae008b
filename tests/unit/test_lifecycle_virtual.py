"""Instances and the manager coming and going, and the operator's verbs, on the harness (tests/support/cluster.py):
auto-scaling that launches an instance under load and retires one when idle, an instance told to stop
(SIGTERM) that drains before it exits, a manager that restarts under load, a migration of N requests from
an instance, and a request past its deadline. Real manager, sim instances and the proxy's cluster client on
virtual time: the same run on every machine, every stream checked token by token.

What these leave to the e2e tests (tests/e2e/test_e2e_scheduling.py, tests/e2e/test_e2e_failures.py): real processes
and signals, the launcher's shell command, the CLI and the HTTP answers."""

from __future__ import annotations

import asyncio

from daemons import wire
from daemons.config import load_config
from tests.support.cluster import VirtualCluster

PACED = ["instance.min_step_s=0.02", "scheduling.migration_interval_s=0.2"]


def ids(outs: list[wire.TokenOut]) -> list[int]:
    return [o.token_id for o in outs]


def serving(c: VirtualCluster) -> list[str]:
    return [v.instance_id for v in c.manager.view(c.clock.monotonic()) if v.state == "alive" and not v.draining]


def test_autoscaling_adds_under_load_and_retires_when_idle():
    async def scenario(c: VirtualCluster):
        counts: list[int] = []

        def count() -> int:
            counts.append(len(serving(c)))
            return counts[-1]

        streams = [await c.request(max_tokens=600, prompt_tokens=64) for _ in range(30)]
        await c.until(lambda: count() == 2, 30, "no instance was added under load")
        (added,) = [i for i in serving(c) if i != "i0"]
        assert added == "i1"  # the launch's id: the lowest index no instance uses
        for s in streams:
            assert ids(await c.result(s)) == c.expected(s, 600), s.request_id
        await c.until(lambda: count() == 1, 60, "no instance was retired when idle")
        r = c.manager.resched
        await c.until(lambda: r.scaling.scale_ins == 1, 30, "the scale-in did not finish")
        assert r.scaling.scale_outs == 1 and 1 <= min(counts) and max(counts) <= 2
        retired = next(i for i in ("i0", "i1") if i not in serving(c))
        await c.until(lambda: c.runs[retired].done(), 30, f"the retired instance {retired} did not stop")
        assert r.orders.outcomes.get("balance/committed", 0) >= 1  # the new instance was filled by migration too

    VirtualCluster.run(scenario, instances=1, sets=PACED + [
        "sim.num_blocks=256", "scaling.policy=llumnix", "scaling.min_instances=1", "scaling.max_instances=2",
        "scaling.scale_up_threshold=8", "scaling.scale_down_threshold=128", "scaling.sustain_s=1",
        "scaling.cooldown_s=2", "scaling.launcher=in process (tests/support/cluster.py)"])


def test_auto_scaling_never_retires_a_scale_in_protected_instance():
    async def scenario(c: VirtualCluster):
        for iid in ("i1", "i2"):
            await c.join(iid, "instance.scale_in_protected=true")
        # All idle and equally free: without protection the tie would go to the highest id (i2).
        assert [v.scale_in_protected for v in c.manager.view(c.clock.monotonic())] == [False, True, True]
        await c.until(lambda: c.runs["i0"].done(), 60, "the unprotected instance was not retired")
        assert serving(c) == ["i1", "i2"] and c.manager.resched.scaling.scale_ins == 1
        # Two serving, above min_instances = 1, but both protected: nothing more is retired.
        await asyncio.sleep(30)  # virtual time: many sustain and cooldown periods
        assert serving(c) == ["i1", "i2"] and c.manager.resched.scaling.scale_ins == 1

    VirtualCluster.run(scenario, instances=1, sets=PACED + [
        "scaling.policy=llumnix", "scaling.min_instances=1", "scaling.max_instances=3",
        "scaling.scale_up_threshold=8", "scaling.scale_down_threshold=128", "scaling.sustain_s=1", "scaling.cooldown_s=1"])


def test_a_failing_launch_is_reported_and_adds_nothing():
    async def scenario(c: VirtualCluster):
        async def exits_3(cmd: str, iid: str) -> int:
            return 3

        c.manager.resched.launcher.start = exits_3
        reply = await c.manager.resched.lifecycle.on_add(wire.AddQuery(1))
        assert isinstance(reply, wire.ErrorReply) and "exited with status 3" in reply.message, reply
        assert serving(c) == ["i0"]

    VirtualCluster.run(scenario, instances=1, sets=["scaling.launcher=exit 3"])


def test_an_operators_add_stays_within_max_instances():
    async def scenario(c: VirtualCluster):
        reply = await c.manager.resched.lifecycle.on_add(wire.AddQuery(1, count=2))
        assert isinstance(reply, wire.ErrorReply) and "would make 4 instances" in reply.message, reply
        assert "scaling.max_instances is 3" in reply.message and sorted(c.instances) == ["i0", "i1"]
        reply = await c.manager.resched.lifecycle.on_add(wire.AddQuery(2, count=1))
        assert isinstance(reply, wire.AddReply) and reply.instance_ids == ["i2"], reply
        reply = await c.manager.resched.lifecycle.on_add(wire.AddQuery(3, count=1))
        assert isinstance(reply, wire.ErrorReply) and "would make 4 instances (3 running or starting)" in reply.message

    VirtualCluster.run(scenario, instances=2, sets=["scaling.max_instances=3",
                                                    "scaling.launcher=in process (tests/support/cluster.py)"])


def test_an_instance_told_to_stop_drains_its_requests_out_before_it_exits():
    async def scenario(c: VirtualCluster):
        streams = [await c.request(max_tokens=500, prompt_tokens=48) for _ in range(18)]
        await c.until(lambda: all(inst.engine.load().running for inst in c.instances.values()), 5,
                      "the streams did not start on every instance")
        victim = c.instances["i2"]
        held = len(victim.requests)
        assert held >= 1
        start = c.loop.time()
        victim.stop.set()  # what SIGTERM does (runtime.install_stop_signals)
        await c.until(lambda: c.runs["i2"].done(), 60, "i2 did not exit")
        took = c.loop.time() - start
        for s in streams:
            assert ids(await c.result(s)) == c.expected(s, 500), s.request_id
        assert all(s.failovers == 0 for s in streams)  # moved, none failed over
        assert victim.migrator.committed >= held - victim.engine.load().waiting
        assert took < 5, f"the drain took {took:.1f} virtual s: its requests finished instead of migrating"

    VirtualCluster.run(scenario, instances=3, sets=PACED + ["sim.max_num_seqs=6", "instance.shutdown_grace_s=60"])


def test_a_manager_restarted_under_load_learns_the_cluster_again_and_no_stream_breaks():
    async def scenario(c: VirtualCluster):
        streams = [await c.request(max_tokens=400) for _ in range(6)]
        await c.until(lambda: all(s.next_index >= 5 for s in streams), 10, "the streams did not start")
        m = await c.restart_manager()
        await c.until(lambda: sorted(serving(c)) == ["i0", "i1"], 10, "the instances did not register again")
        assert sum(v.load.running for v in m.view(c.clock.monotonic())) == 6  # it knows what runs, from reports
        later = [await c.request(max_tokens=20) for _ in range(4)]  # dispatched by the new manager's view
        s = streams[0]
        dst = "i1" if s.instance_id == "i0" else "i0"
        reply = await c.migrate(s.request_id, dst)  # it orders migrations again
        assert [o.outcome for o in reply.outcomes] == ["committed"], reply
        for s in streams + later:
            assert ids(await c.result(s)) == c.expected(s, s.submit.sampling.max_tokens), s.request_id
        assert all(s.failovers == 0 for s in streams + later)

    VirtualCluster.run(scenario, sets=PACED)


def test_migrate_from_an_instance_moves_count_requests_and_each_stream_stays_exact():
    async def scenario(c: VirtualCluster):
        streams = [await c.request(max_tokens=300 + 10 * k) for k in range(5)]
        await c.until(lambda: c.instances["i0"].engine.load().running == 5, 5, "the streams did not start on i0")
        reply = await c.migrate("", "i1", src="i0", count=3)
        assert [o.outcome for o in reply.outcomes] == ["committed"] * 3, reply
        moved = sorted(o.request_id for o in reply.outcomes)
        assert len(set(moved)) == 3
        for s in streams:
            assert ids(await c.result(s)) == c.expected(s, s.submit.sampling.max_tokens), s.request_id
        assert sorted(s.request_id for s in streams if s.instance_id == "i1") == moved

    VirtualCluster.run(scenario, sets=PACED + ["manager.dispatch_policy=flood"])


def test_a_request_past_its_deadline_ends_with_504_and_is_aborted_on_its_instance():
    async def scenario(c: VirtualCluster):
        t0 = c.loop.time()
        s = await c.request(max_tokens=5000)
        quick = await c.request(max_tokens=20)
        assert ids(await c.result(quick)) == c.expected(quick, 20)  # a request within the deadline is untouched
        await c.until(lambda: s.done, 10, "the deadline did not end the stream")
        assert s.status == 504 and "proxy.request_timeout_s" in s.error, (s.status, s.error)
        assert 2.0 <= c.loop.time() - t0 < 4.0  # the deadline, and the proxy's check interval after it
        await c.until(lambda: not c.holders(s.request_id), 5, "the instance kept the request")
        assert all(inst.engine.load().blocks_used == 0 for inst in c.instances.values())

    VirtualCluster.run(scenario, sets=PACED + ["proxy.request_timeout_s=2"])


def test_the_requests_of_a_killed_proxy_are_aborted_as_orphans():
    async def scenario(c: VirtualCluster):
        streams = [await c.request(max_tokens=1000) for _ in range(2)]  # rr: one on each instance
        await c.until(lambda: all(s.next_index >= 5 for s in streams), 5, "the streams did not start")
        assert sorted(s.instance_id for s in streams) == ["i0", "i1"]
        c.kill_proxy()
        took = await c.until(lambda: not any(inst.requests for inst in c.instances.values()), 10,
                             "the instances kept the dead proxy's requests")
        # Not heard from for orphan_timeout_s, then the next heartbeat tick notices.
        assert 1.5 <= took <= 1.5 + 2 * 0.2, took
        assert all(inst.engine.load().blocks_used == 0 for inst in c.instances.values())

    VirtualCluster.run(scenario, sets=PACED + ["manager.dispatch_policy=rr", "instance.orphan_timeout_s=1.5"])


def test_a_hung_step_makes_the_instance_unhealthy_its_streams_fail_over_then_it_exits_with_status_3(caplog):
    """The watchdog judges on the instance's clock: a step that never ends makes the instance unhealthy after
    instance.step_timeout_s (its heartbeats say so), the proxy fails its stream over mid-stream to the other
    instance at once, and instance.hung_exit_s later the hung instance exits with status 3 (the stream had
    already moved: the exit costs nothing)."""
    async def scenario(c: VirtualCluster):
        s = await c.request(max_tokens=150)
        await c.tokens(s, 1)
        assert s.instance_id == "i0"
        await c.until(lambda: c.instances["i0"].stepper.steps == 29, 10, "i0 did not step up to its hang")
        hung = c.loop.time()
        moved = await c.until(lambda: s.instance_id == "i1", 10, "the stream did not fail over")
        assert "i0" not in c.exits  # it failed over while i0 still ran: because i0 said it is unhealthy
        assert c.instances["i0"].watchdog.stalled.startswith("an engine step has run for")
        await c.until(lambda: "i0" in c.exits, 10, "the hung instance did not exit")
        exited = c.loop.time() - hung
        assert ids(await c.result(s)) == c.expected(s, 150)  # every index once, in order
        assert c.exits == {"i0": 3} and s.failovers == 1
        # Unhealthy after step_timeout_s (1) at the watchdog's next look (every quarter of it); the instance's
        # next heartbeat says so (every 0.2 s) and the proxy's next check of its streams (every 0.2 s) fails the
        # stream over; the exit hung_exit_s (1) after the stall was seen.
        assert 1.0 <= moved <= 1.0 + 0.25 + 0.2 + 0.2 + 0.05, moved
        assert 2.0 <= exited <= 2.0 + 0.25 + 0.05, exited
        assert "failed over to us: continues at token" in caplog.text  # mid-stream on i1, not a retry
        await c.until(lambda: c.instances["i1"].engine.load().blocks_used == 0, 5, "i1 kept blocks")

    caplog.set_level("INFO", logger="llumnix")
    VirtualCluster.run(scenario, sets=PACED + ["instance.step_timeout_s=1", "instance.hung_exit_s=1",
                                               "manager.dispatch_policy=flood"], faults={"i0": "hang_step_after=30"})


def test_a_proxy_restarted_at_the_same_address_gets_the_old_proxys_streams_aborted():
    """The instances' tokens for requests the restarted proxy does not know are answered with aborts, long
    before instance.orphan_timeout_s (60 here) would have ended them: they do not decode for nobody."""
    async def scenario(c: VirtualCluster):
        streams = [await c.request(max_tokens=2000) for _ in range(2)]
        await c.until(lambda: all(s.next_index >= 3 for s in streams), 5, "the streams did not start")
        assert sorted(s.instance_id for s in streams) == ["i0", "i1"]
        await c.restart_proxy()
        took = await c.until(lambda: not any(inst.requests for inst in c.instances.values()), 10,
                             "the instances kept the old proxy's requests")
        assert took < 2, took  # its first snapshot names the instances, their next tokens get the aborts
        assert all(inst.engine.load().blocks_used == 0 for inst in c.instances.values())
        s = await c.request(max_tokens=20)  # and it serves
        assert ids(await c.result(s)) == c.expected(s, 20)

    VirtualCluster.run(scenario, sets=PACED + ["manager.dispatch_policy=rr", "instance.orphan_timeout_s=60"])


def test_a_second_instance_with_a_live_instances_id_waits_and_is_not_merged_into_it(caplog):
    """Two instances configured with the same id: the second is not taken for the first (its reports, its
    goodbye), the first serves on untouched; once the first is gone, the second registers under that id."""
    async def scenario(c: VirtualCluster):
        s = await c.request(max_tokens=300)
        await c.tokens(s, 5)
        original = c.manager.instances["i1"].info
        twin = c.add("twin", "instance.id=i1")  # its request socket at inproc://twin
        await c.until(lambda: "in use by a live instance" in caplog.text, 5, "the twin's registration was taken")
        await c.until(lambda: twin.reporter.seq >= 10, 10, "the twin did not report")
        rec = c.manager.instances["i1"]
        assert rec.info == original and rec.state == "alive"  # reports and all: still the first one's
        assert ids(await c.result(s)) == c.expected(s, 300)
        c.kill("i1")
        await c.until(lambda: c.manager.instances["i1"].info.request_address == "inproc://twin", 10,
                      "the twin did not take the id once the first instance was gone")
        assert caplog.text.count("in use by a live instance") == 1  # said once, not per heartbeat

    caplog.set_level("INFO", logger="llumnix")
    VirtualCluster.run(scenario, sets=PACED + ["manager.dispatch_policy=flood"])


def test_a_proxy_taken_for_gone_hears_why_its_requests_were_aborted_and_places_them_again():
    """A proxy that is alive but was not heard from for orphan_timeout_s (here: its heartbeat task stopped):
    the instance aborts its requests as orphans and tells it so, and the proxy fails each over at once
    rather than waiting for its stall timeout (60 s here)."""
    async def scenario(c: VirtualCluster):
        s = await c.request(max_tokens=2000)
        await c.tokens(s, 5)
        first = s.instance_id
        for task in c.proxy._tasks:
            if task.get_coro().__name__ == "_watch":
                task.cancel()  # no ProxyAlive any more; tokens still flow
        took = await c.until(lambda: s.failovers >= 1, 10, "the proxy did not hear of the orphan abort")
        assert took <= 1.5 + 0.2 + 0.1, took  # orphan_timeout_s, the instance's next heartbeat tick
        assert s.instance_id != first and first not in c.holders(s.request_id)

    VirtualCluster.run(scenario, sets=PACED + ["instance.orphan_timeout_s=1.5", "proxy.stall_timeout_s=60",
                                               "manager.dispatch_policy=rr"])


def test_departed_peers_are_forgotten_on_both_sides():
    """A proxy replaced by one at another address, and an instance that died: the instances drop their link
    to the old proxy (and stop heartbeating it) after orphan_timeout_s, though it held no request of theirs;
    the proxy closes its socket to the dead instance and forgets it once it is out of the manager's view and
    silent for FORGET_AFTER_S. Restarts on new ports do not grow any daemon."""
    from daemons.proxy.cluster.client import ClusterClient
    from daemons.proxy.cluster.failover import FORGET_AFTER_S

    async def scenario(c: VirtualCluster):
        old = c.proxy.token_address
        assert all(old in inst.proxies.links for inst in c.instances.values())
        c.kill_proxy()
        proxy = ClusterClient(load_config(None, c.sets + ["proxy.token_address=inproc://proxy-2"]), ctx=c.context(),
                              clock=c.clock)
        await proxy.start()
        c.proxy = proxy
        await c.until(lambda: len(proxy.alive()) == 2, 10, "the new proxy does not see the instances")
        took = await c.until(lambda: not any(old in inst.proxies.links for inst in c.instances.values()), 10,
                             "the instances kept their link to the old proxy")
        assert took <= 1.5 + 0.2 + 0.1, took
        assert all("inproc://proxy-2" in inst.proxies.links for inst in c.instances.values())
        c.kill("i1")
        assert "inproc://i1" in proxy.instances
        took = await c.until(lambda: "inproc://i1" not in proxy.instances and "i1" not in proxy.heard, 120,
                             "the proxy kept the dead instance")
        assert FORGET_AFTER_S <= took <= FORGET_AFTER_S + 2, took
        assert "inproc://i0" in proxy.instances and "i0" in proxy.heard
        s = await c.request(max_tokens=20)
        assert ids(await c.result(s)) == c.expected(s, 20)

    VirtualCluster.run(scenario, sets=PACED + ["instance.orphan_timeout_s=1.5", "manager.dead_instance_ttl_s=5"])


def test_a_request_its_instance_never_took_in_is_sent_again_after_the_stall_timeout():
    """A Submit lost on the way (or sent to an instance that restarted) leaves a queued request that no token
    will ever come for: the instance's heartbeats, which count the Submits it took in, fall short of what was
    sent; the request is sent again after proxy.stall_timeout_s instead of waiting out its deadline. Requests
    only queued on a saturated instance were taken in, and a copy sent again is ignored: each runs once."""
    from daemons.proxy.cluster.telemetry import M_RESENT

    async def scenario(c: VirtualCluster):
        dropped = []
        for inst in c.instances.values():
            take = inst.intake.take

            def dropping(frames, take=take, iid=inst.instance_id):
                msg = wire.decode(frames[-1]) if len(frames) == 2 else None
                if isinstance(msg, wire.Submit) and msg.request_id == "req-1" and not dropped:
                    dropped.append(iid)  # lost on the way: this instance never sees it
                    return
                take(frames)
            inst.intake.take = dropping
        before = M_RESENT.labels()._value.get()
        t0 = c.loop.time()
        lost = await c.request(max_tokens=20)
        queued = [await c.request(max_tokens=400) for _ in range(5)]  # 2 slots each: some wait their turn
        await c.until(lambda: M_RESENT.labels()._value.get() > before, 10, "the lost request was not sent again")
        assert 3.0 <= c.loop.time() - t0 < 3.5  # stall_timeout_s (3), then the next heartbeat
        got = await c.result(lost)
        assert ids(got) == c.expected(lost, 20), (lost.status, lost.error)
        assert dropped and lost.tried == dropped  # sent again where it was: not a failed attempt
        for s in queued:
            assert ids(await c.result(s)) == c.expected(s, 400)  # exact: no copy ran twice
            assert len(s.tried) == 1
        resent = M_RESENT.labels()._value.get() - before
        assert 1 <= resent <= 1 + len(queued)  # it, and those of ours queued with it on its instance then
        await c.until(lambda: all(i.engine.load().blocks_used == 0 for i in c.instances.values()), 5, "blocks leaked")

    VirtualCluster.run(scenario, sets=PACED + ["proxy.stall_timeout_s=3", "proxy.request_timeout_s=60",
                                               "sim.max_num_seqs=2"])
