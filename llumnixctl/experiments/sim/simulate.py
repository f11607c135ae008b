"""``llumnixctl simulate``: a cluster in virtual time, on the daemons' own code.

A discrete-event simulation of N instances, the manager and the proxies' dispatch, on the virtual-time event
loop of ``daemons.clock`` (the one the in-process test harness runs the daemons on). Nothing here
re-implements a policy or a scheduler:

- each instance is the sim engine (``daemons/engine/sim.py``: blocks, continuous batching, chunked
  admission, preemption by recompute, priorities) without KV tensors, run by the instance daemon's own parts
  (sim/llumlet.py): its ``StepLoop`` and ``Mailbox`` (a step takes the model time the engine returns for it,
  its tokens come out at its end, engine calls wait for its boundary), ``Intake``, ``TokenPath``,
  ``Handovers``, migration ``Orders`` and ``Control``;
- the manager is a real ``daemons.manager.Manager`` given the virtual clock (``daemons.clock``) and, for its
  socket, the simulation's (sim/llumlet.py ``ManagerWire``): it takes the instances' registrations and
  messages (load reports, handover offers, migration results) through its own handlers, answers dispatches
  (``on_dispatch_batch``, pending dispatches counted as in the daemon), runs its own pairing loop every
  ``scheduling.migration_interval_s`` and its ``Roles`` (handovers, adaptive roles); its orders reach each
  instance's ``Control`` a message later;
- each instance reports with the instance's own ``Reporter`` and ``Heartbeats`` (daemons/instance/reports.py:
  on change, at most every ``instance.load_report_min_interval_s``, and every heartbeat; its load is the
  instance's ``current_load``, with its migrator's migrating out and in); a report reaches the manager
  ``--report-lag-ms`` later, a heartbeat the proxy as late (sim/reports.py);
- with ``proxy.dispatch = local`` (the default) the proxy chooses each request's instance with its own
  dispatch view, from the manager's snapshots and the instances' heartbeats, and the request reaches its
  instance ``Network.submit_s`` after it arrived (llumnixctl/experiments/sim/proxy.py); with ``manager`` (and
  ``llumnix-cache``, and before the proxy's first snapshot) a dispatch costs the proxy a round trip to the
  manager (``--dispatch-rtt-ms``);
- a migration is each instance's own migrator (``daemons.migration.Migrator``: the source's ``Move`` state
  machine, the destination's reservation and commit, their messages, acknowledgements and timeouts) on the
  simulation's virtual time: its engine calls run at the simulated step boundaries, its messages to other
  instances go over ZeroMQ's in-process transport ``Network.message_s`` late, and each KV copy lasts its
  bytes at the link's bandwidth (llumnixctl/experiments/sim/migrate.py);

- with an SLO ([slo] TTFT targets) the proxy admits each new request as the proxy does (its own ``Admission``,
  sim/proxy.py: refused requests are counted, not served), and a request with no token ``slo.give_up_factor``
  times its TTFT target after it arrived is aborted where it queues and counted as given up (as the proxy's
  failover check does); ``--no-slo-admission`` queues everything and only measures against the targets;
  the result's ``slo`` counts per class what met both targets and what missed which, and how far the
  proxy's predictions at dispatch were off (sim/result.py);
- auto-scaling is the manager's own decision (``Rescheduler.scaling_decision``) every second: a launched
  instance registers ``Network.launch_s`` later; a scaled-in one drains (its requests migrate out or are
  dispatched again, by the pairing plan's drain orders) and stops when nothing is left on it.

What it does not model (yet): failures, several migrations sharing one link's bandwidth.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from array import array
from collections import Counter
from pathlib import Path
from typing import Annotated, Optional

import msgspec
import typer

from daemons import manager as manager_module
from daemons import metrics, policy, wire
from daemons.clock import LoopClock, VirtualTimeLoop, run_virtual
from daemons.config import Config, ConfigError, load_config
from daemons.requests import RequestTable
from llumnixctl.common import ConfigOpt, JsonOpt, die, out, print_json
from llumnixctl.experiments.sim import llumlet
from llumnixctl.experiments.sim.cache import SimCache
from llumnixctl.experiments.sim.disagg import SimRoles, parse_roles
from llumnixctl.experiments.sim.llumlet import ManagerLine, ManagerWire
from llumnixctl.experiments.sim.migrate import SimMigrations
from llumnixctl.experiments.sim.parts import (PROXY_ADDRESS, Network, SimulatedInstance, SimulatedRequest,
                                             kv_bytes_per_token)
from llumnixctl.experiments.sim.proxy import SimProxy
from llumnixctl.experiments.sim.reports import SimReports
from llumnixctl.experiments.sim.result import Fragmentation, result_block, result_of, stats_of  # noqa: F401 (figs import stats_of here)
from llumnixctl.experiments.sim.scale import SimScaling
from llumnixctl.experiments.sim.slo import SimSlo
from llumnixctl.experiments.traces import options as opts
from llumnixctl.experiments.traces.gen import TraceRequest


def _engine_code() -> None:
    """Import the engine and instance code (torch and all) when a simulation runs, not when llumnixctl
    starts: every command would pay seconds for it."""
    global Standing
    from daemons.instance.standing import Standing  # noqa: F811


Standing = None  # set by _engine_code()
MIGRATIONS_SETTLE_S = 30.0  # after the last request: at most this long for the migrations in flight to end


class Simulation:
    def __init__(self, cfg: Config, instances: int, trace: list[TraceRequest], net: Network | None = None,
                 sample_s: float = 0.0, oracle: bool = False, slo_admission: bool = True,
                 roles: list[str] | None = None, adapter_of=None, sessions: bool = False, seed: int = 0):
        """``sample_s`` > 0: every so often (virtual s) sample fragmentation (sim/result.py) for the "sample" observers.
        ``oracle``: dispatch by the engines' caches first (sim/cache.py). ``slo_admission`` False: with [slo] targets,
        admit all, never give up. ``roles``: the instances' (sim/disagg.py). ``adapter_of(request)``: its LoRA adapter.
        ``sessions``: each turn of a session trace names its session (its key made with ``seed``; sim/cache.py)."""
        _engine_code()
        self.cfg = cfg
        self.oracle = oracle
        self.sample_s = sample_s
        self.observers: list = []  # fn(kind, simulation, data): "dispatch", "step", "migration", "scale", "sample"
        self.fragmentation = Fragmentation()
        self.net = net or Network()
        self.trace = trace
        self.adapter_of = adapter_of or (lambda tr: "")
        self.loop = VirtualTimeLoop()  # the simulation's events are its timers (daemons/clock.py)
        self.clock = LoopClock(self.loop)  # the manager's clock too
        # proxy.dispatch = local (the default): the proxy's own dispatch view chooses (sim/proxy.py); with an
        # SLO it admits, whatever chooses.
        self.slo = SimSlo(cfg, slo_admission, self)  # (sim/slo.py)
        local = cfg.proxy.dispatch == "local"
        self.proxy = self.slo.proxy = SimProxy(cfg, self.clock) if local or self.slo.by_slo else None
        self.requests: dict[str, SimulatedRequest] = {}
        self.itls = array("d")
        self.events = 0
        self._qid = itertools.count(1)
        self.n_instances = instances
        self.kv_bytes_per_token = kv_bytes_per_token(cfg.sim, self.net)
        self.roles = SimRoles(cfg, roles, self)  # (sim/disagg.py)
        self.session_keys, self._finished = (sessions, seed), None

    # ------------------------------------------------------------------ the event loop

    def observe(self, fn) -> None:
        """Call ``fn(kind, simulation, data)`` at each event of a kind: figures measure what they need."""
        self.observers.append(fn)

    def notify(self, kind: str, **data) -> None:
        for fn in self.observers:
            fn(kind, self, data)

    def at(self, t: float, fn, *args) -> None:
        """Run ``fn(*args)`` at virtual time ``t`` (now if ``t`` is past)."""
        self.loop.call_at(t, self._event, fn, args)

    def _event(self, fn, args) -> None:
        self.events += 1
        fn(*args)

    @property
    def now(self) -> float:
        return self.loop.now

    def run(self, linger_s: float = 0.0) -> dict:
        """The simulation, to the end of its last request; ``linger_s``: then that many virtual seconds more
        (what is on its way arrives: reports, cache batches)."""
        wall = time.perf_counter()
        with metrics.off():  # (the daemons' Prometheus series: the figures are the simulation's own)
            run_virtual(lambda loop: self._main(linger_s), loop=self.loop)
        return self.result(time.perf_counter() - wall)

    async def _main(self, linger_s: float) -> None:
        # The manager's socket: what it sends an instance reaches its llumlet a message later (sim/llumlet.py).
        self.wire = ManagerWire(self.net.message_s, self, lambda src, start: self.migrations.ordered(src, start))
        self.mgr = manager_module.Manager(self.cfg, clock=self.clock, sock=self.wire)
        self._finished = self.loop.create_future()
        self.migrations = SimMigrations(self.cfg, self.net, self.loop, self.kv_bytes_per_token, self)
        self.cache = SimCache(self.cfg, self.mgr, self.trace, self.net.report_lag_s, self.oracle, self,
                              *self.session_keys)
        self.reports = SimReports(self.cfg, self.net.report_lag_s, self.mgr, self.proxy, PROXY_ADDRESS,
                                  self.cache.reports, self, self.clock)
        self.scaler = SimScaling(self.mgr, min(1.0, self.cfg.manager.heartbeat_interval_s), self.net.launch_s, self,
                                 self.reports.drain, self._stop_instance)
        # The manager's own loops: its pairing plans (Orders.pairing_loop) and, with disagg.adaptive, its roles'.
        loops = [self.mgr.resched.orders.pairing_loop(), *self.roles.start(self.mgr)]
        self.tasks = [self.loop.create_task(c) for c in loops]
        try:
            self._start()
            if self._left:
                await self._finished
            # The migrations still in flight end (an abort on its way to a destination that reserved blocks):
            # nothing measured changes meanwhile, no request is left.
            settle = self.now + MIGRATIONS_SETTLE_S
            while self.now < settle and any(i.migrator.busy for i in self.instances.values() if i.gone is None):
                await asyncio.sleep(0.01)
            if linger_s > 0:
                await asyncio.sleep(linger_s)
        finally:
            for task in self.tasks + [t for i in self.instances.values() for t in i.tasks]:
                task.cancel()
            await self.migrations.close()
            self.mgr.sec.close()
            self.mgr.ctx.destroy(linger=0)

    def _start(self) -> None:
        self.instances: dict[str, SimulatedInstance] = {}
        self._next_index = itertools.count()
        for _ in range(self.n_instances):
            self.add_instance()
        if policy.SCALING.get(self.cfg.scaling.policy).scales:
            self.scaler.start()
        if self.sample_s > 0:
            self.at(self.sample_s, self._sample)
        self._left = len(self.trace)
        for k, tr in enumerate(self.trace):
            rid = f"r{k}"
            self.requests[rid] = SimulatedRequest(tr, rid)
            if rid not in self.cache.later_turns:  # a later turn waits for the one before it
                self.at(tr.arrival_s, self._arrive, rid, ())
        if self.proxy is not None:
            self.proxy.start(lambda: self.mgr.snapshot(next(self._qid), PROXY_ADDRESS), self.net.dispatch_rtt_s,
                             self.at, lambda: self._left > 0)

    def add_instance(self) -> SimulatedInstance:
        """A new instance: its engine and its llumlet, the instance daemon's own parts (sim/llumlet.py), registered
        with the manager."""
        index = next(self._next_index)
        iid = f"i{index}"
        inst = SimulatedInstance(iid, self.migrations.engine(), ident=iid.encode(), born=self.now,
                                 table=RequestTable(self.clock), standing=Standing(self.roles.role_of(index)))
        self.instances[iid] = inst
        self.wire.by_ident[inst.ident] = inst
        inst.line = ManagerLine(inst.ident, self.mgr, self.net.report_lag_s, self)
        self.migrations.attach(inst)
        llumlet.intake(inst, self.clock, self, self.migrations.ended)
        self.cache.publisher(inst)
        load = inst.engine.load()
        self.mgr.on_register(inst.ident, wire.Register(
            iid, self.cfg.instance.host or "sim", 0, inst.host.request_address, "sim", self.cfg.model.name,
            msgspec.structs.replace(load, role=inst.standing.role), max_model_len=self.cfg.model.max_model_len))
        self.reports.start(inst)
        inst.tasks = [self.loop.create_task(c) for c in llumlet.build(inst, self.cfg, self.clock, self.cache.reports(inst))]
        if index >= self.n_instances:  # (auto-scaling launched it)
            self.roles.launched(self.mgr.instances[iid])
        return inst

    def _stop_instance(self, inst: SimulatedInstance) -> None:
        """A scaled-in instance stopped: its reports, its step loop and its control end."""
        self.reports.stop(inst)
        for task in inst.tasks:
            task.cancel()

    def _sample(self) -> None:
        loads = self.fragmentation.sample([i.engine.load() for i in self.instances.values() if i.gone is None])
        self.notify("sample", loads=loads)
        if self._left:
            self.at(self.now + self.sample_s, self._sample)

    # ------------------------------------------------------------------ proxy and manager

    def _arrive(self, rid: str, exclude: tuple) -> None:
        """The proxy chooses the instance itself (proxy.dispatch = local, once it has a view: sim/proxy.py), or
        asks the manager where the request goes (half a round trip each way)."""
        req = self.requests[rid]
        if req.sent < 0:
            req.sent = self.now
        if req.slo == "gave_up" or not self.slo.admitted(req):
            return
        proxy, tr, prio = self.proxy, req.trace, 1 if req.trace.priority == "high" else 0
        exclude = self.slo.among_fits(req, exclude, self.instances)
        local = proxy is not None and proxy.ready() and not self.oracle
        if local:
            iid = proxy.choose(prio, self.roles.exclude(proxy, tr.prompt_tokens, prio, exclude),  # (in its pool)
                               tr.prompt_tokens, self.adapter_of(tr))
            if iid is not None:
                self.slo.sent(req, iid)
                req.dispatches += 1
                self.notify("dispatch", request=rid, instance=iid)
                self.at(self.now + self.net.dispatch_rtt_s / 2, self.mgr.on_dispatched,
                        wire.Dispatched(rid, iid, tr.prompt_tokens, prio))
                self.at(self.now + self.net.submit_s, self._submit, rid, iid)
                return
        self.at(self.now + self.net.dispatch_rtt_s / 2, self._dispatch, rid, exclude)

    def _dispatch(self, rid: str, exclude: tuple) -> None:
        req = self.requests[rid]
        if req.slo == "gave_up":
            return
        tr = req.trace
        prio = 1 if tr.priority == "high" else 0
        iid = self.cache.oracle_choice(req) if self.oracle and not exclude else None
        if iid is None:
            reply = self.cache.ask(req, next(self._qid), prio, exclude, self.adapter_of(tr))  # (the manager's)
            self.roles.decided(reply.disagg)  # (the manager decides with roles itself)
            if not reply.instance_id:
                return self._fail(req, reply.reason or "no instance")
            iid = reply.instance_id
        self.slo.sent(req, iid)
        req.dispatches += 1
        self.notify("dispatch", request=rid, instance=iid)
        self.at(self.now + self.net.dispatch_rtt_s / 2 + self.net.submit_s, self._submit, rid, iid)

    def _submit(self, rid: str, iid: str) -> None:
        """The proxy's Submit reaches the instance's intake (taken in at its next step boundary)."""
        req = self.requests[rid]
        if req.slo == "gave_up":
            return
        inst = self.instances[iid]
        if inst.gone is not None:  # it stopped (scaled in) before the Submit came: the proxy places it again
            return self.redispatch(rid, iid)
        tr = req.trace
        sampling = wire.SamplingParams(max_tokens=max(1, tr.output_tokens), ignore_eos=True)
        req.owner = iid
        inst.intake.post(wire.Submit(rid, self.cache.prompt_of(req), sampling, PROXY_ADDRESS, int(tr.priority == "high"),
                                     req.sent, 1, adapter=self.adapter_of(tr), **self.cache.submit_fields(req)))

    def _fail(self, req: SimulatedRequest, why: str) -> None:
        req.error = why
        self.end(req)

    def end(self, req: SimulatedRequest) -> None:
        """``req`` ended (finished, failed, refused, gave up): its session's next turn may go."""
        self._left -= 1
        self.cache.turn_ended(req)
        if self._left == 0 and self._finished is not None and not self._finished.done():
            self._finished.set_result(None)

    # ------------------------------------------------------------------ instances

    def from_instance(self, inst: SimulatedInstance, msg: wire.Message) -> None:
        """What an instance's token path sends the proxy (sim/llumlet.py ProxyPort): a step's tokens, a request
        that failed, a request given back for re-dispatch (the owner of a moved request is noted by its host)."""
        if isinstance(msg, wire.TokenBatch):
            self._tokens(inst, msg.outputs)
        elif isinstance(msg, wire.RequestFailed):  # retryable: every adapter slot there is in use, go elsewhere
            self.redispatch(msg.request_id, inst.iid) if msg.retryable else self._fail(self.requests[msg.request_id],
                                                                                       msg.message)
        elif isinstance(msg, wire.Redispatch):
            self.redispatch(msg.request_id, inst.iid)

    def _tokens(self, inst: SimulatedInstance, outputs: list) -> None:
        now = self.now
        for tok in outputs:
            req = self.requests[tok.request_id]
            if req.slo == "gave_up":  # the step that made it ran as it gave up; it is gone
                if tok.finish_reason is None:
                    self.slo.abort(inst, tok.request_id)
                continue
            if req.tokens == 0:
                req.first = now
            else:
                self.itls.append(now - req.last)
            req.last = now
            req.tokens += 1
            if tok.finish_reason is not None:
                req.finish = tok.finish_reason
                self.end(req)
        self.notify("step", instance=inst, outputs=outputs)
        self.scaler.maybe_gone(inst)

    # ------------------------------------------------------------------ what migrations need (simmigrate.Site)

    def redispatch(self, request_id: str, src: str) -> None:
        self.at(self.now + self.net.message_s, self._arrive, request_id, (src,))

    def maybe_gone(self, inst: SimulatedInstance) -> None:
        self.scaler.maybe_gone(inst)

    def arrive(self, request_id: str) -> None:
        self._arrive(request_id, ())

    # ------------------------------------------------------------------ figures

    def result(self, wall_s: float) -> dict:
        return result_of(self, wall_s)


