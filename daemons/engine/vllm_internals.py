"""vLLM's internals, in one place: every vLLM module path, class and private attribute the vllm backend
touches, with the version they were checked against, and the process environment vLLM needs first.

Upgrading vLLM means re-reading this module against the new source, nothing else: the engine
(``vllm_backend``) talks to vLLM only through ``_Vllm`` and ``set_env``.
"""

from __future__ import annotations

import logging
import os
import time
from types import SimpleNamespace

from daemons.config import ModelConfig, VllmConfig
from daemons.engine.base import EngineError
from daemons.engine.vllm_worker import attention_backends, commit_runner_state, generator_state

TESTED_VERSION = "0.32"  # major.minor the _Vllm section was checked against
UNTESTED_ENV = "LLUMNIX_VLLM_UNTESTED"
log = logging.getLogger("llumnix.engine.vllm")

AMX_ENV = "LLUMNIX_VLLM_AMX_ATTENTION"  # =1 keeps vLLM's AMX attention kernel (see _Vllm.workarounds)


def set_env(cfg: VllmConfig) -> None:
    """Must run before vllm is first imported (vLLM caches its environment variables).

    With the in-process ``uni`` executor vLLM 0.32 pins no threads (its OpenMP binding lives in the
    multiprocess executor), so ``cpu_bind`` only reaches vLLM's environment; pin with taskset or systemd.
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # EngineCore and its worker stay in this process
    # Serving nodes often have no route out: never phone home, never ask a hub (models are loaded by path).
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cfg.cpu_bind
    if cfg.omp_threads > 0:
        os.environ["OMP_NUM_THREADS"] = str(cfg.omp_threads)
        import torch

        # The env var is too late once torch's OpenMP pool exists, and vLLM's CPU worker later replaces
        # torch.set_num_threads with a no-op for the whole process: set it now, and keep the real one for
        # the engine's step thread (VllmEngine.init_thread).
        global _set_num_threads
        if _set_num_threads is None:
            _set_num_threads = torch.set_num_threads
        _set_num_threads(cfg.omp_threads)


_set_num_threads = None  # torch's own set_num_threads, saved before vLLM replaces it


# ==================================================================== vLLM internals (checked: 0.32.0)


class _Vllm:
    """The only place that knows vLLM's module paths, classes and attributes.

    Public-ish API used: ``EngineArgs.create_engine_config``, ``Executor.get_class``, ``EngineCore``
    (``preprocess_add_request``, ``add_request``, ``abort_requests``, ``step_fn``, ``post_step``,
    ``shutdown``), ``SamplingParams`` (``verify``, ``update_from_generation_config``),
    ``EngineCoreRequest``, ``ModelConfig.try_get_generation_config``.
    Patched: ``vllm.v1.attention.backends.cpu_attn._get_attn_isa`` (see ``workarounds``).
    Private attributes read: ``core.scheduler.{running, waiting (peek_request, iteration),
    get_request_counts, block_size}``, ``scheduler.kv_cache_manager.{get_block_ids,
    block_pool.{num_gpu_blocks, get_num_free_blocks}}``, ``Request.{request_id, priority, num_prompt_tokens,
    num_output_tokens, num_tokens, num_preemptions, status}``,
    ``core.model_executor.driver_worker.worker.model_runner.kv_caches``.

    Priorities: the engine runs with ``EngineArgs(scheduling_policy="priority")``. vLLM serves the LOWEST
    ``Request.priority`` first and preempts ``max(running, key=(priority, arrival_time))``; ours is the
    opposite (1 = high), so ``build`` stores ``-priority`` and ``priority`` reads it back: nothing outside
    this class sees vLLM's sign. ``scheduler.waiting`` is then a ``PriorityRequestQueue``: a heap ordered by
    (priority, arrival_time, request_id), whose iteration pops a copy (sorted, O(n log n)) and where a
    preempted request goes back by its arrival time rather than to the front. ``scheduler.running`` stays a
    plain list in admission order (vLLM replaces the list object when it removes finished requests, so it
    is read afresh each time), and its order no longer picks the victim. Priority orders admission and
    picks victims only: vLLM never preempts a running request to admit a waiting high-priority one.

    Migration (all between steps, on the engine's thread): a request is suspended by taking it out of
    ``scheduler.running`` (its blocks and the model runner's cached state stay) and resumed by putting it
    back. An incoming request is a ``Request`` built like any other; its blocks come from
    ``kv_cache_manager.allocate_slots(delay_cache_blocks=True)`` (and are taken off the list of new blocks
    the runner zeroes, or the zeroing could overwrite what migration wrote). On commit it gets its output
    tokens (``append_output_token_ids``), ``num_computed_tokens`` = all but the last sampled token, status
    RUNNING, a place in ``scheduler.requests`` and ``scheduler.running``, and a ``CachedRequestState`` in
    ``model_runner.requests`` built from the same fields vLLM uses for a new request plus the outputs and
    the seeded generator's state (a request that comes back before a step let the runner forget its last
    visit is first taken out of ``scheduler.finished_req_ids``, ``model_runner.requests`` and the
    runner's ``input_batch``). The scheduler then sees a running request that skipped a step: it
    schedules one token, and the runner adds it back to the persistent batch from that cached state. The
    source drops a migrated request with ``abort_requests`` (after putting it back into ``running``).
    None of this touches ``scheduler.waiting``, so it works the same under either policy; a committed
    request keeps its arrival time, which is what it is preempted and re-queued by here.
    """

    @staticmethod
    def import_checked() -> SimpleNamespace:
        try:
            import vllm
        except ImportError as exc:
            raise EngineError(f"vLLM is not installed ({exc}); on CPU machines: LLUMNIX_EXTRAS=test,vllm "
                              "bash scripts/install.sh; on GPU nodes: pip install 'vllm==0.32.*'") from None
        from vllm.engine.arg_utils import EngineArgs
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind, SamplingParams
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine import EngineCoreRequest
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.executor import Executor
        from vllm.sampling_params import SamplingType
        from vllm.v1.request import RequestStatus
        from vllm.v1.worker.gpu_input_batch import CachedRequestState

        found = vllm.__version__
        if not found.startswith(TESTED_VERSION + ".") and os.environ.get(UNTESTED_ENV) != "1":
            raise EngineError(f"the vllm backend is tested with vLLM {TESTED_VERSION}; found {found}. "
                              f"Install vllm {TESTED_VERSION}.x, or set {UNTESTED_ENV}=1 to try anyway")
        return SimpleNamespace(version=found, EngineArgs=EngineArgs, SamplingParams=SamplingParams,
                               DELTA=RequestOutputKind.DELTA, UsageContext=UsageContext, EngineCore=EngineCore,
                               EngineCoreRequest=EngineCoreRequest, Executor=Executor, PREEMPTED=RequestStatus.PREEMPTED,
                               RUNNING=RequestStatus.RUNNING, RANDOM_SEED=SamplingType.RANDOM_SEED,
                               CachedRequestState=CachedRequestState, request_errors=(VLLMClientError, ValueError))

    @staticmethod
    def workarounds() -> None:
        """Process-wide fixes for vLLM 0.32 bugs; idempotent. Call after ``_set_env``.

        CPU attention: with bf16 on a CPU with AMX, vLLM picks its "amx" kernel, which kills the process
        with SIGILL on a step whose only request is a prefill of 1 to 4 tokens, for some model shapes
        (seen: hidden 128 with head sizes 32, 96 or 256; not with head size 64, 80 or 128). The "vec"
        (AVX-512) kernel runs the same cases. The choice also sets the KV layout inside a block, so
        instances that exchange KV blocks must agree on it.
        """
        from vllm.platforms import current_platform

        if os.environ.get(AMX_ENV) == "1" or not current_platform.is_cpu():
            return
        from vllm.v1.attention.backends import cpu_attn

        choose = cpu_attn._get_attn_isa
        if getattr(choose, "llumnix_no_amx", False):
            return

        def no_amx(*args, **kwargs) -> str:
            isa = choose(*args, **kwargs)
            return "vec" if isa == "amx" else isa

        no_amx.llumnix_no_amx = True
        cpu_attn._get_attn_isa = no_amx

    def __init__(self, model: ModelConfig, cfg: VllmConfig):
        self.m = m = self.import_checked()
        self.workarounds()
        args = m.EngineArgs(
            model=model.path,
            skip_tokenizer_init=True,  # the proxy tokenizes and detokenizes
            dtype=cfg.dtype,
            max_model_len=model.max_model_len,
            block_size=cfg.block_size,
            kv_cache_memory_bytes=cfg.kv_cache_bytes or None,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens or None,
            enforce_eager=cfg.enforce_eager,
            enable_prefix_caching=cfg.enable_prefix_caching,
            seed=cfg.seed,
            disable_log_stats=True,
            scheduling_policy="priority",  # see the class docstring for vLLM's sign
            async_scheduling=False,  # migration suspends requests between steps
            **self.parallel_args(cfg),
        )
        if cfg.gpu_memory_utilization > 0:
            args.gpu_memory_utilization = cfg.gpu_memory_utilization
        try:
            self.config = args.create_engine_config(m.UsageContext.ENGINE_CONTEXT)
            self.core = m.EngineCore(self.config, m.Executor.get_class(self.config), log_stats=False)
        except (ValueError, OSError) as exc:  # bad path, bad config, KV cache too small for max_model_len
            raise EngineError(f"vLLM could not start on {model.path!r}: {exc}") from exc
        self.model_config = self.config.model_config
        if cfg.tensor_parallel_size > 1 and cfg.worker_nice > 0:
            self.renice_workers(cfg.worker_nice)
        self.scheduler = self.core.scheduler
        self.kv = self.scheduler.kv_cache_manager
        self.pool = self.kv.block_pool
        self.generation_config = self.model_config.try_get_generation_config()
        eos = self.generation_config.get("eos_token_id", getattr(self.model_config.hf_config, "eos_token_id", None))
        self.eos_token_id = eos[0] if isinstance(eos, list) and eos else eos
        self._held: set[str] = set()  # reservations: requests that hold blocks but are not in the scheduler
        if getattr(self.config.scheduler_config, "async_scheduling", False):
            raise EngineError("vLLM chose async scheduling; the vllm backend steps synchronously "
                              "(migration suspends requests between steps)")

    @staticmethod
    def parallel_args(cfg: VllmConfig) -> dict:
        """One rank: the ``uni`` executor, the worker in this process. Several: vLLM's multiprocess executor,
        one worker process per rank, with our worker extension (``vllm_worker.LlumnixWorker``) mixed in."""
        if cfg.tensor_parallel_size <= 1:
            return {"distributed_executor_backend": "uni"}
        return {"distributed_executor_backend": "mp", "tensor_parallel_size": cfg.tensor_parallel_size,
                "worker_extension_cls": "daemons.engine.vllm_worker.LlumnixWorker"}

    @property
    def in_process(self) -> bool:
        """True when the model runner (KV tensors, per-request state) lives in this process."""
        return self.tensor_parallel_size <= 1

    def worker_pids(self) -> list[int]:
        """The worker processes of vLLM's multiprocess executor (none for the ``uni`` executor)."""
        workers = getattr(self.core.model_executor, "workers", None) or []
        return [w.proc.pid for w in workers if getattr(w, "proc", None) is not None and w.proc.pid]

    def renice_workers(self, increment: int) -> None:
        """Lower the workers' priority by ``increment`` (all their threads: niceness is per thread on Linux)."""
        for pid in self.worker_pids():
            try:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    os.setpriority(os.PRIO_PROCESS, int(tid), os.getpriority(os.PRIO_PROCESS, int(tid)) + increment)
            except OSError as exc:  # gone, or no /proc (not Linux): they run at our priority
                log.warning("could not renice worker process %d: %s", pid, exc)

    def rpc(self, method: str, *args) -> list:
        """Call a ``LlumnixWorker`` method on every rank (between steps only); one result per rank."""
        return self.core.model_executor.collective_rpc(method, args=args)

    # ---- requests
    def sampling_params(self, sp) -> object:
        """Our SamplingParams -> vLLM's, validated and completed as vLLM's input processor would."""
        m = self.m
        p = m.SamplingParams(
            n=1, max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
            seed=sp.seed, stop_token_ids=list(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
            min_tokens=sp.min_tokens, logprobs=sp.logprobs, presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty, repetition_penalty=sp.repetition_penalty,
            detokenize=False, output_kind=m.DELTA)
        p.verify(self.model_config, self.config.speculative_config, self.config.structured_outputs_config, None)
        p.update_from_generation_config(self.generation_config, self.eos_token_id)
        return p

    def add(self, request_id: str, prompt: list[int], params, arrival_time: float, priority: int):
        req = self.build(request_id, prompt, params, arrival_time, priority)
        self.core.add_request(req)
        return req  # vllm.v1.request.Request: read for counters, never written

    def abort(self, request_id: str) -> None:
        self.core.abort_requests([request_id])  # frees its blocks now

    def step(self) -> list:
        outputs, executed = self.core.step_fn()
        self.core.post_step(model_executed=executed)
        eco = outputs.get(0) if outputs else None
        return eco.outputs if eco is not None else []

    def shutdown(self) -> None:
        self.core.shutdown()

    # ---- state
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
        """Tokens the waiting requests have yet to prefill (a preempted one's output included)."""
        return sum(r.num_tokens - r.num_computed_tokens for r in self.scheduler.waiting)

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

    # ---- migration
    def is_running(self, req) -> bool:
        return req.status == self.m.RUNNING and req.num_output_placeholders == 0 and not req.spec_token_ids

    def suspend(self, req) -> bytes:
        self.scheduler.running.remove(req)
        if self.in_process:
            return generator_state(self.runner(), req.request_id)
        return self.rpc("llumnix_generator_state", req.request_id)[0]  # every rank samples alike

    def resume(self, req) -> None:
        self.scheduler.running.append(req)

    def drop_suspended(self, req) -> None:
        self.scheduler.running.append(req)  # so the scheduler's own abort path finds it where it expects
        self.core.abort_requests([req.request_id])

    def build(self, request_id: str, prompt: list[int], params, arrival_time: float, priority: int):
        """A vLLM ``Request`` for our ``priority`` (1 = high), which vLLM serves first as -1."""
        ecr = self.m.EngineCoreRequest(
            request_id=request_id, prompt_token_ids=prompt, mm_features=None, sampling_params=params,
            pooling_params=None, arrival_time=arrival_time, lora_request=None, cache_salt=None,
            data_parallel_rank=None, priority=-priority)
        req, _wave = self.core.preprocess_add_request(ecr)
        return req

    def allocate_first(self, req, tokens: int) -> tuple[list[int], int] | None:
        """The first hold of an incoming request: with prefix caching, the blocks of its prompt's longest
        cached prefix are taken from the cache (shared, counted once: only the rest is new), and how many
        leading blocks that is comes back with the block ids."""
        if not self.config.cache_config.enable_prefix_caching:
            blocks = self.allocate(req, tokens)
            return None if blocks is None else (blocks, 0)
        computed, hit, _ = self.kv.get_computed_blocks(req)
        if not hit:
            blocks = self.allocate(req, tokens)
            return None if blocks is None else (blocks, 0)
        if self._allocate(req, tokens - hit, hit, computed) is None:
            return None
        return self.block_ids(req.request_id), hit // self.block_size

    def prefix_hits(self, prompts: list[list[int]], params) -> list[int]:
        """Of each prompt, the leading full blocks its longest cached prefix covers here now (as the first
        hold of a migrating request with that prompt would find them)."""
        if not self.config.cache_config.enable_prefix_caching:
            return [0] * len(prompts)
        hits = []
        for i, prompt in enumerate(prompts):
            if len(prompt) <= self.block_size:
                hits.append(0)
                continue
            probe = self.build(f"llumnix-prefix-probe-{i}", list(prompt), params, time.time(), 0)
            _, hit, _ = self.kv.get_computed_blocks(probe)
            hits.append(hit // self.block_size)
        return hits

    def allocate(self, req, tokens: int) -> list[int] | None:
        """Grow ``req``'s blocks to cover ``tokens`` tokens (num_computed_tokens stays 0 until commit)."""
        have = len(self.kv.get_block_ids(req.request_id)[0]) if req.request_id in self._held else 0
        if -(-tokens // self.block_size) <= have:
            return self.block_ids(req.request_id)
        if self._allocate(req, tokens) is None:
            return None
        return self.block_ids(req.request_id)

    def _allocate(self, req, new_tokens: int, hit: int = 0, computed=None):
        blocks = self.kv.allocate_slots(req, new_tokens, num_new_computed_tokens=hit, new_computed_blocks=computed,
                                        delay_cache_blocks=True)
        if blocks is None:
            return None
        self._held.add(req.request_id)
        new = set(blocks.get_block_ids()[0])
        for manager in getattr(self.kv.coordinator, "single_type_managers", ()):
            pending = getattr(manager, "new_block_ids", None)
            if pending:  # the runner would zero these at the next step, perhaps after we wrote them
                manager.new_block_ids = [b for b in pending if b not in new]
        return blocks

    def free(self, req) -> None:
        self._held.discard(req.request_id)
        self.kv.free(req)

    def commit(self, req, outputs: list[int], engine_state: bytes) -> None:
        self._held.discard(req.request_id)
        req.append_output_token_ids(outputs)
        req.num_computed_tokens = req.num_tokens - 1  # the last sampled token's KV is computed by the next step
        req.num_cached_tokens = req.num_computed_tokens
        req.status = self.m.RUNNING
        if self.config.cache_config.enable_prefix_caching:
            self.kv.cache_blocks(req, req.num_computed_tokens)
        params = req.sampling_params
        rid = req.request_id
        came_back = rid in self.scheduler.finished_req_ids
        if came_back:  # it left this engine (migrated away) and came back before a step let the runner forget it
            self.scheduler.finished_req_ids.discard(rid)
        args = (rid, req.prompt_token_ids, params, params.sampling_type == self.m.RANDOM_SEED, engine_state,
                list(self.block_ids(rid)), req.num_computed_tokens, list(req.output_token_ids), came_back)
        if self.in_process:
            commit_runner_state(self.runner(), self.m.CachedRequestState, *args)
        else:
            self.rpc("llumnix_commit", *args)
        self.scheduler.requests[req.request_id] = req
        self.scheduler.running.append(req)


def apply_workarounds(vllm: VllmConfig | None = None) -> None:
    """What VllmEngine does to vLLM before it starts (environment, kernel choice), for code that builds
    vLLM's own ``LLM`` in the same process and wants the same kernels (tests comparing against it)."""
    set_env(vllm or VllmConfig())
    _Vllm.workarounds()


def set_num_threads(n: int) -> None:
    """torch's own set_num_threads (vLLM replaces it with a no-op once its CPU worker starts)."""
    if _set_num_threads is not None:
        _set_num_threads(n)
