"""The sim engine: vLLM-like scheduling over a paged KV cache, with no model.

What it keeps from vLLM: a free list of KV blocks, append-only block tables, a waiting queue ordered by
priority (higher first; 1 = high, 0 = normal) and FCFS within a priority, continuous batching under
``max_num_seqs`` / ``max_num_batched_tokens`` / a free-block watermark, head-of-line blocking, and
preemption by recompute: the victim is the lowest-priority running request, the most recently admitted
among equals; it goes back to the front of its priority class and re-prefills its prompt plus the tokens
it already generated.

What it fakes: tokens and KV values are pure functions of the request id and the position, so they do
not depend on batch composition, preemption or which physical blocks a request got; the step time comes
from a latency model (``SimConfig``) and is returned for the daemon to wait out.

Token accounting: a step computes a request's input tokens and samples one token, and the sim stores the
sampled token's KV right away. So a running request that has generated ``g`` tokens has ``P + g`` computed
tokens (P = prompt length) and holds ``ceil((P + g) / block_size)`` blocks; a waiting request holds none.
"""

from __future__ import annotations

from operator import attrgetter

import torch

from daemons.config import LoraConfig, ModelConfig, SimConfig
from daemons.engine.base import (EngineDefaults, EngineError, EngineRequest, KvBlocks, MigrationParts, StepResult,
                                  check_request)
from daemons.engine.sim_cache import SimPrefixCache, build_cache, need_cache
from daemons.engine.sim_lora import adapters_of, load_fields, owed, start
from daemons.engine.sim_migration import SimEngineMigrations
from daemons.engine.sim_requests import SimRequestTable, SimBlocks, SimRequest, WaitingQueue, cdiv, request_rows
from daemons.engine.sim_values import kv_value, next_token, sim_logprobs, sim_token_id, token_out, write_kv
from daemons.wire import InstanceLoad, RequestLoad, TokenOut

__all__ = ["SimEngine", "kv_value", "sim_logprobs", "sim_token_id"]

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


_priority = attrgetter("priority")


