"""The vllm engine: vLLM's V1 ``EngineCore`` run in this process, driven one step at a time.

No engine subprocess, no output processor, no detokenizer: the daemon's thread calls ``step()``, which
schedules, runs the model (the ``uni`` executor: the worker lives in this process too) and returns
vLLM's raw per-request outputs, turned here into one ``TokenOut`` per new token. Owning the loop lets the
llumlet reach the scheduler, the KV cache manager and the model runner's KV tensors between steps.

Request ids are passed to vLLM unchanged (we build vLLM's ``EngineCoreRequest`` ourselves and skip the
input processor that appends a random suffix), so vLLM's internal id is the llumnix request id.

Every vLLM name and private attribute this backend touches lives in ``vllm_internals.VllmInternals``, with the
version it was checked against.
"""

from __future__ import annotations

import logging
import os
import time

import msgspec

from daemons.config import KvTierConfig, LoraConfig, ModelConfig, VllmConfig
from daemons.engine.adapters import module_dims
from daemons.engine.base import (EngineDefaults, EngineError, EngineRequest, KvBlocks, MigrationParts, StepResult,
                                  check_request)
from daemons.engine.vllm_cache import VllmPrefixCache
from daemons.engine.vllm_internals import VllmInternals, lower_this_thread, set_env, set_num_threads
from daemons.engine.vllm_internals_tier import build_tiers, need_tiers
from daemons.engine.vllm_lora import VllmAdapters
from daemons.engine.vllm_migration import LiveRequest, LiveRequests, VllmMigrations
from daemons.kv.layout import KvShards
from daemons.ipcdirs import endpoint_dir, remove_endpoint_dir
from daemons.wire import InstanceLoad, RequestLoad, TokenOut

log = logging.getLogger("llumnix.engine.vllm")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ==================================================================== the engine


