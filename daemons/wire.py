"""Every message that crosses a ZeroMQ socket, in one place.

Messages are msgspec structs encoded as msgpack arrays (``array_like``) with an integer tag that names
the kind. New fields go at the end, with a default, so that an older peer still decodes a newer message.
KV bytes never travel here; they go over Gloo.

Sockets:
- manager ROUTER  <- instance DEALER   Register, LoadReport, Goodbye / RegisterAck
- manager ROUTER  <- proxy DEALER      Dispatch, SnapshotQuery / DispatchReply, Snapshot; Dispatched (no reply)
- manager ROUTER  <- llumnixctl DEALER StatusQuery, RequestsQuery / Snapshot, RequestsReply, ErrorReply
- manager ROUTER  <- llumnixctl DEALER SessionsQuery / SessionsReply (``llumnixctl sessions``)
- instance ROUTER <- proxy DEALER      Submit, Abort (fire and forget: failures come back on the token path)
- instance ROUTER <- manager           ListRequests / RequestList (for ``llumnixctl requests``)
- proxy PULL      <- instance PUSH     TokenBatch, RequestFailed, Moved
- manager ROUTER  <- llumnixctl        MigrateQuery / MigrateReply, ErrorReply
- instance DEALER <- manager           MigrateStart / MigrateResult (the source runs the migrations)
- instance ROUTER <- peer DEALER       MigStage, MigAbort / MigReady, MigDone (source -> destination)
- manager ROUTER  <- llumnixctl        DrainQuery, RemoveQuery, AddQuery, PolicyQuery / DrainReply, RemoveReply,
                                       AddReply, PolicyReply, ErrorReply
- instance DEALER <- manager           SetDraining, Shutdown
- proxy PULL      <- instance PUSH     Redispatch (a queued request the instance gives back: dispatch it again)
- proxy PULL      <- instance PUSH     Heartbeat (liveness and load, every heartbeat interval)
- instance ROUTER <- proxy DEALER      ProxyAlive (the proxy's liveness, every heartbeat interval)
- proxy PULL, manager ROUTER <- instance  CacheEvents (what its prefix cache stored and removed, on change)
- instance ROUTER <- proxy DEALER, instance DEALER <- manager  CacheSync (send your whole prefix cache)
- manager ROUTER  <- llumnixctl, proxy LoraQuery / LoraReply, ErrorReply (LoRA adapters: load, unload, list)
- instance DEALER <- manager           LoraOrder / LoraResult
"""

from __future__ import annotations

import logging

import msgspec

from daemons import endpoints

WIRE_VERSION = 1

log = logging.getLogger("llumnix.wire")


def _tagged(tag: int):
    """Struct config for message kind ``tag`` (integers keep frames small)."""
    return {"tag": tag, "array_like": True, "omit_defaults": True, "tag_field": "k"}


# ---------------------------------------------------------------- shared value types


class StructuredOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """A grammar the output must follow (vLLM's ``StructuredOutputsParams``): one of json (a JSON schema, as
    JSON text), regex, choice, grammar (EBNF or Lark), json_object or structural_tag, with vLLM's options. The
    proxy builds it from ``response_format``, ``structured_outputs`` or a forced tool choice; an engine that
    cannot honour it refuses the request."""

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True):
    """What the proxy accepted from the client; engines honour what they support."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    structured: StructuredOutputs | None = None  # constrained decoding; travels with a migration and a failover


class RequestLoad(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request as an instance sees it."""

    request_id: str
    state: str  # "running" | "waiting" | "preempted" (waiting after recompute preemption)
    blocks: int
    prompt_tokens: int
    output_tokens: int
    priority: int = 0
    max_tokens: int = 0  # the most output tokens it may generate (its sampling's max_tokens; 0: not said)


class Outlook(msgspec.Struct, array_like=True, omit_defaults=True):
    """What an instance's requests will still claim, by the output lengths it observes (daemons/instance/outlook.py;
    read by the SLO's slot and KV waits: daemons/policy/slo.py). A request's expected output is the mean, over the
    recent finishes that got as far as it has, of their lengths capped by its max_tokens; a finish cut by its
    own max_tokens says only "at least that", and counts as reaching the cap (conservative)."""

    committed_blocks: int = 0  # KV blocks its running and waiting requests will hold at their expected final lengths
    # The running requests by expected remaining output tokens, at up to 8 ranks, cumulative: (remaining tokens of
    # the request at that rank, requests finished by then, the KV blocks they give back).
    drain: list[tuple[int, int, int]] = []
    lengths: list[int] = []  # 16 quantiles of the observed output lengths (a finish cut by max_tokens: UNBOUNDED)
    waiting_output: int = 0  # the waiting requests' mean expected output tokens (0: none waits)


UNBOUNDED = 1 << 30  # an output length known only as "at least": longer than any max_tokens


