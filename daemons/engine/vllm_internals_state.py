"""vLLM's internals (daemons/engine/vllm_internals.py), continued: what the scheduler, the KV cache manager and
the model runner hold: sizes, counts, block tables, KV tensors and layout, and the call to every worker. Checked
against the same vLLM version (``vllm_internals.TESTED_VERSION``)."""

from __future__ import annotations

import os

from daemons.engine.vllm_worker import attention_backends

AMX_ENV = "LLUMNIX_VLLM_AMX_ATTENTION"  # =1 keeps vLLM's AMX attention kernel (see VllmInternals.workarounds)


class VllmState:
    """Reads of a running vLLM core (its scheduler, KV cache manager, block pool and model runner), made of
    ``m`` (vLLM's names, ``VllmInternals.import_checked``), the ``EngineCore`` and its ``VllmConfig``. What it reads
    is vLLM's; it owns one memo: the cached tokens of each waiting request, looked up once (``waiting_tokens``)."""

    def __init__(self, m, core, config):
        self.m = m
        self.core = core
        self.config = config
        self.model_config = config.model_config
        self.scheduler = core.scheduler
        self.kv = self.scheduler.kv_cache_manager
        self.pool = self.kv.block_pool
        self._queued_cached: dict[str, int] = {}  # waiting request id -> its prompt's tokens cached when first seen

    def tokenizer(self):
        """The tokenizer vLLM's structured output compiles grammars against (``structured_output_manager``)."""
        return getattr(self.core.structured_output_manager, "tokenizer", None)

    @property
    def vocab_size(self) -> int:
        return self.model_config.get_vocab_size()

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_model_len

    @property
    def block_size(self) -> int:
        return self.scheduler.block_size

    def blocks_total(self) -> int:
        return self.pool.num_gpu_blocks - 1  # block 0 is vLLM's null block, never allocated

    def blocks_free(self) -> int:
        return self.pool.get_num_free_blocks()  # includes cached blocks that prefix caching may evict

    def counts(self) -> tuple[int, int]:
        return self.scheduler.get_request_counts()  # (running, waiting)

    def running(self) -> list:
        return self.scheduler.running

    def waiting(self) -> list:
        return list(self.scheduler.waiting)

    def waiting_tokens(self) -> int:
        """Tokens the waiting requests have yet to prefill (a preempted one's output included), less those their
        prompts find in the prefix cache (what admission and the SLO's prediction weigh as queued work). Each
        request's cached tokens are looked up once, when first seen waiting (host-tier blocks are in the prefix
        cache by then: the tier restores them as the request is added); after that a report reads the memo."""
        memo, seen, total = self._queued_cached, {}, 0
        for r in self.scheduler.waiting:
            cached = memo.get(r.request_id)
            if cached is None:
                cached = self.cached_tokens(r)
            seen[r.request_id] = cached
            total += max(r.num_tokens - r.num_computed_tokens - cached, 0)
        self._queued_cached = seen
        return total

    def cached_tokens(self, r) -> int:
        """Of a request's prompt, the leading tokens whose blocks the prefix cache holds (never its last token)."""
        bs, n = self.block_size, 0
        for h in r.block_hashes[:(r.num_tokens - 1) // bs]:
            if self.pool.get_cached_block(h, [0]) is None:
                break
            n += 1
        return n * bs

    def head_waiting(self):
        queue = self.scheduler.waiting
        return queue.peek_request() if queue else None

    @staticmethod
    def priority(req) -> int:
        """Our priority (1 = high) of a request ``build`` made."""
        return -req.priority

    def high_priority_running(self) -> int:
        return sum(1 for r in self.scheduler.running if r.priority < 0)

    def is_preempted(self, req) -> bool:
        return req.status == self.m.PREEMPTED

    def block_ids(self, request_id: str) -> list[int]:
        return self.kv.get_block_ids(request_id)[0]  # group 0: the full-attention layers

    def kv_caches(self) -> list:
        """Per layer ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` on the CPU backend."""
        return self.runner().kv_caches

    def runner(self):
        return self.core.model_executor.driver_worker.worker.model_runner

    def kv_layout(self) -> str:
        """What decides the bytes inside a block besides shape, dtype and layout: device and kernel ISA (the
        runner's side adds its attention backends: ``vllm_worker.attention_backends``)."""
        from vllm.platforms import current_platform

        kind = "cpu" if current_platform.is_cpu() else current_platform.device_name
        isa = ""
        if current_platform.is_cpu():
            isa = "-amx" if os.environ.get(AMX_ENV) == "1" else "-noamx"
        return f"vllm-{self.m.version}-{kind}{isa}"

    def kv_describe(self) -> str:
        """``kv_layout`` plus the attention backends (in-process runner only)."""
        return f"{self.kv_layout()}/{attention_backends(self.runner())}"

    def kv_cache_layout(self) -> str:
        """vLLM's resolved ``KVCacheLayout`` name (the stride order of its KV allocation), e.g. LBHNC."""
        return str(self.config.cache_config.kv_cache_layout or "")

    @property
    def tensor_parallel_size(self) -> int:
        return self.config.parallel_config.tensor_parallel_size

    @property
    def in_process(self) -> bool:
        """True when the model runner (KV tensors, per-request state) lives in this process."""
        return self.tensor_parallel_size <= 1

    def rpc(self, method: str, *args) -> list:
        """Call a ``LlumnixWorker`` method on every rank (between steps only); one result per rank."""
        return self.core.model_executor.collective_rpc(method, args=args)

    def post(self, method: str, *args):
        """Send a ``LlumnixWorker`` call to every rank (between steps only) without waiting for it: the ranks
        take the executor's broadcast queue in order, so they run it before the next step (or call) sent after
        it, and the executor reads its answers before any later call's. Its future (``concurrent.futures``)
        fails if a rank failed."""
        return self.core.model_executor.collective_rpc(method, args=args, non_block=True)