class VllmEngine(EngineDefaults, MigrationParts):
    """The Engine protocol over vLLM. Not thread-safe: add, abort and step mutate one scheduler, so every
    call must come from one thread (or be serialized), as the protocol says. Its parts: vLLM's internals
    (``VllmInternals``, with ``state`` to read them), the requests it serves (``LiveRequests``) and the migrating
    ones (``VllmMigrations``, to which the migration verbs go)."""

    backend = "vllm"
    blocking_step = True  # a step is milliseconds of model compute: the instance runs it off its event loop

    def __init__(self, model: ModelConfig, vllm: VllmConfig, lora: LoraConfig | None = None,
                 kv_tier: KvTierConfig | None = None, clock=time.monotonic):
        if not model.path:
            raise EngineError("model.path is empty: the vllm backend needs a checkpoint directory "
                              "(write a test model with `llumnixctl model tiny DIR`)")
        set_env(vllm)
        self.cfg = vllm
        lora = lora or LoraConfig()
        self._v = VllmInternals(model, vllm, lora)
        self._s = s = self._v.state
        self.version = s.m.version
        self.block_size = s.block_size
        self.max_model_len = s.max_model_len
        self.vocab_size = s.vocab_size
        self.prefill_budget = self._v.prefill_budget  # most tokens one step schedules
        self.prefix_caching = bool(vllm.enable_prefix_caching)
        # What the instance publishes of vLLM's prefix cache (daemons/engine/vllm_cache.py).
        self.cache = VllmPrefixCache(s.scheduler, s.pool) if self.prefix_caching else None
        self.eos_token_id = self._v.eos_token_id
        # Its LoRA adapters (vllm_lora.py: the Engine protocol's ``adapters``), None with lora.slots = 0.
        self.adapters = adapters = (VllmAdapters(self._v.lora, lora, module_dims(self._v.model_config.hf_config))
                                    if lora.slots else None)
        self._live = LiveRequests(adapters.left if adapters is not None else lambda live: None)
        self._migrations = VllmMigrations(self._live, s, self._v.moves, self._v.sampling_params, self._lora_for)
        self._kv_blocks: KvBlocks | KvShards | None = None
        self._kv_control: tuple[list[str], str] | None = None  # the ranks' KV control endpoints (kv_ranks)
        self._received = 0
        self._tokens_generated = 0
        self._closed = False
        if not s.in_process:
            self.kv_blocks()
        if adapters is not None:
            adapters.load_configured(lora.adapters)
        # Host tier and retention (vllm_internals_tier.py; kv_tier None: neither): over a prefix cache in this process.
        self._tiers = build_tiers(s, self.kv_blocks, self.cache, kv_tier, clock) if self.cache is not None and s.in_process else None
        self.tier = self._tiers.tier if self._tiers is not None else None

    def init_thread(self) -> None:
        """Run first on the thread that will call ``step``. OpenMP's thread count is per thread, taken from
        the environment when torch first loaded, which in a daemon can be before ``set_env`` ran; vLLM's
        CPU attention checks that the count its metadata was built with is the one it runs with.

        Tensor parallel: the step thread spends a step waiting for its ranks, and vLLM's wait on their output
        queue spins (``sched_yield``) for up to a second after each message. At normal priority that spin took
        most of a core from the ranks it waits for (niced by ``vllm.worker_nice``), the llumlet's own event
        loop and the host's other daemons: the thread runs at the ranks' niceness."""
        if self.cfg.omp_threads > 0:
            set_num_threads(self.cfg.omp_threads)
        if not self._s.in_process and self.cfg.worker_nice > 0:
            lower_this_thread(os.getpriority(os.PRIO_PROCESS, os.getpid()) + self.cfg.worker_nice)

    # ---------------------------------------------------------------- serving

    def add_request(self, request: EngineRequest) -> None:
        rid, prompt, sp = request.request_id, request.prompt_token_ids, request.sampling
        n = len(prompt)
        check_request(request, rid in self._live or self._migrations.reserving(rid), self.max_model_len,
                      self._s.vocab_size)
        peak = _cdiv(min(n + sp.max_tokens, self.max_model_len), self.block_size)
        if peak > self._s.blocks_total():
            raise EngineError(f"prompt plus max_tokens may reach {peak * self.block_size} tokens; this instance's KV "
                              f"cache holds {self._s.blocks_total() * self.block_size}; lower max_tokens or shorten the prompt")
        done = request.output_token_ids
        if done:  # a failover: re-prefill prompt + what the client already has, continue at the next index
            prompt = [*prompt, *done]
            sp = msgspec.structs.replace(sp, max_tokens=sp.max_tokens - len(done),
                                         min_tokens=max(0, sp.min_tokens - len(done)))
        try:
            params = self._v.sampling_params(sp)
        except self._s.m.request_errors as exc:  # vLLM's validation errors carry a client-ready message
            raise EngineError(str(exc)) from exc
        lora = self._lora_for(request.adapter, request.adapter_path, rid) if request.adapter else None
        try:
            req = self._v.add(rid, list(prompt), params, request.arrival_time or time.time(), request.priority, done, lora)
        except Exception:
            if lora is not None:
                self.adapters.end(request.adapter, rid)
            raise
        live = self._live.add(LiveRequest(rid, req, sp, request.adapter, request.adapter_path, request.session,
                                          request.retain_s))
        live.emitted = len(done)
        self._received += 1
        if self._tiers is not None:
            self._tiers.restore(req)  # (and counts where its prompt's KV came from)

    def abort_request(self, request_id: str) -> bool:
        live = self._live.get(request_id)
        if live is None:
            return False
        if not self._migrations.abort_suspended(live):
            self._v.abort(request_id)
        self._live.forget(live)
        return True

    def has_work(self) -> bool:
        return len(self._live) > len(self._migrations.suspended())

    def step(self) -> StepResult:
        outputs: list[TokenOut] = []
        for o in self._v.step():
            live = self._live.get(o.request_id)
            if live is None:  # aborted while the step ran: nothing more is sent for it
                continue
            tokens = o.new_token_ids
            # Column 0: the sampled token; columns 1..k: the top k (k = the request's logprobs; the batch's
            # arrays may be wider, for another request's larger k).
            lps = o.new_logprobs
            k = live.sampling.logprobs or 0
            last = len(tokens) - 1
            for j, token in enumerate(tokens):
                reason = str(o.finish_reason) if j == last and o.finish_reason is not None else None
                logprob = top = None
                if lps is not None:
                    logprob = float(lps.logprobs[j][0])
                    if k:
                        top = list(zip(lps.logprob_token_ids[j][1:k + 1].tolist(), lps.logprobs[j][1:k + 1].tolist()))
                outputs.append(TokenOut(request_id=live.rid, index=live.emitted, token_id=int(token),
                                        finish_reason=reason, logprob=logprob, top=top))
                live.emitted += 1
            if o.finish_reason is not None:
                if not tokens:
                    log.warning("vLLM finished %s (%s) without a token; the client sees no final token",
                                live.rid, o.finish_reason)
                if self._tiers is not None and live.session:
                    self._tiers.turn_ended(live.session, live.req, live.retain_s)
                self._live.forget(live)
        self._tokens_generated += len(outputs)
        return StepResult(outputs, 0.0, *self._v.last_work)

    def cache_events(self) -> list[tuple]:
        """(stored?, block key) of every prefix-cache change since the last call, then the host tier's."""
        events = self.cache.events() if self.cache is not None else []
        return events + self.tier.events() if self.tier is not None else events

    def cache_snapshot(self) -> list[int]:
        return self.cache.snapshot() if self.cache is not None else []

    def tier_snapshot(self) -> list[int]:
        return self.tier.snapshot() if self.tier is not None else []

    def export_blocks(self, hashes: list[bytes]):
        return need_tiers(self._tiers).export_blocks(hashes)

    def import_blocks(self, hashes: list[bytes], payload) -> int:
        return need_tiers(self._tiers).import_blocks(hashes, payload)

    def load(self) -> InstanceLoad:
        v = self._s
        total = v.blocks_total()
        running, waiting = v.counts()
        head = v.head_waiting()
        waiting_high = [r for r in v.waiting() if v.priority(r) > 0] if waiting else []
        return InstanceLoad(
            blocks_total=total,
            blocks_used=total - v.blocks_free(),
            running=running,
            waiting=waiting,
            batch_size=self.cfg.max_num_seqs,
            block_size=self.block_size,
            preemptions=self._live.preemptions(),
            hol_demand_blocks=_cdiv(head.num_tokens, self.block_size) if head is not None else 0,
            requests_received=self._received,
            tokens_generated=self._tokens_generated,
            running_blocks=sum(len(v.block_ids(r.request_id)) for r in v.running()),
            high_priority=v.high_priority_running(),
            waiting_tokens=v.waiting_tokens(),
            waiting_high=sum(1 for r in waiting_high),
            waiting_high_tokens=sum(r.num_tokens - r.num_computed_tokens for r in waiting_high),
            context_tokens=sum(r.num_tokens for r in v.running()),
            adapters=self.adapters.table.held() if self.adapters is not None else [],
            adapter_slots=self.adapters.table.open_slots() if self.adapters is not None else 0,
            **(self._tiers.load_fields() if self._tiers is not None else {}),
        )

    def requests(self) -> list[RequestLoad]:
        v = self._s

        def row(r, state: str) -> RequestLoad:
            return RequestLoad(request_id=r.request_id, state=state, blocks=len(v.block_ids(r.request_id)),
                               prompt_tokens=r.num_prompt_tokens, output_tokens=r.num_output_tokens,
                               priority=v.priority(r), max_tokens=r.max_tokens or 0)

        out = [row(r, "running") for r in v.running()]
        out += [row(self._live[rid].req, "migrating") for rid in self._migrations.suspended()]
        out += [row(r, "preempted" if v.is_preempted(r) else "waiting") for r in v.waiting()]
        return out

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids in token order (empty while it waits). KeyError if unknown."""
        if request_id not in self._live:
            raise KeyError(request_id)
        return list(self._s.block_ids(request_id))

    @property
    def kv_caches(self) -> list:
        """The model runner's KV tensors, one per layer (see ``VllmInternals.kv_caches`` for the layout)."""
        return self._s.kv_caches()

    def _lora_for(self, name: str, path: str, request_id: str):
        if self.adapters is None:
            raise EngineError(f"adapter {name!r}: this instance serves no LoRA adapters (lora.slots = 0)")
        return self.adapters.start(name, path, request_id)

    # ---------------------------------------------------------------- migration (VllmMigrations does it)

    def kv_blocks(self) -> KvBlocks:
        if self._kv_blocks is None:
            v = self._s
            if v.in_process:
                self._kv_blocks = KvBlocks(list(v.kv_caches()), v.kv_describe(), v.kv_cache_layout())
            else:  # asked of every rank once, before the first step (collective_rpc is for between steps)
                self._kv_blocks = KvShards.of(v.rpc("llumnix_kv_layout", v.kv_layout(), v.kv_cache_layout(),
                                                    v.tensor_parallel_size))
        return self._kv_blocks

    def kv_ranks(self) -> tuple[list[str], str] | None:
        """Where this engine's KV lives, for the KV transport (daemons/kv/ranks.py ``gloo_transport``): None in
        this process; else every tensor-parallel rank's KV control endpoint (each rank moves its own shard,
        daemons/kv/rankctl.py) and the directory they are in, which the transport removes when it closes. The
        first call starts the ranks' control threads: it comes before the first step (collective_rpc is for
        between steps)."""
        if self._s.in_process:
            return None
        if self._kv_control is None:
            directory = endpoint_dir()
            try:
                self._kv_control = (self._s.rpc("llumnix_kv_serve", directory), directory)
            except Exception:
                remove_endpoint_dir(directory)
                raise
        return self._kv_control

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._live.clear()
        self._v.shutdown()

    def cached_blocks(self, request_id: str) -> int:
        return self._migrations.cached_blocks(request_id)

    def prefix_hits(self, prompts: list[list[int]]) -> list[int]:
        return self._migrations.prefix_hits(prompts)