class SimEngine(EngineDefaults, MigrationParts):
    """Scheduling and stepping; its parts: the request table (``SimRequestTable``), the free list (``SimBlocks``),
    the waiting queue, and the migrating requests (``SimEngineMigrations``, to which the migration verbs go)."""

    backend = "sim"
    prefix_caching = False

    def __init__(self, sim: SimConfig, model: ModelConfig, kv: bool = True, lora: LoraConfig | None = None,
                 kv_tier=None, clock=None):
        """``kv`` False: no KV tensors (the virtual-time simulator, llumnixctl/experiments/sim/simulate.py): the same
        scheduling, block accounting and step times, nothing written or copied. ``lora``: adapters (sim_lora.py).
        ``kv_tier``, ``clock``: a host tier and retention, their deadlines on that clock (sim_cache.build_cache)."""
        self.cfg = sim
        self.block_size = sim.block_size
        self.max_model_len = model.max_model_len
        self.vocab_size = sim.vocab_size
        self.num_blocks = sim.num_blocks
        self.prefill_budget = sim.max_num_batched_tokens  # most prompt tokens one step prefills
        dtype = _DTYPES[sim.kv_dtype]
        shape = (sim.num_blocks, 2, sim.block_size, sim.kv_heads, sim.head_dim)
        self.kv_caches: list[torch.Tensor] = [torch.zeros(shape, dtype=dtype) for _ in range(sim.kv_layers if kv else 0)]
        # Layer l stores (x + l, -(x + l)), so a copy that mixes up layers shows.
        self._layer_shift = [torch.tensor([l, -l], dtype=torch.float64)[None, :, None, None] for l in range(sim.kv_layers)]
        # sim.prefix_caching: what content the blocks hold (free ones too, until taken): hits skip prefill.
        # (Not ``prefix_caching``, which says a destination can skip copying cached blocks: vLLM's alone.)
        self.cache: SimPrefixCache | None = build_cache(sim, kv_tier, clock)
        self.tier = self.cache.tier if self.cache is not None else None
        self._blocks = SimBlocks(sim.num_blocks, sim.watermark * sim.num_blocks, self.cache)
        self._table = SimRequestTable()
        self._waiting = WaitingQueue(self.cache)  # (queued tokens less what is cached)
        self._profile = None
        if sim.profile:
            from daemons.engine.profile import LatencyProfile, ProfileError

            try:
                self._profile = LatencyProfile.load(sim.profile)
            except ProfileError as exc:
                raise EngineError(f"sim.profile: {exc}") from None
        self.adapters = adapters_of(lora, lambda rid: rid in self._table.by_id or self._migrations.reserving(rid),
                                    self._profile)
        self._migrations = SimEngineMigrations(self._table, self._blocks, sim.block_size, model.max_model_len,
                                               lambda r: start(self.adapters, r.adapter, r.adapter_path, r.request_id))
        self._kv_blocks: KvBlocks | None = None
        self._preemptions = 0
        self._received = 0
        self._tokens_generated = 0

    # ---------------------------------------------------------------- serving

    def add_request(self, request: EngineRequest) -> None:
        rid = request.request_id
        check_request(request, rid in self._table.by_id or self._migrations.reserving(rid), self.max_model_len)
        if request.sampling.structured is not None:  # it makes up tokens: a grammar cannot be honoured
            raise EngineError("the sim engine cannot constrain its output (response_format, structured_outputs or "
                              "a forced tool choice): it has no model; serve this request with the vllm backend")
        start(self.adapters, request.adapter, request.adapter_path, rid)
        req = SimRequest(request, self.max_model_len)
        if self.cache is not None:
            req.tokens = list(request.prompt_token_ids) + list(request.output_token_ids)
        # A request that could never be (re)admitted would wait forever: refuse it now, like vLLM.
        peak = cdiv(req.max_total, self.block_size)
        if self.num_blocks - peak < self._blocks.watermark:
            usable = int(self.num_blocks - self._blocks.watermark) * self.block_size
            raise EngineError(f"prompt plus max_tokens may reach {req.max_total} tokens; this instance's KV cache "
                              f"holds at most {usable} tokens per request; lower max_tokens or shorten the prompt")
        self._table.by_id[rid] = req
        self._waiting.append(req)
        self._received += 1

    def abort_request(self, request_id: str) -> bool:
        req = self._table.by_id.pop(request_id, None)
        if req is None:
            return False
        if request_id in self._table.running:
            self._table.unrun(req)
        elif not self._migrations.forget_suspended(request_id):
            self._waiting.remove(req)
        self._blocks.release(req)
        return True

    def has_work(self) -> bool:
        return bool(self._table.running or self._waiting)

    def step(self) -> StepResult:
        bs = self.block_size
        free = self._blocks
        cache = self.cache
        # (1) Every running request computes one more token; make room, preempting from the tail. Higher
        # priorities go first (the sort is stable: admission order within a priority), so the tail is the
        # lowest-priority, most recently admitted request: a high one is preempted only when no normal
        # one is left. With one priority running (the usual case) admission order is already that order.
        run = list(self._table.running.values())
        if len(self._table.per_priority) > 1:
            run.sort(key=_priority, reverse=True)
        n = len(run)
        i = 0
        while i < n:
            req = run[i]
            if len(req.blocks) * bs == req.prompt_len + req.generated:
                while not free and n > i:
                    n -= 1
                    self._preempt(run[n])
                if n == i:  # it preempted itself
                    break
                req.blocks += free.take(1)
            i += 1
        decoding = run[:n]

        # (2) Admit in queue order (priority, then FCFS), stopping at the first request that does not fit
        # (head-of-line blocking). Not in a step that preempted, as in vLLM: the running requests are short
        # of blocks, and a waiting high-priority request that fits in what a victim freed would only cause
        # the next preemption.
        prefilling: list[SimRequest] = []
        prefill_tokens = 0
        restore_s = 0.0
        waiting = self._waiting
        admit = n == len(run)
        while admit and waiting and len(self._table.running) < self.cfg.max_num_seqs:
            req = waiting.head()
            tokens = req.prompt_len + req.generated
            need = cdiv(tokens + 1, bs)
            if not free.fits(need):
                break
            engine_hit, host_hit = (0, 0) if cache is None else cache.cached(req, tokens)
            new = tokens - engine_hit - host_hit
            if prefilling and prefill_tokens + new > self.cfg.max_num_batched_tokens:
                break
            waiting.popleft()
            req.blocks = free.take_for_prefill(need)
            if cache is not None:
                if not req.preempted:  # as vLLM's counters: a re-admission after preemption is not a query
                    cache.count(tokens, tokens - new, host_hit)
                restore_s += cache.restore(req, engine_hit, host_hit, self.cfg.restore_ms_per_block)
                cache.prefilled(req)
            req.preempted = False
            self._table.run(req)
            prefilling.append(req)
            prefill_tokens += new

        context_tokens = sum(r.prompt_len + r.generated for r in decoding)
        write_kv(self.kv_caches, self._layer_shift, self.block_size, decoding, prefilling)
        outputs = [self._sample(r) for r in decoding]
        outputs += [self._sample(r) for r in prefilling]
        self._tokens_generated += len(outputs)
        model_s = (model_time(self.cfg, self._profile, prefill_tokens, len(decoding), context_tokens) + owed(self.adapters)
                   + self.cfg.time_scale * restore_s)
        return StepResult(outputs, model_s, prefill_tokens, len(decoding), context_tokens)

    def load(self) -> InstanceLoad:
        used = self.num_blocks - len(self._blocks)
        head = self._waiting.head() if self._waiting else None
        return InstanceLoad(
            blocks_total=self.num_blocks,
            blocks_used=used,
            running=len(self._table.running),
            waiting=len(self._waiting),
            batch_size=self.cfg.max_num_seqs,
            block_size=self.block_size,
            preemptions=self._preemptions,
            hol_demand_blocks=cdiv(head.prompt_len + head.generated + 1, self.block_size) if head else 0,
            requests_received=self._received,
            tokens_generated=self._tokens_generated,
            # Only running, suspended (migrating out) and reserved (migrating in) requests hold blocks.
            running_blocks=used - self._migrations.held_blocks(),
            high_priority=sum(n for p, n in self._table.per_priority.items() if p > 0),
            waiting_tokens=self._waiting.tokens,
            waiting_high=self._waiting.count_above(0),
            waiting_high_tokens=self._waiting.tokens_above(0),
            context_tokens=self._table.context_tokens(),
            **load_fields(self.adapters),
            **(self.cache.load_fields() if self.cache is not None else {}),
        )

    def requests(self) -> list[RequestLoad]:
        return request_rows(self._table.running.values(), self._migrations.suspended(), self._waiting)

    def cache_events(self) -> list[tuple]:
        """(stored?, block key) of every prefix-cache change since the last call, then the host tier's ([] without a cache)."""
        return self.cache.events() if self.cache is not None else []

    def cache_snapshot(self) -> list[int]:
        return self.cache.snapshot() if self.cache is not None else []

    def tier_snapshot(self) -> list[int]:
        return self.tier.snapshot() if self.tier is not None else []

    def export_blocks(self, hashes: list[bytes]) -> tuple[int, torch.Tensor]:
        return need_cache(self.cache).export(hashes)

    def import_blocks(self, hashes: list[bytes], payload) -> int:
        return need_cache(self.cache).import_keys(hashes)

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids in token order (empty while it waits). KeyError if unknown."""
        return list(self._table.by_id[request_id].blocks)

    # ---------------------------------------------------------------- migration (SimEngineMigrations does it)

    def kv_blocks(self) -> KvBlocks:
        if self._kv_blocks is None:
            self._kv_blocks = KvBlocks(self.kv_caches, "sim", token_slots=True)
        return self._kv_blocks

    def shutdown(self) -> None:
        self._migrations.clear()
        self._table.clear()
        self._waiting.clear()
        self._blocks.reset()
        self.kv_caches = []

    def cached_blocks(self, request_id: str) -> int:
        return 0  # no prefix cache

    def prefix_hits(self, prompts: list[list[int]]) -> list[int]:
        return [0] * len(prompts)

    # ---------------------------------------------------------------- internals

    def _preempt(self, req: SimRequest) -> None:
        self._table.unrun(req)
        self._blocks.release(req)
        req.preempted = True
        self._waiting.appendleft(req)
        self._preemptions += 1

    def _sample(self, req: SimRequest) -> TokenOut:
        index, token, reason = next_token(req, self.cfg, self.max_model_len)
        if reason is not None:
            self._table.unrun(req)
            del self._table.by_id[req.rid]
            self._blocks.release(req, ended=True)
        return token_out(req.rid, index, token, reason, req.sampling.logprobs, self.cfg.vocab_size)


def model_time(c: SimConfig, profile, prefill_tokens: int, n_decoding: int, context_tokens: int) -> float:
    """A step's model time: from the latency profile (``sim.profile``) where there is one, else the linear model."""
    if profile is not None:
        return c.time_scale * profile.step_ms(prefill_tokens, n_decoding, context_tokens) / 1000.0
    ms = 0.0
    if prefill_tokens > 0:
        ms += c.prefill_ms_per_token * prefill_tokens + c.prefill_ms
    if n_decoding > 0:
        ms += c.decode_ms_per_seq * n_decoding + c.decode_ms_per_token * context_tokens + c.decode_ms
    return c.time_scale * ms / 1000.0