def simulate(cfg: Config, instances: int, trace: list[TraceRequest], net: Network | None = None,
             sample_s: float = 0.0, observers: tuple = (), oracle: bool = False, slo_admission: bool = True,
             roles: list[str] | None = None, adapter_of=None) -> dict:
    """Run ``trace`` on ``instances`` simulated instances with the settings of ``cfg``; the figures."""
    if instances < 1:
        raise ValueError("a cluster needs at least one instance")
    sim = Simulation(cfg, instances, trace, net, sample_s, oracle, slo_admission, roles, adapter_of)
    for fn in observers:
        sim.observe(fn)
    return sim.run()



# ---------------------------------------------------------------------- the command

def _trace(path, requests: int, rate: float, arrival: str, cv: float, prompt: tuple[int, int],
           output: tuple[int, int], alpha: float, high_fraction: float, seed: int) -> list[TraceRequest]:
    from llumnixctl.experiments.traces import gen as trace_mod

    if path is None:
        return trace_mod.generate(requests, rate=rate, arrival=arrival, cv=cv, prompt=prompt, output=output,
                                  alpha=alpha, high_fraction=high_fraction, seed=seed)
    from llumnixctl.experiments.traces import files as traces

    return traces.load(path)


def command(
    instances: Annotated[int, typer.Option("--instances", "-n", help="simulated instances", min=1)] = 16,
    trace_file: Annotated[Optional[Path], typer.Option("--trace", metavar="FILE", help="a trace file (any format `llumnixctl trace show` reads); default: generate one")] = None,
    requests: opts.Requests = 1000,
    rate: opts.Rate = 10.0,
    arrival: opts.Arrival = "poisson",
    cv: opts.Cv = 1.0,
    prompt_min: opts.PromptMin = 16,
    prompt_max: opts.PromptMax = 1024,
    output_min: opts.OutputMin = 16,
    output_max: opts.OutputMax = 1024,
    alpha: opts.Alpha = 1.0,
    high_fraction: opts.HighFraction = 0.0,
    seed: opts.Seed = 0,
    policy_: Annotated[Optional[str], typer.Option("--policy", metavar="POLICY", help=f"dispatch policy: {policy.DISPATCH.listing().replace(' or ', ', ')} (manager.dispatch_policy), or oracle-cache (here only: the instance whose cache really holds most of the prompt)")] = None,
    report_lag_ms: Annotated[float, typer.Option(help="a load report's delay to the manager", min=0.0)] = 2.0,
    dispatch_rtt_ms: Annotated[float, typer.Option(help="the proxy's round trip to the manager per request", min=0.0)] = 1.0,
    kv_gbps: Annotated[float, typer.Option(help="what one migration's KV copy achieves, Gbit/s", min=0.001)] = 10.0,
    kv_bytes_per_token: Annotated[int, typer.Option(help="KV bytes per token (0: from the sim settings' KV shape)", min=0)] = 0,
    config: ConfigOpt = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="any setting: section.key=value (sim.*, scheduling.*, migration.*, ...)")] = None,
    slo_admission: Annotated[bool, typer.Option("--slo-admission/--no-slo-admission", help="with [slo] TTFT targets (--set slo.ttft_ms=...): admit by them and give up on requests queued past slo.give_up_factor x target, as the proxy does; --no-slo-admission queues everything and only measures against the targets")] = True,
    roles_: Annotated[Optional[str], typer.Option("--roles", metavar="P:D|LIST", help="prefill/decode disaggregation: P prefill then D decode instances (P + D = --instances), or one role per instance (prefill,decode,mixed,...); default: all mixed")] = None,
    handover_blocking: Annotated[bool, typer.Option("--handover-blocking", help="with --roles: a handover skips pre-copy (the request is suspended when the order reaches its prefill instance and its KV goes in one stage), instead of pre-copying while it decodes there (as --set disagg.handover_precopy=false)")] = False,
    adaptive_roles: Annotated[bool, typer.Option("--adaptive-roles", help="move instances between the prefill and decode roles by the SLO's targets (disagg.adaptive; needs --roles and slo.ttft_ms, slo.tpot_ms)")] = False,
    paper_like: Annotated[bool, typer.Option("--paper-like", help="the paper-like instance (an estimated LLaMA-7B on an A10, llumnixctl/experiments/figs/common.py PAPER_LIKE) under --config and --set")] = False,
    sessions: Annotated[int, typer.Option("--sessions", help="a session workload of this many sessions instead of --requests (closed loop, growing prompts, shared agent prompts; sim.prefix_caching on; each turn names its session): --rate is then sessions started per second (llumnixctl/experiments/sim/sessions.py)", min=0)] = 0,
    turns: Annotated[str, typer.Option("--turns", metavar="MIN-MAX", help="with --sessions: turns of a session")] = "20-40",
    agents: Annotated[int, typer.Option("--agents", help="with --sessions: shared agent system prompts", min=0)] = 4,
    system_tokens: Annotated[int, typer.Option("--system-tokens", help="with --sessions: tokens of an agent system prompt", min=0)] = 1024,
    think: Annotated[float, typer.Option("--think", help="with --sessions: mean seconds from an answer to the next turn", min=0.0)] = 0.5,
    working_set: Annotated[float, typer.Option("--working-set", help="with --sessions: as many sessions as make the working set this many times the instances' KV (instead of the number)", min=0.0)] = 0.0,
    compare: Annotated[bool, typer.Option("--compare", help="with --sessions: the same trace on session dispatch (tier and pulls where this build has them), llumnix-cache without tiers and infaas++, [slo] targets measuring only: P99 TTFT, goodput")] = False,
    json_: JsonOpt = False,
) -> None:
    """A cluster in virtual time, on the daemons' own scheduler and policy code (see llumnixctl/experiments/sim/simulate.py)."""
    if paper_like:
        from llumnixctl.experiments.sim.paper import PAPER_LIKE

        set_ = [*PAPER_LIKE, *(set_ or [])]
    if sessions:
        from llumnixctl.experiments.sim.sessions import command_sessions

        return command_sessions(Simulation, instances, sessions, rate, turns, agents, system_tokens, think, working_set, compare,
                                policy_, config, list(set_ or []), seed,
                                Network(report_lag_s=report_lag_ms / 1e3, dispatch_rtt_s=dispatch_rtt_ms / 1e3,
                                        kv_gbps=kv_gbps, kv_bytes_per_token=kv_bytes_per_token), json_)
    if compare:
        die("--compare needs --sessions N", 2)
    oracle = policy_ == "oracle-cache"
    sets = list(set_ or []) + ([f"manager.dispatch_policy={'llumnix' if oracle else policy_}"] if policy_ else [])
    sets += ["disagg.adaptive=true"] if adaptive_roles else []
    sets += ["disagg.handover_precopy=false"] if handover_blocking else []
    try:
        cfg = load_config(config, sets)
        roles = parse_roles(roles_, instances) if roles_ else None
    except (ConfigError, ValueError) as exc:
        die(str(exc), 2)
    try:
        reqs = _trace(trace_file, requests, rate, arrival, cv, (prompt_min, prompt_max), (output_min, output_max),
                      alpha, high_fraction, seed)
    except (OSError, ValueError) as exc:
        die(f"cannot read the trace: {exc}", 2)
    net = Network(report_lag_s=report_lag_ms / 1e3, dispatch_rtt_s=dispatch_rtt_ms / 1e3, kv_gbps=kv_gbps,
                  kv_bytes_per_token=kv_bytes_per_token)
    import logging

    logging.getLogger("llumnix").setLevel(logging.WARNING)  # the manager's info lines are per event here
    res = simulate(cfg, instances, reqs, net, oracle=oracle, slo_admission=slo_admission, roles=roles)
    if json_:
        print_json(res)
        return
    out.print(result_block(res), markup=False, highlight=False)

