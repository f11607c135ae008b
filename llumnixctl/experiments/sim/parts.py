"""The simulator's records (llumnixctl/experiments/sim/simulate.py): its network's times, its requests and its
instances."""

from __future__ import annotations

from dataclasses import dataclass, field

from llumnixctl.experiments.traces.gen import TraceRequest

PROXY_ADDRESS = "inproc://sim-proxy"  # the simulated proxy's token address (requests' reply_to)


@dataclass
class Network:
    """Times of the simulated cluster's messages and KV copies."""

    report_lag_s: float = 0.002  # a load report's way to the manager
    dispatch_rtt_s: float = 0.001  # the proxy asks the manager where a request goes
    submit_s: float = 0.0005  # the proxy's request to the instance
    message_s: float = 0.0005  # one migration control message
    kv_gbps: float = 10.0  # what one migration's copy achieves (before migration.bandwidth_limit_mbps)
    kv_bytes_per_token: int = 0  # 0: from the sim engine's KV shape
    launch_s: float = 30.0  # auto-scaling: a launched instance loads its model and registers this much later
    step_overhead_s: float = 0.0  # the daemon's own cost per step (event loop, sockets), on top of model time


@dataclass
class SimulatedRequest:
    trace: TraceRequest
    rid: str
    owner: str = ""
    first: float = -1.0
    last: float = -1.0
    tokens: int = 0
    finish: str = ""
    error: str = ""
    dispatches: int = 0
    sent: float = -1.0  # when the client sent it (a session's later turn: after the turn before it)
    moved_at: float = -1.0  # when a migration last committed it on its destination
    ids: list | None = None  # the prompt's token ids (with sim.prefix_caching)
    keys: list | None = None  # their block keys
    slo: str = ""  # admission by SLO: "admitted", "refused", "gave_up" (no token give_up_factor x its target on)
    predicted: tuple | None = None  # (TTFT, TPOT) the proxy predicted at its first dispatch (SLO models known)
    fits: tuple = ()  # admission by SLO: the instances predicted to meet its target (its first placement: among them)
    pull: tuple | None = None  # a prefix pull its dispatch ordered: (instance to pull from, blocks)


def _mailbox():
    from daemons.instance.mailbox import Mailbox  # (torch: only once a simulation runs)

    return Mailbox()


@dataclass
class SimulatedInstance:
    """One simulated instance: its engine and the instance daemon's own parts (sim/llumlet.py builds them)."""

    iid: str
    engine: object  # a sim engine (simmigrate.sim_engine_class)
    ident: bytes
    mailbox: object = field(default_factory=_mailbox)  # its daemons.instance.mailbox.Mailbox (the step boundary)
    table: object = None  # its request table (daemons/requests.py)
    migrator: object = None  # its own daemons.migration.Migrator
    host: object = None  # what the migrator needs of it (simmigrate.SimHost)
    line: object = None  # its line to the manager (sim/llumlet.py ManagerLine)
    ident_of: object = None  # who it is (daemons.instance.standing.Identity)
    shared: object = None  # what its parts share (daemons.instance.shared.Shared): they are built with it
    intake: object = None  # its daemons.instance.intake.Intake
    tokens: object = None  # its daemons.instance.tokens.TokenPath (to the proxy: sim/llumlet.py ProxyPort)
    phases: object = None  # its request phases (daemons.metrics.RequestPhases)
    tap: object = None  # its migrator as its parts reach it (sim/llumlet.py MigratorTap)
    stepper: object = None  # its daemons.instance.steps.StepLoop
    orders: object = None  # its daemons.instance.selection.Orders
    handovers: object = None  # its daemons.instance.handover.Handovers
    tasks: list = field(default_factory=list)  # its step loop's and control's tasks
    born: float = 0.0
    gone: float | None = None  # when it stopped (scaled in)
    retiring: bool = False
    pub: object = None  # its prefix-cache Publisher (sim.prefix_caching)
    reporter: object = None  # its own daemons.instance.reports.Reporter (sim/reports.py)
    fit: object = None  # its step-time model (daemons.instance.predictor.StepFit), which its reports carry
    standing: object = None  # where it stands (daemons.instance.standing.Standing): its role, draining

    @property
    def taken(self):
        """Per proxy address, the Submits it took in (its intake's count, which its heartbeats carry)."""
        return self.intake.taken if self.intake is not None else {}


def kv_bytes_per_token(sim, net: Network) -> int:
    """KV bytes per token: the network's if set, else the latency profile's (``sim.profile``), else the sim
    settings' KV shape (``net.kv_bytes_per_token`` takes the profile's)."""
    if not net.kv_bytes_per_token and sim.profile:
        from daemons.engine.profile import LatencyProfile

        net.kv_bytes_per_token = LatencyProfile.load(sim.profile).kv_bytes_per_token
    return net.kv_bytes_per_token or (
        sim.kv_layers * 2 * sim.kv_heads * sim.head_dim * (4 if sim.kv_dtype == "float32" else 2))