class LatencyFit(msgspec.Struct, array_like=True, omit_defaults=True):
    """An instance's step-time model, fitted online from its own steps (daemons/instance/predictor.py), in the
    form of the sim engine's latency model: a step that prefills P tokens and decodes D requests holding C
    context tokens takes prefill_ms + prefill_ms_per_token * P (if P) + decode_ms + decode_ms_per_seq * D +
    decode_ms_per_token * C (if D) milliseconds."""

    steps: int = 0  # steps observed (0: no model yet; nothing is predicted from it)
    prefill_ms: float = 0.0
    prefill_ms_per_token: float = 0.0
    decode_ms: float = 0.0
    decode_ms_per_seq: float = 0.0
    decode_ms_per_token: float = 0.0
    extra_ms: float = 0.0  # recent mean of (step time - the model's decode part): prefills of others, noise
    chunk_tokens: int = 0  # most prompt tokens one step prefills (the engine's budget; 0: unbounded)
    finish_rate: float = 0.0  # requests finished per second, recent mean (how fast queued requests get a slot)
    # The largest steps it has run: a decode batch and the prompt tokens of one step (0: not said). Past them its
    # model only extrapolates, and the predictions take no less per request or token than there (an upper bound).
    decode_seen: int = 0
    prefill_seen: int = 0


class InstanceLoad(msgspec.Struct, array_like=True, omit_defaults=True):
    """An instance's load at one moment: what every policy reads."""

    blocks_total: int
    blocks_used: int
    running: int
    waiting: int
    batch_size: int  # the engine's most concurrently running requests (its capacity; B of freeness is the current batch)
    block_size: int
    preemptions: int = 0  # monotonic counter since start
    hol_demand_blocks: int = 0  # blocks the head-of-line waiting request needs to be admitted
    requests_received: int = 0  # monotonic: lets the manager retire its dispatch estimates
    tokens_generated: int = 0  # monotonic
    running_blocks: int = 0  # blocks held by running requests
    migrating_out: int = 0  # migrations in flight with this instance as source
    migrating_in: int = 0  # ... as destination (their reserved blocks count in blocks_used)
    migrations_committed: int = 0  # monotonic, as source
    migrations_aborted: int = 0  # monotonic, as source
    high_priority: int = 0  # running requests of high execution priority (each adds headroom to virtual usage)
    stalled: bool = False  # an engine step has run past instance.step_timeout_s: unhealthy, no dispatches
    waiting_tokens: int = 0  # tokens the waiting requests have yet to prefill (the proxies' admission control)
    prefix_query_tokens: int = 0  # monotonic: prompt tokens looked up in the engine's prefix cache
    prefix_hit_tokens: int = 0  # monotonic: of those, found cached
    # The SLO's inputs (daemons/policy/slo.py): the step-time model the instance fitted from its own steps, the
    # work waiting ahead of a new high-priority request, and the tokens its running requests hold (decode cost).
    latency: LatencyFit | None = None
    waiting_high: int = 0  # waiting requests of high priority (a high request queues behind these only)
    waiting_high_tokens: int = 0
    context_tokens: int = 0  # tokens (prompt + generated) of the running requests
    # Attainment over the last slo.window_s (daemons/instance/attainment.py): requests with an SLO that finished
    # here, and of those, how many met both their targets (TTFT from the proxy's arrival time, TPOT).
    slo_judged: int = 0
    slo_met: int = 0
    role: str = "mixed"  # "mixed" | "prefill" | "decode" (prefill/decode disaggregation: daemons/policy/disagg.py)
    outlook: Outlook | None = None  # what its requests will still claim (None: not reported)
    # The SLO's TTFT predictions against what happened, over the last slo.window_s: |predicted - actual| / actual
    # of the requests that got their first token here (median, 90th percentile; judged: how many).
    ttft_error_p50: float = 0.0
    ttft_error_p90: float = 0.0
    ttft_error_judged: int = 0
    # LoRA (daemons/engine/adapters.py): the adapters it holds, most recently used first, and its open adapter
    # slots (free, or holding an adapter no request runs with: a new adapter could load now; 0 with LoRA off).
    adapters: list[str] = []
    adapter_slots: int = 0
    # The host-memory KV tier (daemons/engine/tier.py; 0s: none): blocks it holds, its size in blocks, the measured
    # time to restore one block into the engine (an estimate before the first restore), and the blocks retained
    # for sessions within their TTL (engine and tier; free, reclaimable: never counted in blocks_used).
    tier_blocks: int = 0
    tier_capacity: int = 0
    restore_ms_per_block: float = 0.0
    retained_blocks: int = 0
    # Bytes of one KV block (every layer; 0: unknown): what pricing a pull or a restore of a block reads.
    block_nbytes: int = 0


# ---------------------------------------------------------------- instance <-> manager


class Register(msgspec.Struct, **_tagged(1)):
    instance_id: str
    host: str
    pid: int
    request_address: str  # where proxies send Submit/Abort
    backend: str
    model: str
    load: InstanceLoad
    metrics_address: str = ""
    wire_version: int = WIRE_VERSION
    max_model_len: int = 0
    # What the instance was told before (a restarted manager rebuilds its view from these) and how long it
    # has run (a new instance is filled first; an old one re-registering is not new).
    drain_reason: str = ""  # "stopping" once it got SIGTERM
    cordoned: bool = False
    uptime_s: float = 0.0
    scale_in_protected: bool = False  # instance.scale_in_protected: auto-scaling never retires it
    # Its KV layout (daemons/kv/layout.py KvLayout.spec, with its tensor-parallel size): prefill/decode roles
    # need a decode instance's TP at least the prefill's, checked at registration ("": not said).
    kv_spec: str = ""

    def __post_init__(self) -> None:
        endpoints.check(self.request_address, "request_address")


