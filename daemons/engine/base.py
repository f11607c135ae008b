"""The engine interface: the verbs the llumlet uses, and nothing else.

An engine is continuous batching over a paged KV cache. The instance daemon drives it from one thread:
it adds and aborts requests between steps, calls ``step()`` in a loop while there is work, and reads
``load()`` after each step. Engines never touch sockets; the daemon never touches engine internals.

Migration verbs (source: view, gather, suspend, resume, drop; destination: reserve, scatter, commit,
release) move one running request with its KV cache to another engine of the same KV layout. The llumlet
runs the protocol (daemons/migration/); engines only do what each verb says, between steps. ``gather``
and ``scatter`` are the exception: they touch only blocks no step writes (full blocks of a running
request, reserved blocks of an incoming one), so the llumlet runs them on its transfer thread while the
engine keeps stepping.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from daemons.kv.layout import KvBlocks, KvLayout  # noqa: F401  (re-exported: engines build them)
from daemons.wire import InstanceLoad, MigratingRequest, RequestLoad, RequestState, SamplingParams, TokenOut


class EngineError(Exception):
    """A request the engine cannot take (too long, bad parameters). The message is shown to the client."""


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0
    # Tokens this request already produced elsewhere (a failover): the engine prefills prompt + these and
    # continues at index len(output_token_ids); max_tokens and min_tokens count them as already generated.
    output_token_ids: list[int] = field(default_factory=list)
    adapter: str = ""  # its LoRA adapter ("": the base model), loaded from adapter_path first if not held
    adapter_path: str = ""
    # Its conversation ("": none) and how long its blocks are retained after it ends, s (0: kv_tier.retain_s).
    session: str = ""
    retain_s: float = 0.0


def check_request(request: EngineRequest, in_use: bool, max_model_len: int, vocab_size: int | None = None) -> None:
    """The checks every engine makes before queueing a request; raises EngineError with the client's message."""
    n = len(request.prompt_token_ids)
    done = len(request.output_token_ids)
    if n == 0:
        raise EngineError("prompt is empty; send at least one token")
    if in_use:
        raise EngineError(f"request id {request.request_id!r} is already in use on this instance")
    if n + done + 1 > max_model_len:
        raise EngineError(f"prompt is {n} tokens{f' plus {done} generated' if done else ''}; this model's context "
                          f"limit is {max_model_len} (prompt plus at least one generated token)")
    if request.sampling.max_tokens < 1:
        raise EngineError(f"max_tokens must be at least 1; got {request.sampling.max_tokens}")
    if done >= request.sampling.max_tokens:
        raise EngineError(f"the request already has {done} of its {request.sampling.max_tokens} tokens")
    if vocab_size is not None:
        bad = next((t for t in (*request.prompt_token_ids, *request.output_token_ids) if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise EngineError(f"prompt token id {bad} is out of range for this model's vocabulary (0..{vocab_size - 1})")


def check_incoming(request: MigratingRequest, in_use: bool, max_model_len: int,
                   vocab_size: int | None = None) -> EngineRequest:
    """The checks a destination makes before reserving for a migrating request; returns it as an
    EngineRequest. A migrating request must also be able to end where it would have ended on its source."""
    engine_request = EngineRequest(request.request_id, request.prompt_token_ids, request.sampling,
                                   request.arrival_time, request.priority, adapter=request.adapter,
                                   adapter_path=request.adapter_path, session=request.session, retain_s=request.retain_s)
    check_request(engine_request, in_use, max_model_len, vocab_size)
    if request.max_total > max_model_len:
        raise EngineError(f"the request may grow to {request.max_total} tokens; this instance's context limit is "
                          f"{max_model_len}, so it would end early here")
    return engine_request


@dataclass
class StepResult:
    outputs: list[TokenOut] = field(default_factory=list)
    # Seconds the step should take in model time. The sim engine computes no model, so it returns its
    # latency model's figure and the daemon waits out the rest; a real engine returns 0.0 (it already spent it).
    model_time_s: float = 0.0
    # What the step did (the instance's step-time model learns from it: daemons/instance/predictor.py):
    prefill_tokens: int = 0  # prompt tokens computed
    decodes: int = 0  # requests that decoded a token
    context_tokens: int = 0  # tokens those requests held


@dataclass
class MigrationView:
    """A running request as the migration source sees it at a step boundary."""

    block_ids: list[int]  # in token order; blocks past ``computed_tokens`` may be allocated ahead
    computed_tokens: int  # tokens whose KV is written; full blocks below this never change again


class PrefixCacheCounts(Protocol):
    """What the instance reads of an engine's prefix cache for its load reports."""

    query_tokens: int  # prompt tokens looked up at admission
    hit_tokens: int  # of those, found cached (prefill skipped)
    # Prompt tokens of new requests by where their KV came from: "engine" (its prefix cache), "host" (restored
    # from the host tier), "recomputed" (prefilled); monotonic.
    by_source: dict[str, int]


class TierCounts(Protocol):
    """What the instance reads of an engine's host KV tier (daemons/engine/tier.py ``HostTier``)."""

    capacity: int  # blocks
    block_nbytes: int
    restored_blocks: int  # monotonic
    restored_bytes: int  # monotonic
    restore_ms_per_block: float  # measured (an estimate before the first restore)
    retention: object  # its sessions' retention (tier.py ``Retention``; None: kv_tier.retain_s = 0): what re-homing moves

    def __len__(self) -> int: ...  # blocks held

    def take_restore_times(self) -> list[float]: ...  # seconds of each restore since the last call


class AdapterVerbs(Protocol):
    """What the instance asks of an engine's LoRA adapters (daemons/engine/adapters.py holds their table)."""

    loads: int  # monotonic: adapters loaded
    evictions: int  # monotonic: of those, unloaded to make room for another

    def load(self, name: str, path: str) -> bool:
        """Hold ``name`` from ``path`` (False: held already), unloading the least recently used adapter without
        running requests if every slot is taken. EngineError names the adapter and what is wrong."""

    def unload(self, name: str) -> bool:
        """Unload ``name``, at once or when its running requests end. False if it is not held."""

    def rows(self) -> list:
        """The adapters held (``Adapter``), most recently used first."""


class Engine(Protocol):
    backend: str
    block_size: int
    max_model_len: int
    vocab_size: int  # token ids are 0 .. vocab_size - 1
    prefix_caching: bool  # it keeps a prefix cache: a source asks its destination what it holds (prefix_hits)

    # ---- capabilities (``EngineDefaults`` gives each the answer of an engine that lacks it)
    blocking_step: bool  # a step is real compute: the instance runs it on a thread of its own
    prefill_budget: int  # most prompt tokens one step prefills (0: unknown), for the step-time model
    cache: PrefixCacheCounts | None  # its prefix cache, whose blocks the instance publishes; None: none
    adapters: AdapterVerbs | None  # its LoRA adapters (lora.slots > 0); None: it serves none
    tier: TierCounts | None  # its host-memory KV tier (kv_tier.host_mb); None: none

    def init_thread(self) -> None:
        """First thing on the engine's step thread (``blocking_step`` engines), before any step."""

    def kv_ranks(self) -> tuple[list[str], str] | None:
        """Where its KV lives when not in this process: each tensor-parallel rank's KV control endpoint and
        their directory (the KV transport drives the ranks there); None for a KV in this process. The first
        call comes before the first step."""

    # ---- serving
    def add_request(self, request: EngineRequest) -> None:
        """Queue a request (FCFS). Raises EngineError if it can never run here."""

    def abort_request(self, request_id: str) -> bool:
        """Drop a request and free its blocks. False if unknown (already finished)."""

    def has_work(self) -> bool:
        """True while any request is running or waiting."""

    def step(self) -> StepResult:
        """Run one scheduling step: admit, prefill or decode, return one token per request that advanced."""

    def load(self) -> InstanceLoad:
        """Blocks, running and waiting counts, preemptions; cheap enough to call after every step."""

    def requests(self) -> list[RequestLoad]:
        """Every request the engine holds, running first."""

    def shutdown(self) -> None:
        """Release resources (threads, memory). Idempotent."""

    # ---- prefix cache and host tier (daemons/engine/tier.py)
    def cache_events(self) -> list[tuple]:
        """(stored?, block key) of every prefix-cache change since the last call, and (stored?, key, prefix.HOST)
        of every host-tier change ([] without a cache)."""

    def cache_snapshot(self) -> list[int]:
        """Every block key its prefix cache holds now."""

    def tier_snapshot(self) -> list[int]:
        """Every block key its host tier holds now ([] without one)."""

    def export_blocks(self, hashes: list[bytes]) -> tuple[int, Any]:
        """The leading blocks of these block hashes held in the engine or its tier: (n, payload), the payload
        one contiguous uint8 CPU tensor of n blocks, block-major (daemons/engine/tier.py). Between steps."""

    def import_blocks(self, hashes: list[bytes], payload: Any) -> int:
        """Store such blocks (``export_blocks``' layout) in the host tier, whence a request's lookup restores
        them; returns how many were new there. EngineError without a tier. Between steps."""

    # ---- migration, source side
    def kv_blocks(self) -> KvBlocks:
        """The KV tensors as blocks (built once; ``spec`` must match the peer's)."""

    def migration_view(self, request_id: str) -> MigrationView | None:
        """The request's blocks and written tokens if it is running and may migrate now, else None."""

    def migrating_request(self, request_id: str) -> MigratingRequest:
        """What the destination needs to build the request (prompt, sampling, priority). KeyError if unknown."""

    def suspend(self, request_id: str) -> RequestState:
        """Stop stepping the request, keeping its blocks; return its state (outputs, counters, sampler state)."""

    def resume(self, request_id: str) -> None:
        """Undo ``suspend``: the request steps again where it was."""

    def drop_migrated(self, request_id: str) -> None:
        """Free a suspended request after the destination committed it; emits nothing."""

    # ---- migration, destination side
    def reserve(self, request: MigratingRequest, tokens: int) -> list[int]:
        """Hold blocks for ``tokens`` tokens of an incoming request (first call) or grow that hold; returns
        all its block ids. Raises EngineError if there is no room or the request is invalid here."""

    def cached_blocks(self, request_id: str) -> int:
        """Of a reservation, the leading blocks that hold the request's KV already (its prompt's prefix
        found in this engine's prefix cache at the first ``reserve``): the source need not send them."""

    def prefix_hits(self, prompts: list[list[int]]) -> list[int]:
        """Of each prompt, how many leading full blocks this engine's prefix cache holds now: what a
        migration of a request with that prompt to here would not need to send (zeros: no prefix cache)."""

    def commit(self, request_id: str, state: RequestState) -> None:
        """Insert the reserved request as running with its KV written: it continues at its next token."""

    def release(self, request_id: str) -> bool:
        """Free a reservation that will not be committed. False if there is none."""


class EngineDefaults:
    """The capabilities of the ``Engine`` protocol as an engine without them has them: a step that is quick
    (run on the event loop), no step-thread set-up, no known prefill budget, no prefix cache, its KV in this
    process. An engine inherits this and overrides what it has."""

    blocking_step = False
    prefill_budget = 0
    cache: PrefixCacheCounts | None = None
    adapters: AdapterVerbs | None = None
    tier: TierCounts | None = None

    def init_thread(self) -> None:
        return None

    def kv_ranks(self) -> tuple[list[str], str] | None:
        return None



class MigrationParts:
    """The Engine protocol's migration verbs as the engine's part ``_migrations`` does them (``SimEngineMigrations``,
    ``VllmMigrations``, which the engine builds): both engines hand these verbs over unchanged. An engine inherits
    this beside ``EngineDefaults``; ``cached_blocks`` and ``prefix_hits`` stay the engine's own (they depend on
    its prefix cache)."""

    _migrations: Any

    def migration_view(self, request_id: str) -> MigrationView | None:
        return self._migrations.migration_view(request_id)

    def migrating_request(self, request_id: str) -> MigratingRequest:
        return self._migrations.migrating_request(request_id)

    def suspend(self, request_id: str) -> RequestState:
        return self._migrations.suspend(request_id)

    def resume(self, request_id: str) -> None:
        self._migrations.resume(request_id)

    def drop_migrated(self, request_id: str) -> None:
        self._migrations.drop_migrated(request_id)

    def reserve(self, request: MigratingRequest, tokens: int) -> list[int]:
        return self._migrations.reserve(request, tokens)

    def commit(self, request_id: str, state: RequestState) -> None:
        self._migrations.commit(request_id, state)

    def release(self, request_id: str) -> bool:
        return self._migrations.release(request_id)
