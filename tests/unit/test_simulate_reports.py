"""``llumnixctl simulate``'s load reports: each simulated instance reports with the instance's own ``Reporter``
and ``Heartbeats`` (daemons/instance/reports.py), so the manager sees its ``current_load`` (migrating out and
in, as in a real cluster) and the proxy its heartbeats, each a report lag late (llumnixctl/experiments/sim/reports.py)."""

from __future__ import annotations

import asyncio

from daemons import wire
from daemons.clock import VirtualTimeLoop, run_virtual
from daemons.config import load_config
from daemons.instance.reports import Reporter
from daemons.manager import Manager
from llumnixctl.experiments.traces import gen as trace
from llumnixctl.experiments.sim.reports import ProxyLine
from llumnixctl.experiments.sim.simulate import Network, Simulation

PRESSURE = ["sim.num_blocks=300", "sim.max_num_seqs=32", "instance.log_level=warning"]


def _trace(n=300):
    return trace.generate(n, rate=24.0, arrival="gamma", cv=2.0, prompt=(16, 768), output=(16, 768), alpha=1.0, seed=3)


def test_the_manager_sees_the_instances_own_reports_with_their_migrations(monkeypatch):
    seen: list[tuple[float, wire.LoadReport]] = []
    beats: list[wire.Heartbeat] = []
    inner_report = Manager.on_report

    def on_report(self, ident, msg):
        seen.append((self.clock.monotonic(), msg))
        return inner_report(self, ident, msg)

    monkeypatch.setattr(Manager, "on_report", on_report)
    cfg = load_config(None, PRESSURE)
    sim = Simulation(cfg, 4, _trace(), Network(report_lag_s=0.005))
    inner_beat = sim.proxy.on_heartbeat
    monkeypatch.setattr(sim.proxy, "on_heartbeat", lambda beat: (beats.append(beat), inner_beat(beat)))
    res = sim.run()
    assert sum(v for k, v in res["migrations"].items() if k.endswith("/committed")) > 0
    assert all(type(i.reporter) is Reporter for i in sim.instances.values())
    loads = [m.load for _, m in seen]
    # The migrator's counts are in the reports, as the instance's current_load puts them there.
    assert any(ld.migrating_out > 0 for ld in loads) and any(ld.migrating_in > 0 for ld in loads)
    assert max(ld.migrations_committed for ld in loads) > 0
    # Each instance's reports are numbered in order, at most one per min interval (plus the lag's jitter: none here).
    by: dict[str, list[tuple[float, int]]] = {}
    for t, m in seen:
        by.setdefault(m.instance_id, []).append((t, m.seq))
    gap = cfg.instance.load_report_min_interval_s
    for rows in by.values():
        assert [s for _, s in rows] == list(range(1, len(rows) + 1))
        assert all(b[0] - a[0] >= gap - 1e-9 for a, b in zip(rows, rows[1:]))
        assert all(b[0] - a[0] <= cfg.manager.heartbeat_interval_s + gap + 1e-6 for a, b in zip(rows, rows[1:]))
    # The proxy hears the same loads, with the count of its Submits each instance took in.
    assert beats and max(b.taken for b in beats) > 0
    for iid in by:  # the count is monotonic, as the proxy's view needs it
        taken = [b.taken for b in beats if b.instance_id == iid]
        assert taken == sorted(taken)


def test_the_proxy_line_delivers_heartbeats_a_lag_later_with_the_proxys_count():
    class Site:
        def __init__(self, loop):
            self.loop = loop

        @property
        def now(self):
            return self.loop.time()

        def at(self, t, fn, *args):
            self.loop.call_at(t, fn, *args)

    class Proxy:
        def __init__(self, loop):
            self.loop, self.got = loop, []

        def on_heartbeat(self, beat):
            self.got.append((self.loop.time(), beat))

    async def main(loop: VirtualTimeLoop):
        proxy = Proxy(loop)
        line = ProxyLine("inproc://p", proxy, 0.25, Site(loop))
        assert set(line.links) == {"inproc://p"} and line.gone({"inproc://p"}) == []
        line.heartbeat(wire.Heartbeat("i0", "inproc://i0"), {"inproc://p": 3, "inproc://other": 9})
        line.heartbeat(wire.Heartbeat("i0", "inproc://i0"), {})
        await asyncio.sleep(1.0)
        none = ProxyLine("inproc://p", None, 0.25, Site(loop))
        none.heartbeat(wire.Heartbeat("i0", "inproc://i0"), {"inproc://p": 3})
        assert none.links == {}
        return proxy.got

    got = run_virtual(main)
    assert [(round(t, 9), b.taken) for t, b in got] == [(0.25, 3), (0.25, 0)]


def test_heartbeats_reach_the_proxy_between_reports():
    """An idle instance still beats: its Heartbeats part runs, every heartbeat period."""
    cfg = load_config(None, PRESSURE + ["manager.heartbeat_interval_s=0.1"])
    sim = Simulation(cfg, 2, _trace(5))
    beats: list[float] = []
    inner = sim.proxy.on_heartbeat
    sim.proxy.on_heartbeat = lambda beat: (beats.append(sim.now), inner(beat))
    sim.run(linger_s=2.0)
    last = max(beats)
    assert len([t for t in beats if last - 1.0 <= t <= last]) >= 2 * 9  # two instances, ~10 beats a second each