class RegisterAck(msgspec.Struct, **_tagged(2)):
    instance_id: str
    accepted: bool = True
    reason: str = ""
    final: bool = False  # not accepted, and registering again will not help (id taken, wire version)


class LoadReport(msgspec.Struct, **_tagged(3)):
    instance_id: str
    seq: int
    load: InstanceLoad
    cache_epoch: int = 0  # its prefix cache's incarnation (0: it publishes none) and the last CacheEvents seq
    cache_seq: int = 0


class Goodbye(msgspec.Struct, **_tagged(4)):
    instance_id: str
    reason: str = ""


# ---------------------------------------------------------------- proxy <-> manager


class Dispatch(msgspec.Struct, **_tagged(10)):
    query_id: int
    request_id: str
    prompt_tokens: int
    priority: int = 0
    exclude: list[str] = []  # instances the proxy already failed on
    # llumnix-cache: the keys of the prompt's full blocks (daemons/prefix.py), for the manager's prefix index
    prefix_keys: list[int] = []
    adapter: str = ""  # its LoRA adapter: placed among the instances that hold it (daemons/policy/residency.py)
    session: str = ""  # the session it names (wire.Submit.session): placed where its KV is (daemons/policy/sessions.py)


class DispatchReply(msgspec.Struct, **_tagged(11)):
    query_id: int
    instance_id: str = ""  # empty: no live instance
    request_address: str = ""
    reason: str = ""
    disagg: str = ""  # with roles: where it was decided to prefill (daemons/policy/disagg.py DECISIONS)
    pull_from: str = ""  # a prefix pull before it queues (wire.Submit.pull_from, pull_blocks; "": none)
    pull_blocks: int = 0
    how: str = ""  # a session's turn: how it was placed (daemons/policy/sessions.py HOW)

    def __post_init__(self) -> None:
        endpoints.check(self.request_address, "request_address", empty_ok=True)


class SnapshotQuery(msgspec.Struct, **_tagged(12)):
    query_id: int
    proxy: str = ""  # the asking proxy's token address: the manager ranks the proxies it hears from


class Dispatched(msgspec.Struct, **_tagged(14)):
    """proxy -> manager, fire and forget: the proxy placed a request from its own view. The manager counts
    it as it counts the dispatches it answers (pending usage, totals, pairing and scaling)."""

    request_id: str
    instance_id: str
    prompt_tokens: int
    priority: int = 0
    session: str = ""  # the session it names, and its prompt's block keys (the manager's session table)
    prefix_keys: list[int] = []


class InstanceView(msgspec.Struct, array_like=True, omit_defaults=True):
    """The manager's view of one instance, as status and the proxies see it."""

    instance_id: str
    host: str
    pid: int
    state: str  # "alive" | "stopping" (finishing its requests, takes no new ones) | "dead" (missed heartbeats)
    request_address: str
    backend: str
    model: str
    load: InstanceLoad
    freeness: float
    last_report_age_s: float
    metrics_address: str = ""
    draining: bool = False
    pending_dispatches: int = 0
    max_model_len: int = 0
    virtual_usage: float = 0.0  # blocks; inf while draining
    cordoned: bool = False
    drain_reason: str = ""  # "operator", "scale-in", "remove", "stopping" while draining
    migrations_ordered: int = 0  # manager-ordered migrations in flight with it as source or destination
    credit: float = 0.0  # blocks of negative virtual usage left (a new instance being filled first)
    key: str = ""  # "role:name" of the CURVE key it registered with (proxies take its messages from that key only)
    scale_in_protected: bool = False

    def __post_init__(self) -> None:
        endpoints.check(self.request_address, "request_address", empty_ok=True)


class Snapshot(msgspec.Struct, **_tagged(13)):
    query_id: int
    instances: list[InstanceView]
    dispatch_policy: str = ""
    uptime_s: float = 0.0
    dispatched_total: int = 0
    pairing_policy: str = ""
    request_selection: str = ""
    scaling_policy: str = ""
    migrating: bool = False  # the pairing loop orders balancing migrations (dispatch llumnix, pairing on)
    ordered_migrations: dict[str, int] = {}  # manager-ordered migrations that ended, by "reason/outcome"
    scale_outs: int = 0
    scale_ins: int = 0
    launching: int = 0  # instances launched that have not registered yet
    proxies: int = 0  # proxies heard from lately (their snapshot queries)
    proxy_rank: int = 0  # the asking proxy's place among them: it offsets the proxies' tie rotations
    adapters: dict[str, str] = {}  # the LoRA adapters the cluster serves: name -> path (daemons/manager/adapters.py)


# ---------------------------------------------------------------- admin (llumnixctl) <-> manager


class StatusQuery(msgspec.Struct, **_tagged(20)):
    query_id: int


class RequestsQuery(msgspec.Struct, **_tagged(21)):
    query_id: int


