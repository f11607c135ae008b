"""Every message that crosses a ZeroMQ socket, in one place.

Messages are msgspec structs encoded as msgpack arrays (``array_like``) with an integer tag that names
the kind. New fields go at the end, with a default, so that an older peer still decodes a newer message.
KV bytes never travel here; they go over Gloo.

Sockets (see DESIGN.md):
- manager ROUTER  <- instance DEALER   Register, LoadReport, Goodbye / RegisterAck
- manager ROUTER  <- proxy DEALER      Dispatch, SnapshotQuery / DispatchReply, Snapshot
- manager ROUTER  <- llumnixctl DEALER StatusQuery, RequestsQuery / Snapshot, RequestsReply, ErrorReply
- instance ROUTER <- proxy DEALER      Submit, Abort (fire and forget: failures come back on the token path)
- instance ROUTER <- manager           ListRequests / RequestList (for ``llumnixctl requests``)
- proxy PULL      <- instance PUSH     TokenBatch, RequestFailed
"""

from __future__ import annotations

import logging

import msgspec

WIRE_VERSION = 1

log = logging.getLogger("llumnix.wire")


def _tagged(tag: int):
    """Struct config for message kind ``tag`` (integers keep frames small)."""
    return {"tag": tag, "array_like": True, "omit_defaults": True, "tag_field": "k"}


# ---------------------------------------------------------------- shared value types


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


class RequestLoad(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request as an instance sees it."""

    request_id: str
    state: str  # "running" | "waiting" | "preempted" (waiting after recompute preemption)
    blocks: int
    prompt_tokens: int
    output_tokens: int
    priority: int = 0


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


class RegisterAck(msgspec.Struct, **_tagged(2)):
    instance_id: str
    accepted: bool = True
    reason: str = ""


class LoadReport(msgspec.Struct, **_tagged(3)):
    instance_id: str
    seq: int
    load: InstanceLoad


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


class DispatchReply(msgspec.Struct, **_tagged(11)):
    query_id: int
    instance_id: str = ""  # empty: no live instance
    request_address: str = ""
    reason: str = ""


class SnapshotQuery(msgspec.Struct, **_tagged(12)):
    query_id: int


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


class Snapshot(msgspec.Struct, **_tagged(13)):
    query_id: int
    instances: list[InstanceView]
    dispatch_policy: str = ""
    uptime_s: float = 0.0
    dispatched_total: int = 0


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


class ErrorReply(msgspec.Struct, **_tagged(23)):
    query_id: int
    message: str


# ---------------------------------------------------------------- manager -> instance


class ListRequests(msgspec.Struct, **_tagged(30)):
    query_id: int


class RequestList(msgspec.Struct, **_tagged(31)):
    query_id: int
    instance_id: str
    requests: list[RequestLoad]


# ---------------------------------------------------------------- proxy -> instance


class Submit(msgspec.Struct, **_tagged(40)):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_to: str  # the proxy's PULL address: token outputs go straight there
    priority: int = 0
    arrival_time: float = 0.0


class Abort(msgspec.Struct, **_tagged(41)):
    request_id: str


# ---------------------------------------------------------------- instance -> proxy (token path)


class TokenOut(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # scalars only: never in a cycle
    request_id: str
    index: int  # position in the request's output, from 0; the proxy emits each index once, in order
    token_id: int
    finish_reason: str | None = None  # None while running; "stop" | "length" | "abort"
    logprob: float | None = None


class TokenBatch(msgspec.Struct, **_tagged(50)):
    instance_id: str
    outputs: list[TokenOut]


class RequestFailed(msgspec.Struct, **_tagged(51)):
    request_id: str
    instance_id: str
    message: str
    retryable: bool = False  # True: nothing was generated, another instance may take it
    status: int = 503  # HTTP status the client should see if it is not retried: 400 = the request itself is bad


Message = (
    Register
    | RegisterAck
    | LoadReport
    | Goodbye
    | Dispatch
    | DispatchReply
    | SnapshotQuery
    | Snapshot
    | StatusQuery
    | RequestsQuery
    | RequestsReply
    | ErrorReply
    | ListRequests
    | RequestList
    | Submit
    | Abort
    | TokenBatch
    | RequestFailed
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
