"""Dispatch is composed once (daemons/policy/dispatch.py ``place``: the pool, then the instance by the policy in force),
so every dispatcher chooses alike: for the same view of the cluster (the instances' loads, flags, roles, fitted
step-time models, what each caches of the request) and the same request, the manager's dispatch
(daemons/manager/dispatch.py), a proxy's own (daemons/proxy/cluster/dispatch.py over its view.py) and the
simulator's proxy (llumnixctl/experiments/sim/proxy.py) choose the same instance, whatever the policy, just after
start-up too (instances with no model yet beside fitted ones: slo.pooled). The tie rotation is each dispatcher's
own (a proxy's starts at its rank's point of the instances): pinned here to the turn, as the manager's is."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from daemons import policy, wire
from daemons.clock import VirtualTimeLoop
from daemons.config import load_config
from daemons.manager.dispatch import Dispatcher as ManagerDispatcher
from daemons.manager.records import InstanceRecord, Policies
from daemons.manager.view import ClusterView
from daemons.policy import slo
from daemons.proxy.cluster.admission import Placing
from daemons.proxy.cluster.dispatch import Changes
from daemons.proxy.cluster.dispatch import Dispatcher as ProxyDispatcher
from daemons.proxy.cluster.known import KnownInstances
from daemons.proxy.cluster.shared import Shared
from daemons.proxy.cluster.stream import Stream
from daemons.proxy.cluster.view import DispatchView
from llumnixctl.experiments.sim.proxy import SimProxy


class Index:
    """A prefix index that knows one request: its cached leading blocks per instance."""

    def __init__(self, hits: dict[str, int]):
        self.hits = hits
        self.index = self  # (the proxy's Follower holds its index as ``index``)

    def __len__(self) -> int:
        return len(self.hits)

    def match(self, keys) -> dict[str, int]:
        return dict(self.hits)

    @property
    def host(self) -> dict:
        return {}  # (no host tier: the Follower's second index)

    def match_tiers(self, keys, among=None) -> dict[str, tuple[int, int]]:
        return {iid: (n, n) for iid, n in self.hits.items()}


fits = st.one_of(st.none(), st.builds(
    lambda steps, pt, dm, dps, rate: wire.LatencyFit(steps, 5.0, pt, dm, dps, 0.001, 1.0, 2048, rate),
    st.integers(0, 3), st.floats(0.001, 0.5), st.floats(1.0, 20.0), st.floats(0.0, 2.0), st.floats(0.0, 20.0)))
instances = st.builds(
    lambda used, running, waiting, tokens, hol, high, fit, role, flag: (
        wire.InstanceLoad(blocks_total=128, blocks_used=used, running=running, waiting=waiting, batch_size=8,
                          block_size=16, hol_demand_blocks=hol, high_priority=min(high, running),
                          waiting_tokens=tokens * waiting, context_tokens=used * 16, latency=fit, role=role), flag),
    st.integers(0, 128), st.integers(0, 8), st.integers(0, 4), st.integers(1, 2000), st.integers(0, 16),
    st.integers(0, 2), fits, st.sampled_from(["mixed", "mixed", "prefill", "decode"]),
    st.sampled_from(["", "", "", "draining", "cordoned"]))
clusters = st.lists(instances, min_size=1, max_size=6)


def _config(name: str, ttft_ms: float, tpot_ms: float):
    return load_config(None, [f"manager.dispatch_policy={name}", f"slo.ttft_ms={ttft_ms}", f"slo.tpot_ms={tpot_ms}",
                              "scheduling.high_priority_headroom=0.1", "scheduling.cache_min_freeness=1.0"])


def _manager(cfg, cluster, hits, clock):
    view = ClusterView(cfg.scheduling, clock)
    for k, (load, flag) in enumerate(cluster):
        iid = f"i{k}"
        r = InstanceRecord(info=wire.Register(iid, "h", 1, f"inproc://{iid}", "sim", "m", load), identity=iid.encode(),
                           load=load, last_seen=0.0)
        view.put(r, 0.0)
        if flag:
            view.set_flags(r, drain_reason="operator" if flag == "draining" else None, cordoned=flag == "cordoned")
    policies = Policies(cfg)
    return view, ManagerDispatcher(view, policies, Index(hits), clock, cfg.manager, policy.rules_of(cfg),
                                   slo.Classes(cfg.slo))


def _snapshot(cfg, view: ClusterView) -> wire.Snapshot:
    return wire.Snapshot(0, view.view(0.0), dispatch_policy=cfg.manager.dispatch_policy)


def _proxy(cfg, snap, hits, clock) -> ProxyDispatcher:
    known = KnownInstances(clock, cfg.proxy.instance_timeout_s, cfg.proxy.snapshot_interval_s, lambda _: "unknown")
    known.took_snapshot(snap)
    known.tie_start = lambda: None  # the manager's tie rotation: by the turn
    dview = DispatchView(cfg.manager.pending_dispatch_ttl_s, policy.rules_of(cfg), clock.monotonic)
    return ProxyDispatcher(Shared(cfg, clock, known, dview, port=None), Index(hits), manager=None, placing=Placing(),
                           changes=Changes(), on_full=lambda *a: None)


@settings(max_examples=250, deadline=None)
@given(clusters, st.sampled_from(policy.DISPATCH.names), st.sampled_from([0, 1]), st.integers(1, 4000),
       st.dictionaries(st.sampled_from([f"i{k}" for k in range(6)]), st.integers(1, 100), max_size=3),
       st.integers(0, 50), st.sampled_from([0.0, 200.0, 2000.0]), st.sampled_from([0.0, 30.0, 100.0]))
def test_the_manager_a_proxy_and_the_simulator_choose_alike(cluster, name, priority, tokens, hits, turn, ttft_ms,
                                                           tpot_ms):
    cfg = _config(name, ttft_ms, tpot_ms)
    clock = VirtualTimeLoop().clock()
    view, manager = _manager(cfg, cluster, hits, clock)
    manager.turn = turn
    msg = wire.Dispatch(1, "r", tokens, priority, prefix_keys=[1])
    by_manager = manager.on_dispatch_batch([msg])[0].instance_id or None

    snap = _snapshot(cfg, view)
    proxy = _proxy(cfg, snap, hits, clock)
    proxy._turn = turn - 1  # (it advances its turn before it chooses)
    stream = Stream("r", wire.Submit("r", list(range(tokens)), wire.SamplingParams(), "tcp://p:1", priority),
                    slo_=slo.Classes(cfg.slo).of(priority))
    stream.prefix_keys = [1]
    by_proxy = proxy._choose_here(stream)
    assert by_proxy == by_manager

    if not hits:  # the simulator's proxy has no prefix index of its own
        sim = SimProxy(cfg, clock)
        sim.on_snapshot(snap)
        sim.known.tie_start = lambda: None
        sim.turn = turn - 1
        assert sim.choose(priority, (), tokens) == by_manager
