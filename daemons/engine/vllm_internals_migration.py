"""vLLM's internals (daemons/engine/vllm_internals.py), continued: a request taken out of the scheduler and put back, built from a migrated one, its blocks allocated (with the prefix cache) and freed, and committed with its sampler state. Checked against the same vLLM
version (``vllm_internals.TESTED_VERSION``)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from functools import partial

from daemons.engine.base import EngineError
from daemons.engine.vllm_internals_state import VllmState
from daemons.engine.vllm_worker import commit_runner_state, generator_state

log = logging.getLogger("llumnix.engine.vllm")


def _committed(request_id: str, done: Future) -> None:
    """A rank's failure to take a migrated request's runner state: its next step fails on that rank too
    (the engine's failure path); this says why."""
    exc = done.exception()
    if exc is not None:
        log.error("the ranks did not take migrated request %s's runner state: %s", request_id, exc)


class VllmMoves:
    """Requests taken out of vLLM's scheduler and put in, through ``state`` (a ``VllmState``: vLLM's names,
    core, scheduler, cache manager, runner). It owns the set of reservations it made: requests that hold blocks
    but are not in the scheduler."""

    def __init__(self, state: VllmState):
        self._s = state
        self._held: set[str] = set()

    def is_running(self, req) -> bool:
        return req.status == self._s.m.RUNNING and req.num_output_placeholders == 0 and not req.spec_token_ids

    def suspend(self, req) -> bytes:
        self._s.scheduler.running.remove(req)
        if self._s.in_process:
            return generator_state(self._s.runner(), req.request_id)
        if req.sampling_params.sampling_type != self._s.m.RANDOM_SEED:
            return b""  # the runner keeps a generator only for a seeded request: no round trip to the ranks
        return self._s.rpc("llumnix_generator_state", req.request_id)[0]  # every rank samples alike

    def resume(self, req) -> None:
        """Back into the batch; if its slot was taken meanwhile (the scheduler filled the batch from its queue while
        the request was out), preempted as vLLM preempts: to the head of the queue, its KV recomputed."""
        if self.slot_free():
            self._s.scheduler.running.append(req)
            return
        log.info("request %s resumes preempted: its batch slot was taken while it was suspended", req.request_id)
        self._s.scheduler._preempt_request(req, time.monotonic())

    def slot_free(self) -> bool:
        """Whether the batch has room for one more running request (vLLM's max_num_seqs)."""
        return len(self._s.scheduler.running) < self._s.scheduler.max_num_running_reqs

    def drop_suspended(self, req) -> None:
        self._s.scheduler.running.append(req)  # so the scheduler's own abort path finds it where it expects
        self._s.core.abort_requests([req.request_id])

    def build(self, request_id: str, prompt: list[int], params, arrival_time: float, priority: int, lora=None):
        """A vLLM ``Request`` for our ``priority`` (1 = high), which vLLM serves first as -1; ``lora``: its
        ``LoRARequest`` (vLLM keys its prefix cache's blocks by it too)."""
        ecr = self._s.m.EngineCoreRequest(
            request_id=request_id, prompt_token_ids=prompt, mm_features=None, sampling_params=params,
            pooling_params=None, arrival_time=arrival_time, lora_request=lora, cache_salt=None,
            data_parallel_rank=None, priority=-priority)
        req, _wave = self._s.core.preprocess_add_request(ecr)
        return req

    def allocate_first(self, req, tokens: int) -> tuple[list[int], int] | None:
        """The first hold of an incoming request: with prefix caching, the blocks of its prompt's longest
        cached prefix are taken from the cache (shared, counted once: only the rest is new), and how many
        leading blocks that is comes back with the block ids."""
        if not self._s.config.cache_config.enable_prefix_caching:
            blocks = self.allocate(req, tokens)
            return None if blocks is None else (blocks, 0)
        computed, hit, _ = self._s.kv.get_computed_blocks(req)
        if not hit:
            blocks = self.allocate(req, tokens)
            return None if blocks is None else (blocks, 0)
        if self._allocate(req, tokens - hit, hit, computed) is None:
            return None
        return self._s.block_ids(req.request_id), hit // self._s.block_size

    def prefix_hits(self, prompts: list[list[int]], params) -> list[int]:
        """Of each prompt, the leading full blocks its longest cached prefix covers here now (as the first
        hold of a migrating request with that prompt would find them)."""
        if not self._s.config.cache_config.enable_prefix_caching:
            return [0] * len(prompts)
        hits = []
        for i, prompt in enumerate(prompts):
            if len(prompt) <= self._s.block_size:
                hits.append(0)
                continue
            probe = self.build(f"llumnix-prefix-probe-{i}", list(prompt), params, time.time(), 0)
            _, hit, _ = self._s.kv.get_computed_blocks(probe)
            hits.append(hit // self._s.block_size)
        return hits

    def allocate(self, req, tokens: int) -> list[int] | None:
        """Grow ``req``'s blocks to cover ``tokens`` tokens (num_computed_tokens stays 0 until commit)."""
        have = len(self._s.kv.get_block_ids(req.request_id)[0]) if req.request_id in self._held else 0
        if -(-tokens // self._s.block_size) <= have:
            return self._s.block_ids(req.request_id)
        if self._allocate(req, tokens) is None:
            return None
        return self._s.block_ids(req.request_id)

    def _allocate(self, req, new_tokens: int, hit: int = 0, computed=None):
        blocks = self._s.kv.allocate_slots(req, new_tokens, num_new_computed_tokens=hit, new_computed_blocks=computed,
                                        delay_cache_blocks=True)
        if blocks is None:
            return None
        self._held.add(req.request_id)
        new = set(blocks.get_block_ids()[0])
        for manager in getattr(self._s.kv.coordinator, "single_type_managers", ()):
            pending = getattr(manager, "new_block_ids", None)
            if pending:  # the runner would zero these at the next step, perhaps after we wrote them
                manager.new_block_ids = [b for b in pending if b not in new]
        return blocks

    def free(self, req) -> None:
        self._held.discard(req.request_id)
        self._s.kv.free(req)

    # A request under a grammar (vLLM's structured output) carries a matcher that has accepted every token it
    # sampled. ``build`` starts compiling a new one (vLLM compiles on a thread: ``StructuredOutputRequest.grammar``
    # is a Future until then, and the scheduler holds the request in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR);
    # before the request's first step here, the matcher must accept what was generated elsewhere.
    GRAMMAR_WAIT_S = 30.0

    def advance_grammar(self, req, tokens: list[int]) -> None:
        """A failover's request: once its grammar is compiled, it accepts ``tokens`` (the client's), before the
        scheduler sees the grammar ready. A grammar that rejects them fails the request as a bad grammar does."""
        so = req.structured_output_request
        rid, tokens = req.request_id, list(tokens)

        def advanced(grammar):
            if not grammar.accept_tokens(rid, tokens):
                raise ValueError(f"the grammar rejects the {len(tokens)} tokens already generated")
            return grammar

        compiling = so._grammar
        if not isinstance(compiling, Future):
            so.grammar = advanced(compiling)
            return
        ready: Future = Future()

        def chain(done: Future) -> None:
            try:
                ready.set_result(advanced(done.result()))
            except Exception as exc:  # the scheduler fails the request with it, as a grammar that did not compile
                ready.set_exception(exc)

        so.grammar = ready
        compiling.add_done_callback(chain)

    def _grammar_at(self, req, outputs: list[int]) -> None:
        """A migrated request: its grammar (compiling since the first stage) accepts the outputs the source
        generated, now, so the destination's first step is masked where the source's next would have been."""
        so = req.structured_output_request
        compiling = so._grammar
        try:
            grammar = compiling.result(timeout=self.GRAMMAR_WAIT_S) if isinstance(compiling, Future) else compiling
        except Exception as exc:
            raise EngineError(f"its grammar did not compile here: {exc}") from exc
        so.grammar = grammar
        if not grammar.accept_tokens(req.request_id, list(outputs)):
            raise EngineError(f"its grammar rejects the {len(outputs)} tokens generated on the source")

    def commit(self, req, outputs: list[int], engine_state: bytes) -> None:
        if req.use_structured_output:
            self._grammar_at(req, outputs)
        self._held.discard(req.request_id)
        req.append_output_token_ids(outputs)
        req.num_computed_tokens = req.num_tokens - 1  # the last sampled token's KV is computed by the next step
        req.num_cached_tokens = req.num_computed_tokens
        req.status = self._s.m.RUNNING
        if self._s.config.cache_config.enable_prefix_caching:
            self._s.kv.cache_blocks(req, req.num_computed_tokens)
        params = req.sampling_params
        rid = req.request_id
        came_back = rid in self._s.scheduler.finished_req_ids
        if came_back:  # it left this engine (migrated away) and came back before a step let the runner forget it
            self._s.scheduler.finished_req_ids.discard(rid)
        args = (rid, req.prompt_token_ids, params, params.sampling_type == self._s.m.RANDOM_SEED, engine_state,
                list(self._s.block_ids(rid)), req.num_computed_tokens, list(req.output_token_ids), came_back,
                req.lora_request)
        if self._s.in_process:
            commit_runner_state(self._s.runner(), self._s.m.CachedRequestState, *args)
        else:
            # Not waited for: the ranks take it before the step that first schedules the request (their queue is
            # in order), so the commit, which is downtime, is not a round trip to every rank.
            self._s.post("llumnix_commit", *args).add_done_callback(partial(_committed, rid))
        self._s.scheduler.requests[req.request_id] = req
        self._s.scheduler.running.append(req)
