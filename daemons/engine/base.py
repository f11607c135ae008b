"""The engine interface: the verbs the llumlet uses, and nothing else.

An engine is continuous batching over a paged KV cache. The instance daemon drives it from one thread:
it adds and aborts requests between steps, calls ``step()`` in a loop while there is work, and reads
``load()`` after each step. Engines never touch sockets; the daemon never touches engine internals.

Migration verbs (source: candidates, block ids, gather, suspend, resume, release; destination: reserve,
scatter, commit, release) are declared here so both backends grow them with one shape; they are built by
the live-migration work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from daemons.wire import InstanceLoad, RequestLoad, SamplingParams, TokenOut


class EngineError(Exception):
    """A request the engine cannot take (too long, bad parameters). The message is shown to the client."""


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0


def check_request(request: EngineRequest, in_use: bool, max_model_len: int, vocab_size: int | None = None) -> None:
    """The checks every engine makes before queueing a request; raises EngineError with the client's message."""
    n = len(request.prompt_token_ids)
    if n == 0:
        raise EngineError("prompt is empty; send at least one token")
    if in_use:
        raise EngineError(f"request id {request.request_id!r} is already in use on this instance")
    if n + 1 > max_model_len:
        raise EngineError(f"prompt is {n} tokens; this model's context limit is {max_model_len} "
                          "(prompt plus at least one generated token)")
    if request.sampling.max_tokens < 1:
        raise EngineError(f"max_tokens must be at least 1; got {request.sampling.max_tokens}")
    if vocab_size is not None:
        bad = next((t for t in request.prompt_token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise EngineError(f"prompt token id {bad} is out of range for this model's vocabulary (0..{vocab_size - 1})")


@dataclass
class StepResult:
    outputs: list[TokenOut] = field(default_factory=list)
    # Seconds the step should take in model time. The sim engine computes no model, so it returns its
    # latency model's figure and the daemon waits out the rest; a real engine returns 0.0 (it already spent it).
    model_time_s: float = 0.0


class Engine(Protocol):
    backend: str
    block_size: int
    max_model_len: int

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