class RequestInfo(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    instance_id: str
    state: str
    output_tokens: int
    prompt_tokens: int
    blocks: int
    priority: int = 0


class RequestsReply(msgspec.Struct, **_tagged(22)):
    query_id: int
    requests: list[RequestInfo]
    unreachable: list[str] = []  # instances that did not answer in time


class SessionsQuery(msgspec.Struct, **_tagged(100)):
    """llumnixctl -> manager: the sessions it knows, most recently seen first (``limit``: at most; 0: all)."""

    query_id: int
    limit: int = 0


class SessionRow(msgspec.Struct, array_like=True, omit_defaults=True):
    """One session (daemons/sessions.py): where its last turn went, and where its last prompt's KV is now by the
    prefix index: per instance holding some, its leading blocks in the engine and more in the host tier."""

    session: str
    instance_id: str  # its last turn's
    turns: int
    prompt_tokens: int  # its last prompt's
    blocks: int  # its last prompt's full blocks
    age_s: float  # since its first turn
    idle_s: float  # since its last
    engine_blocks: dict[str, int] = {}
    host_blocks: dict[str, int] = {}


class SessionsReply(msgspec.Struct, **_tagged(101)):
    query_id: int
    sessions: list[SessionRow] = []
    known: int = 0  # sessions the manager knows (the rows may be fewer: the limit)


class ErrorReply(msgspec.Struct, **_tagged(23)):
    query_id: int
    message: str


# ---------------------------------------------------------------- manager -> instance


class ListRequests(msgspec.Struct, **_tagged(30)):
    query_id: int


class SetDraining(msgspec.Struct, **_tagged(32)):
    """manager -> instance: you are draining (give queued requests back for re-dispatch, take no new ones),
    or no longer; and whether you are cordoned. The instance repeats both when it registers again."""

    draining: bool
    reason: str = ""
    cordoned: bool = False
    elsewhere: bool = True  # another instance takes requests: queued ones can be given back right away


class SetRole(msgspec.Struct, **_tagged(34)):
    """manager -> instance: serve in ``role`` from now on ("mixed" | "prefill" | "decode"). The instance reports
    its role in every load report; the manager repeats the last one it set when the instance registers again."""

    role: str
    reason: str = ""  # "operator" | "adaptive" | "scale-out"


class HandoverReady(msgspec.Struct, **_tagged(56)):
    """instance (in role prefill) -> manager: ``request_id`` has its first token; choose a decode instance and
    order its handover (a migration with reason "handover"). No answer: it keeps decoding where it is."""

    instance_id: str
    request_id: str
    prompt_tokens: int
    blocks: int
    priority: int = 0
    slo_tpot_ms: float = 0.0
    reason: str = "handover"  # "handover": its first token here; "role": it was decoding here when the role changed


class PeerDead(msgspec.Struct, **_tagged(57)):
    """manager -> instances: ``instance_id`` (at ``request_address``) is dead: release at once what any migration
    with it holds (a reservation it will never commit, a request suspended for it)."""

    instance_id: str
    request_address: str


class PeerLink(msgspec.Struct, **_tagged(90)):
    """manager -> instance (in role prefill): make the links to ``instance_id`` (at ``request_address``) now, off
    any request's path: the socket, the KV pair (its rendezvous over that socket) and the layout check that a
    handover to it would otherwise do first (daemons/migration/warmup.py)."""

    instance_id: str
    request_address: str


class LinkOpen(msgspec.Struct, **_tagged(91)):
    """instance -> instance, on the migration channel: join the KV pair ``pair_key`` now (the source's KV
    transfer at ``kv_address``, "" for a rendezvous over this channel) if our KV layouts agree; answered by
    LinkReady. ``chunk_blocks``: the blocks per message its moves will use (staging is sized for it)."""

    pair_key: str
    src: str
    kv_spec: str
    kv_address: str = ""
    chunk_blocks: int = 1


class LinkReady(msgspec.Struct, **_tagged(92)):
    """instance -> instance: the answer to LinkOpen (not ``ok``: ``reason`` says why, e.g. the layouts differ)."""

    pair_key: str
    ok: bool = True
    reason: str = ""


class RoleQuery(msgspec.Struct, **_tagged(79)):
    """llumnixctl role: set ``instance_id``'s role (empty ``role``: only report it)."""

    query_id: int
    instance_id: str
    role: str = ""


class RoleReply(msgspec.Struct, **_tagged(80)):
    query_id: int
    instance_id: str
    role: str
    previous: str = ""
    moving: int = 0  # requests that no longer fit the new role, to be moved by migration


class Shutdown(msgspec.Struct, **_tagged(33)):
    """manager -> instance: stop (as on SIGTERM: drain, then exit 0). Sent after a remove or scale-in."""

    reason: str = ""


class RequestList(msgspec.Struct, **_tagged(31)):
    query_id: int
    instance_id: str
    requests: list[RequestLoad]  # "migrating": a migration out of here is in progress
    # Requests that migrated out of here lately: id -> the destination's request address (the destination
    # may have answered the same query before it committed: the manager asks it again).
    moved: dict[str, str] = {}


# ---------------------------------------------------------------- proxy -> instance


def _check_traceparent(value: str) -> None:
    if value and len(value) != 55:  # its exact form is checked where it is used (daemons/tracing.py)
        raise ValueError(f"traceparent: {len(value)} characters, not 55")


class Submit(msgspec.Struct, **_tagged(40)):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_to: str  # the proxy's PULL address: token outputs go straight there
    priority: int = 0
    arrival_time: float = 0.0
    epoch: int = 0  # placement epoch (daemons/requests.py); token outputs carry it back
    # A failover: the tokens the client already has. The instance prefills prompt + these and continues at
    # index len(output_token_ids), counting max_tokens as if nothing had happened.
    output_token_ids: list[int] = []
    traceparent: str = ""  # W3C traceparent of the request's span on the proxy (daemons/tracing.py; empty: untraced)
    # The request's SLO as the proxy holds it (its class's [slo] targets, tightened by its API key), ms; 0: none.
    # The instance where it finishes judges it (daemons/instance/attainment.py).
    slo_ttft_ms: float = 0.0
    slo_tpot_ms: float = 0.0
    # The TTFT the proxy predicted when it placed the request here, ms (0: none); the instance judges the
    # prediction's error by it (daemons/instance/attainment.py) and reports it (InstanceLoad ttft_error_*).
    predicted_ttft_ms: float = 0.0
    # The LoRA adapter it runs with ("": the base model) and where the instance loads it from if it holds it not.
    adapter: str = ""
    adapter_path: str = ""
    # The conversation it belongs to (OpenAI's prompt_cache_key, else the session header; "": none) and how long
    # its blocks should stay cached after it ends, s (0: the instance's kv_tier.retain_s).
    session: str = ""
    retain_s: float = 0.0
    # A prefix pull (daemons/policy: predicted shorter than its prefill): before it is queued, the instance copies
    # the prompt's first ``pull_blocks`` full blocks from instance ``pull_from`` (its KV, engine or host tier),
    # over the migration's KV transport; a failed pull is a recompute, nothing else.
    pull_from: str = ""
    pull_blocks: int = 0
    pull_address: str = ""  # the request address of ``pull_from``

    def __post_init__(self) -> None:
        endpoints.check(self.reply_to, "reply_to")
        _check_traceparent(self.traceparent)


class Abort(msgspec.Struct, **_tagged(41)):
    request_id: str
    epoch: int = 0  # abort only the copy of this placement epoch (0: whichever copy is there)


class ProxyAlive(msgspec.Struct, **_tagged(42)):
    """proxy -> instance, every heartbeat: this proxy still reads its token path. An instance aborts the
    requests of a proxy it has not heard from for instance.orphan_timeout_s."""

    token_address: str

    def __post_init__(self) -> None:
        endpoints.check(self.token_address, "token_address")


# ---------------------------------------------------------------- instance -> proxy (token path)


class TokenOut(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # scalars only: never in a cycle
    request_id: str
    index: int  # position in the request's output, from 0; the proxy emits each index once, in order
    token_id: int
    finish_reason: str | None = None  # None while running; "stop" | "length" | "abort"
    logprob: float | None = None
    epoch: int = 0  # placement epoch of the copy that produced it: the proxy takes only its current owner's
    # With sampling.logprobs = k > 0: the k most likely tokens at this position, (token id, logprob), most
    # likely first (vLLM's top-k; the sampled token may or may not be among them). Never forms a cycle.
    top: list[tuple[int, float]] | None = None


class TokenBatch(msgspec.Struct, **_tagged(50)):
    instance_id: str
    outputs: list[TokenOut]


class RequestFailed(msgspec.Struct, **_tagged(51)):
    request_id: str
    instance_id: str
    message: str
    retryable: bool = False  # True: nothing was generated, another instance may take it
    status: int = 503  # HTTP status the client should see if it is not retried: 400 = the request itself is bad


class Redispatch(msgspec.Struct, **_tagged(53)):
    """instance -> proxy: this request is queued here and produced nothing; dispatch it again elsewhere
    (the instance is draining). Not a failure: it does not count against the proxy's dispatch attempts."""

    request_id: str
    instance_id: str
    reason: str = ""


class Moved(msgspec.Struct, **_tagged(52)):
    """A migration committed: the request's next tokens come from ``instance_id``; aborts go to ``request_address``."""

    request_id: str
    instance_id: str
    request_address: str
    epoch: int = 0  # the placement epoch the new owner claims
    from_index: int = 0  # the first output index it produces

    def __post_init__(self) -> None:
        endpoints.check(self.request_address, "request_address")


class Heartbeat(msgspec.Struct, **_tagged(54)):
    """instance -> every proxy it serves, each heartbeat interval: it is alive (and whether its engine makes
    progress). Proxies judge instance liveness from these even while the manager is away."""

    instance_id: str
    request_address: str
    healthy: bool = True  # False: a step has run past instance.step_timeout_s (streams fail over)
    load: InstanceLoad | None = None
    accepting: bool = True  # takes new requests (not draining, cordoned or stopping)
    taken: int = 0  # Submits from this proxy taken in by the step boundary whose load this is (monotonic)
    cache_epoch: int = 0  # its prefix cache's incarnation (0: it publishes none) and the last CacheEvents seq
    cache_seq: int = 0

    def __post_init__(self) -> None:
        endpoints.check(self.request_address, "request_address")


# ---------------------------------------------------------------- migration


class MigratingRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """What a destination needs to build a migrating request before its KV arrives (sent at stage 0)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_to: str  # the owning proxy's token address: the destination sends the following tokens there
    priority: int = 0
    arrival_time: float = 0.0
    max_total: int = 0  # the most tokens it may reach on the source (prompt + max_tokens, capped by its context)
    traceparent: str = ""  # the request's trace, as the proxy sent it (wire.Submit)
    # Its SLO (wire.Submit) and what the source measured of it, so that the instance where it finishes judges it:
    # when its first token went out (wall clock, as arrival_time; 0: not yet) and at which output index.
    slo_ttft_ms: float = 0.0
    slo_tpot_ms: float = 0.0
    first_token_time: float = 0.0
    first_token_index: int = 0
    adapter: str = ""  # its LoRA adapter (wire.Submit): the destination holds it, or loads it, before stage 0
    adapter_path: str = ""
    # Its session and the retention it asked for (wire.Submit): where it ends, its blocks are retained for the session.
    session: str = ""
    retain_s: float = 0.0

    def __post_init__(self) -> None:
        endpoints.check(self.reply_to, "reply_to", empty_ok=True)  # empty until the source sets it
        _check_traceparent(self.traceparent)


class RequestState(msgspec.Struct, array_like=True, omit_defaults=True):
    """The rest of a request at the moment its source suspended it (sent with the last stage)."""

    output_token_ids: list[int]
    emitted: int  # index of the next token the client is to see
    engine_state: bytes = b""  # backend-specific sampler state (a seeded generator's state), opaque
    epoch: int = 0  # the source's placement epoch: the destination commits as epoch + 1


class MigrationOutcome(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    src: str
    dst: str
    outcome: str  # "committed" | "aborted"
    reason: str = ""
    stages: int = 0  # copy stages run, the last one included
    blocks: int = 0
    bytes: int = 0
    downtime_ms: float = 0.0  # suspend on the source to commit acknowledged (0 if it never suspended)
    total_ms: float = 0.0
    resumed_at: int = -1  # output index of the first token the destination produced (-1: not committed)
    cached_blocks: int = 0  # blocks not sent: the destination held them already (prefix cache)
    last_stage_blocks: int = 0  # blocks the last stage (the request's downtime) copied
    # How the source's state machine ended (daemons/migration/move.py): committed, aborted-src (the request
    # finished or was preempted, ...), aborted-dst (the destination refused, died or did not answer) or
    # uncertain (no answer to the last stage: resumed here, the proxy keeps one copy).
    ended: str = ""
    # Of downtime_ms, the destination's part after the blocks were in place: its wait for a step boundary (up to
    # one of its steps) and the commit. The rest is the copy: the last stage's message, blocks and answer.
    join_ms: float = 0.0


class MigrateQuery(msgspec.Struct, **_tagged(60)):
    """llumnixctl -> manager: move one request (request_id) or ``count`` requests of ``src`` to ``dst``."""

    query_id: int
    dst: str
    request_id: str = ""
    src: str = ""
    count: int = 1
    blocking: bool = False  # stop-and-copy instead of pre-copy (a baseline for benchmarks)


class MigrateReply(msgspec.Struct, **_tagged(61)):
    query_id: int
    outcomes: list[MigrationOutcome]


class MigrateStart(msgspec.Struct, **_tagged(62)):
    """manager -> source instance: migrate these requests (or ``count`` chosen by the instance) to ``dst``."""

    query_id: int
    dst: str
    dst_address: str  # the destination's request socket
    request_ids: list[str] = []
    count: int = 0
    blocking: bool = False  # no pre-copy: suspend first, then copy everything (the stop-and-copy baseline)
    # Manager-ordered migrations (empty reason: an operator's). The source chooses ``count`` requests with
    # ``selection`` and sends only those whose move lowers the pair's imbalance (unless ``drain``), judged
    # with the manager's view of both instances' virtual usage.
    reason: str = ""  # "balance" | "drain"
    selection: str = ""
    drain: bool = False
    src_usage: float = 0.0
    dst_usage: float = 0.0
    dst_blocks: int = 0
    headroom: float = 0.0
    cooldown_s: float = 0.0
    dst_free_blocks: float = -1.0  # the destination's free blocks (-1: unknown): the chosen ones must fit

    def __post_init__(self) -> None:
        endpoints.check(self.dst_address, "dst_address")


class MigrateResult(msgspec.Struct, **_tagged(63)):
    query_id: int
    instance_id: str
    outcomes: list[MigrationOutcome]


class MigStage(msgspec.Struct, **_tagged(64)):
    """source -> destination: get ready to receive blocks [first_block, first_block + n_blocks) of the
    request over Gloo; the destination then covers ``tokens`` tokens. Stage 0 carries the request, the
    KV layout and how to reach the source's KV transfer; the last stage carries the request state."""

    mig_id: str
    stage: int
    tokens: int
    first_block: int
    n_blocks: int
    last: bool = False
    request: MigratingRequest | None = None
    state: RequestState | None = None
    kv_spec: str = ""
    src: str = ""
    kv_address: str = ""  # host:port of the source's rendezvous store
    pair_key: str = ""  # names the Gloo pair group (formed on first use, reused after)
    chunk_blocks: int = 0  # blocks per Gloo message
    await_ready: bool = True  # False (a last stage after stage 0): the blocks follow at once, no MigReady
    tail_tokens: int = 0  # > 0: the last of the n_blocks travels as only its first tail_tokens token slots


class MigReady(msgspec.Struct, **_tagged(65)):
    mig_id: str
    stage: int
    ok: bool = True
    reason: str = ""
    # (stage 0) leading blocks of the request the destination holds already (its prefix cache): not sent
    cached_blocks: int = 0


class MigDone(msgspec.Struct, **_tagged(66)):
    """The stage's blocks are written (the last stage: the request is committed and running)."""

    mig_id: str
    stage: int
    ok: bool = True
    reason: str = ""
    # The last stage: how long the destination took from the blocks in place to the request committed (its
    # wait for a step boundary, then the commit), a part of the request's downtime.
    join_ms: float = 0.0


class MigAbort(msgspec.Struct, **_tagged(67)):
    mig_id: str
    reason: str = ""


class PrefixQuery(msgspec.Struct, **_tagged(68)):
    """source -> destination, before a source chooses what to send: of each prompt, how many leading full
    blocks does your prefix cache hold? (Those would not move: see MigReady.cached_blocks.)"""

    query_id: int
    prompts: list[list[int]]


class PrefixHits(msgspec.Struct, **_tagged(69)):
    query_id: int
    blocks: list[int]  # one per prompt of the query, in its order


class PullAsk(msgspec.Struct, **_tagged(110)):
    """instance -> instance, a prefix pull (daemons/migration/pulls.py): send me these blocks (vLLM block hashes,
    in prompt order) of your KV, engine or host tier, the leading ones you hold; ``kv_spec``: my KV layout
    (a holder whose layout differs sends nothing)."""

    pull_id: int
    instance_id: str  # the asker's
    hashes: list[bytes]
    kv_spec: str = ""
    session: str = ""  # a re-homed session's (wire.RehomePull): once sent, the holder stops retaining its blocks

    def __post_init__(self) -> None:
        if len(self.hashes) > 1 << 16 or any(len(h) > 64 for h in self.hashes):
            raise ValueError("PullAsk: too many hashes, or one too long")


class PullOffer(msgspec.Struct, **_tagged(111)):
    """holder -> asker: the first ``blocks`` of the hashes asked for follow over the KV pair ``pair_key`` (the
    holder has posted the send), ``nbytes`` bytes in all; 0 blocks: nothing (``reason`` says why)."""

    pull_id: int
    blocks: int = 0
    nbytes: int = 0
    pair_key: str = ""
    store_address: str = ""
    reason: str = ""


class Rehome(msgspec.Struct, **_tagged(112)):
    """manager -> a hot instance: move up to ``count`` of your idle sessions' KV (retained after their last turn,
    none running now) to ``dst``'s host tier, least recently used first (daemons/migration/rehome.py)."""

    dst: str
    dst_address: str  # its request socket
    count: int = 1

    def __post_init__(self) -> None:
        endpoints.check(self.dst_address, "dst_address")


class RehomePull(msgspec.Struct, **_tagged(113)):
    """hot instance -> cool instance: pull session ``session``'s blocks (``hashes``, in prompt order) from me (at
    ``address``) into your host tier and retain them there for ``retain_s``."""

    instance_id: str
    address: str  # the hot instance's request socket
    session: str
    hashes: list[bytes]
    retain_s: float = 0.0

    def __post_init__(self) -> None:
        endpoints.check(self.address, "address")
        if len(self.hashes) > 1 << 16 or any(len(h) > 64 for h in self.hashes):
            raise ValueError("RehomePull: too many hashes, or one too long")


class KvRendezvous(msgspec.Struct, **_tagged(78)):
    """instance <-> instance, on the migration channel: one end of a KV pair wrote its Gloo address (daemons/
    kv/transfer.py RelayStore); the other end keeps it for the pair named ``pair_key``."""

    pair_key: str
    key: str
    value: bytes

    def __post_init__(self) -> None:
        if len(self.pair_key) > 200 or len(self.key) > 256 or len(self.value) > 4096:
            raise ValueError("KvRendezvous: a key or value past its bound")


# ---------------------------------------------------------------- operations (llumnixctl) <-> manager


class DrainQuery(msgspec.Struct, **_tagged(70)):
    """Drain (every request moves out, no new ones), undrain, cordon (no new ones) or uncordon."""

    query_id: int
    instance_id: str
    drain: bool = True
    cordon_only: bool = False


class DrainReply(msgspec.Struct, **_tagged(71)):
    query_id: int
    instance: InstanceView


class RemoveQuery(msgspec.Struct, **_tagged(72)):
    """Drain the instance, then tell it to stop; answered once it said goodbye (or with an error)."""

    query_id: int
    instance_id: str
    timeout_s: float = 300.0


class RemoveReply(msgspec.Struct, **_tagged(73)):
    query_id: int
    instance_id: str
    drained_s: float  # from the query to no request left on it
    migrated: int = 0  # migrations out of it that committed meanwhile
    was_dead: bool = False  # it was dead: forgotten, nothing to drain or stop


class AddQuery(msgspec.Struct, **_tagged(74)):
    """Start ``count`` instances with the scaling launcher; answered once they registered (or with an error)."""

    query_id: int
    count: int = 1
    timeout_s: float = 0.0  # 0: scaling.launch_timeout_s


class AddReply(msgspec.Struct, **_tagged(75)):
    query_id: int
    instance_ids: list[str]


class PolicyQuery(msgspec.Struct, **_tagged(76)):
    """Show the manager's policies, or change them at run time (empty: leave as is)."""

    query_id: int
    dispatch_policy: str = ""
    pairing_policy: str = ""
    request_selection: str = ""
    scaling_policy: str = ""


class PolicyReply(msgspec.Struct, **_tagged(77)):
    query_id: int
    dispatch_policy: str
    pairing_policy: str
    request_selection: str
    scaling_policy: str
    migrating: bool = False


MAX_CACHE_KEYS = 1 << 21  # block keys in one CacheEvents (a whole cache of two million blocks)


class AdapterOutcome(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one instance did with a LoRA order."""

    instance_id: str
    ok: bool
    message: str = ""


class AdapterRow(msgspec.Struct, array_like=True, omit_defaults=True):
    """One adapter the cluster serves: where it loads from, and the instances that hold it now."""

    name: str
    path: str
    instances: list[str] = []


class LoraQuery(msgspec.Struct, **_tagged(81)):
    """llumnixctl or a proxy -> manager: load an adapter (on ``instances``, default: every instance, within
    lora.max_replicas), unload it (everywhere), or list them (``op`` "load" | "unload" | "list")."""

    query_id: int
    op: str
    name: str = ""
    path: str = ""
    instances: list[str] = []


class LoraReply(msgspec.Struct, **_tagged(82)):
    query_id: int
    adapters: list[AdapterRow] = []
    outcomes: list[AdapterOutcome] = []


class LoraOrder(msgspec.Struct, **_tagged(83)):
    """manager -> instance: load (``path``) or unload the adapter ``name``; answered by a LoraResult."""

    query_id: int
    op: str  # "load" | "unload"
    name: str
    path: str = ""


class LoraResult(msgspec.Struct, **_tagged(84)):
    query_id: int
    instance_id: str
    ok: bool
    message: str = ""


class CacheEvents(msgspec.Struct, **_tagged(55)):
    """instance -> manager and every proxy it serves: what its prefix cache stored and removed since the last
    batch (64-bit block keys, daemons/prefix.py; each key in one list, its state after the batch), or the whole
    cache (``full``, answering a CacheSync); ``host_*``: the same for its host-memory KV tier. ``epoch``: the
    cache's incarnation (a new one after a restart); ``seq``: the batch's number in it (a full one carries the
    number of the last batch it includes)."""

    instance_id: str
    epoch: int
    seq: int
    stored: list[int] = []
    removed: list[int] = []
    full: bool = False
    host_stored: list[int] = []  # the same for the instance's host-memory KV tier (a full batch: all it holds)
    host_removed: list[int] = []

    def __post_init__(self) -> None:
        if len(self.stored) + len(self.removed) > MAX_CACHE_KEYS:
            raise ValueError(f"more than {MAX_CACHE_KEYS} block keys")


class CacheSync(msgspec.Struct, **_tagged(43)):
    """proxy -> instance (request socket) or manager -> instance: send your whole prefix cache (CacheEvents
    with ``full``): the asker restarted, or missed a batch."""

    reply_to: str = ""  # the asking proxy's token address; "" from the manager

    def __post_init__(self) -> None:
        if self.reply_to:
            endpoints.check(self.reply_to, "reply_to")


Message = (
    Register
    | RegisterAck
    | LoadReport
    | Goodbye
    | Dispatch
    | DispatchReply
    | SnapshotQuery
    | Snapshot
    | Dispatched
    | StatusQuery
    | RequestsQuery
    | RequestsReply
    | SessionsQuery
    | SessionsReply
    | ErrorReply
    | ListRequests
    | RequestList
    | SetDraining
    | Shutdown
    | SetRole
    | HandoverReady
    | PeerDead
    | PeerLink
    | LinkOpen
    | LinkReady
    | RoleQuery
    | RoleReply
    | Submit
    | Abort
    | ProxyAlive
    | TokenBatch
    | RequestFailed
    | Moved
    | Redispatch
    | Heartbeat
    | MigrateQuery
    | MigrateReply
    | MigrateStart
    | MigrateResult
    | MigStage
    | MigReady
    | MigDone
    | MigAbort
    | PrefixQuery
    | PrefixHits
    | KvRendezvous
    | PullAsk
    | PullOffer
    | Rehome
    | RehomePull
    | DrainQuery
    | DrainReply
    | RemoveQuery
    | RemoveReply
    | AddQuery
    | AddReply
    | PolicyQuery
    | PolicyReply
    | CacheEvents
    | CacheSync
    | LoraQuery
    | LoraReply
    | LoraOrder
    | LoraResult
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(frame: bytes) -> Message | None:
    """Decode one frame; a frame that does not decode is logged and dropped (returns None)."""
    try:
        return _decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("dropped malformed frame (%d bytes): %s", len(frame), exc)
        return None
