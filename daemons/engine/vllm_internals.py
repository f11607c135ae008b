"""vLLM's internals, in one place: every vLLM module path, class and private attribute the vllm backend
touches, with the version they were checked against, and the process environment vLLM needs first.

Upgrading vLLM means re-reading this module and its two parts (``vllm_internals_state.VllmState``: what
the scheduler, cache manager and runner hold; ``vllm_internals_migration.VllmMoves``: requests taken out and
put back) against the new source, nothing else: the engine (``vllm_backend``) talks to vLLM only through
``VllmInternals`` (and its ``state`` and ``moves``) and ``set_env``.
"""

from __future__ import annotations

import logging
import os
import threading
from types import SimpleNamespace

from daemons.config import LoraConfig, ModelConfig, VllmConfig
from daemons.engine.base import EngineError
from daemons.engine.vllm_internals_migration import VllmMoves
from daemons.engine.vllm_internals_state import AMX_ENV, VllmState
from daemons.ipcdirs import endpoint_dir, remove_endpoint_dir

TESTED_VERSION = "0.32"  # major.minor the VllmInternals section was checked against
UNTESTED_ENV = "LLUMNIX_VLLM_UNTESTED"
RPC_PATH_ENV = "VLLM_RPC_BASE_PATH"  # where vLLM binds its ZeroMQ sockets as files (default: the temporary directory)
log = logging.getLogger("llumnix.engine.vllm")



def set_env(cfg: VllmConfig) -> None:
    """Must run before vllm is first imported (vLLM caches its environment variables).

    With the in-process ``uni`` executor vLLM 0.32 pins no threads (its OpenMP binding lives in the
    multiprocess executor), so ``cpu_bind`` only reaches vLLM's environment; pin with taskset or systemd.
    """
    _vllm_env(cfg)
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


def _vllm_env(cfg: VllmConfig) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # EngineCore and its worker stay in this process
    # Serving nodes often have no route out: never phone home, never ask a hub (models are loaded by path).
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cfg.cpu_bind


def preload() -> None:
    """Import vLLM as an instance does, and start nothing (no engine, no thread pool): for a process that forks
    instances (the test suite's fork server, llumnixctl/lab/forkserver.py), so that each of them does not import
    it again. vLLM is imported under the environment ``set_env`` gives an instance of the default settings."""
    _vllm_env(VllmConfig())
    VllmInternals.import_checked()


_set_num_threads = None  # torch's own set_num_threads, saved before vLLM replaces it


# ==================================================================== vLLM internals (checked: 0.32.0)


class VllmInternals:
    """The only place that knows vLLM's module paths, classes and attributes: it starts vLLM's core and
    adds, aborts and steps requests; ``state`` (``VllmState``) reads what the core holds, ``moves``
    (``VllmMoves``) takes requests out and puts them in for a migration.

    Public-ish API used: ``EngineArgs.create_engine_config``, ``Executor.get_class``, ``EngineCore``
    (``preprocess_add_request``, ``add_request``, ``abort_requests``, ``step_fn``, ``post_step``,
    ``shutdown``), ``SamplingParams`` (``verify``, ``update_from_generation_config``),
    ``EngineCoreRequest``, ``ModelConfig.try_get_generation_config``.
    Patched: ``vllm.v1.attention.backends.cpu_attn._get_attn_isa``, the CPU LoRA ops (see ``workarounds``).
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
        from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
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
                               StructuredOutputsParams=StructuredOutputsParams,
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
        instances that exchange KV blocks must agree on it. CPU LoRA: see ``leave_rows_without_adapter``.
        """
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        leave_rows_without_adapter()
        if os.environ.get(AMX_ENV) == "1":
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

    def __init__(self, model: ModelConfig, cfg: VllmConfig, lora: LoraConfig | None = None):
        self.m = m = self.import_checked()
        self.workarounds()
        args = m.EngineArgs(
            model=model.path,
            # The proxy tokenizes and detokenizes; the engine loads the tokenizer only for structured output
            # (its grammars are compiled against the vocabulary), which vLLM refuses without one.
            skip_tokenizer_init=False,
            dtype=cfg.dtype,
            max_model_len=model.max_model_len,
            block_size=cfg.block_size,
            kv_cache_memory_bytes=cfg.kv_cache_bytes or None,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens or None,
            enforce_eager=cfg.enforce_eager,
            enable_prefix_caching=cfg.enable_prefix_caching,
            # Its cache events feed the cluster's prefix index (vllm_cache.py replaces the null publisher).
            kv_events_config=self.kv_events(cfg.enable_prefix_caching),
            seed=cfg.seed,
            disable_log_stats=True,
            scheduling_policy="priority",  # see the class docstring for vLLM's sign
            async_scheduling=False,  # migration suspends requests between steps
            structured_outputs_config=self.structured_outputs_config(cfg),
            **self.parallel_args(cfg),
            **lora_args(lora),
        )
        if cfg.gpu_memory_utilization > 0:
            args.gpu_memory_utilization = cfg.gpu_memory_utilization
        self._ipc_dir = self.socket_dir(cfg)
        try:
            self.config = args.create_engine_config(m.UsageContext.ENGINE_CONTEXT)
            self.core = m.EngineCore(self.config, m.Executor.get_class(self.config), log_stats=False)
        except BaseException as exc:
            remove_endpoint_dir(self._ipc_dir)
            if isinstance(exc, (ValueError, OSError)):  # bad path, bad config, KV cache too small for max_model_len
                raise EngineError(f"vLLM could not start on {model.path!r}: {exc}") from exc
            raise
        self.model_config = self.config.model_config
        if cfg.tensor_parallel_size > 1 and cfg.worker_nice > 0:
            self.renice_workers(cfg.worker_nice)
        self.state = VllmState(m, self.core, self.config)
        self.moves = VllmMoves(self.state)
        self.lora = VllmLoraCalls(self.core)
        self.prefill_budget = int(self.config.scheduler_config.max_num_batched_tokens or 0)
        self.last_work = (0, 0, 0)  # (prefill tokens, decodes, their context tokens) of the last step
        self._watch_schedule()
        self.generation_config = self.model_config.try_get_generation_config()
        eos = self.generation_config.get("eos_token_id", getattr(self.model_config.hf_config, "eos_token_id", None))
        self.eos_token_id = eos[0] if isinstance(eos, list) and eos else eos
        if getattr(self.config.scheduler_config, "async_scheduling", False):
            raise EngineError("vLLM chose async scheduling; the vllm backend steps synchronously "
                              "(migration suspends requests between steps)")

    @staticmethod
    def structured_outputs_config(cfg: VllmConfig):
        from vllm.config import StructuredOutputsConfig

        backend = cfg.structured_outputs_backend
        if cfg.disable_any_whitespace and backend == "auto":
            backend = "xgrammar"  # vLLM takes the option only with a backend named (xgrammar or guidance)
        try:
            return StructuredOutputsConfig(backend=backend, disable_any_whitespace=cfg.disable_any_whitespace)
        except ValueError as exc:
            raise EngineError(f"vllm.structured_outputs_backend, vllm.disable_any_whitespace: {exc}") from None

    @staticmethod
    def kv_events(on: bool):
        if not on:
            return None
        from vllm.config.kv_events import KVEventsConfig

        return KVEventsConfig(enable_kv_cache_events=True, publisher="null")

    @staticmethod
    def parallel_args(cfg: VllmConfig) -> dict:
        """One rank: the ``uni`` executor, the worker in this process. Several: vLLM's multiprocess executor,
        one worker process per rank, with our worker extension (daemons/kv/tpworker.py ``LlumnixWorker``) mixed in."""
        if cfg.tensor_parallel_size <= 1:
            return {"distributed_executor_backend": "uni"}
        return {"distributed_executor_backend": "mp", "tensor_parallel_size": cfg.tensor_parallel_size,
                "worker_extension_cls": "daemons.kv.tpworker.LlumnixWorker"}

    @staticmethod
    def socket_dir(cfg: VllmConfig) -> str:
        """Where the multiprocess executor's message queues bind their ZeroMQ sockets (as files): a directory
        of this instance's own (daemons/ipcdirs.py ``endpoint_dir``), removed at ``shutdown``, rather than the
        temporary directory itself, where vLLM leaves them when its workers are stopped (16 per TP 2 cluster).
        One that a killed instance left is removed by the next instance's start (``sweep_stale``). '' for the
        ``uni`` executor (no such sockets), or where the operator set VLLM_RPC_BASE_PATH."""
        if cfg.tensor_parallel_size <= 1 or os.environ.get(RPC_PATH_ENV):
            return ""
        os.environ[RPC_PATH_ENV] = path = endpoint_dir()
        return path

    def worker_pids(self) -> list[int]:
        """The worker processes of vLLM's multiprocess executor (none for the ``uni`` executor)."""
        workers = getattr(self.core.model_executor, "workers", None) or []
        return [w.proc.pid for w in workers if getattr(w, "proc", None) is not None and w.proc.pid]

    def renice_workers(self, increment: int) -> None:
        """Lower the workers' priority by ``increment`` (all their threads: niceness is per thread on Linux),
        each in a scheduling group of its own (daemons/kv/tpworker.py ``llumnix_own_group``): where the kernel
        groups tasks by session, a thread's niceness alone weighs nothing against other sessions."""
        for pid in self.worker_pids():
            try:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    os.setpriority(os.PRIO_PROCESS, int(tid), os.getpriority(os.PRIO_PROCESS, int(tid)) + increment)
            except OSError as exc:  # gone, or no /proc (not Linux): they run at our priority
                log.warning("could not renice worker process %d: %s", pid, exc)
        for pid, why in zip(self.worker_pids(), self.core.model_executor.collective_rpc(
                "llumnix_own_group", args=(min(increment, 19),))):
            if why:
                log.warning("worker process %d keeps its instance's scheduling group: %s", pid, why)

    # ---- requests
    def sampling_params(self, sp) -> object:
        """Our SamplingParams -> vLLM's, validated and completed as vLLM's input processor would."""
        m = self.m
        so = sp.structured
        structured = None if so is None else m.StructuredOutputsParams(
            json=so.json, regex=so.regex, choice=so.choice, grammar=so.grammar, json_object=so.json_object,
            structural_tag=so.structural_tag, disable_any_whitespace=so.disable_any_whitespace,
            disable_additional_properties=so.disable_additional_properties, whitespace_pattern=so.whitespace_pattern)
        p = m.SamplingParams(
            n=1, max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
            seed=sp.seed, stop_token_ids=list(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
            min_tokens=sp.min_tokens, logprobs=sp.logprobs, presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty, repetition_penalty=sp.repetition_penalty,
            detokenize=False, output_kind=m.DELTA, structured_outputs=structured)
        # vLLM's own checks, the grammar's too (a schema no backend takes is refused here, with vLLM's message)
        p.verify(self.model_config, self.config.speculative_config, self.config.structured_outputs_config,
                 self.state.tokenizer())
        p.update_from_generation_config(self.generation_config, self.eos_token_id)
        return p

    def add(self, request_id: str, prompt: list[int], params, arrival_time: float, priority: int,
            generated: list[int] | None = None, lora=None):
        """``generated``: a failover's tokens the client already has (in ``prompt`` too): a grammar is advanced
        over them before the request's first step, so the output continues where they left it. ``lora``: its
        adapter (``lora_request``), or None for the base model."""
        req = self.moves.build(request_id, prompt, params, arrival_time, priority, lora)
        if generated and req.use_structured_output:
            self.moves.advance_grammar(req, generated)
        self.core.add_request(req)
        return req  # vllm.v1.request.Request: read for counters, never written

    def abort(self, request_id: str) -> None:
        self.core.abort_requests([request_id])  # frees its blocks now

    def _watch_schedule(self) -> None:
        """Note what each step schedules (``last_work``): the scheduler's ``schedule`` is wrapped on the instance
        (``EngineCore.step`` calls ``self.scheduler.schedule``). A request given one token is decoding; every
        other scheduled token is prefill (a one-token prefill chunk counts as a decode: rare, and as cheap)."""
        sched = self.core.scheduler
        schedule = sched.schedule

        def watched(*args, **kwargs):
            out = schedule(*args, **kwargs)
            per_request = out.num_scheduled_tokens
            decodes = context = 0
            requests = sched.requests
            for rid, n in per_request.items():
                if n == 1:
                    decodes += 1
                    r = requests.get(rid)
                    context += r.num_tokens if r is not None else 0
            self.last_work = (out.total_num_scheduled_tokens - decodes, decodes, context)
            return out

        sched.schedule = watched

    def step(self) -> list:
        self.last_work = (0, 0, 0)
        outputs, executed = self.core.step_fn()
        self.core.post_step(model_executed=executed)
        eco = outputs.get(0) if outputs else None
        return eco.outputs if eco is not None else []

    def shutdown(self) -> None:
        try:
            self.core.shutdown()
        finally:
            remove_endpoint_dir(self._ipc_dir)
            if self._ipc_dir and os.environ.get(RPC_PATH_ENV) == self._ipc_dir:
                del os.environ[RPC_PATH_ENV]


_lora_ops_fixed = False


def leave_rows_without_adapter() -> None:
    """vLLM 0.32's PyTorch LoRA ops (the CPU backend's: ``vllm.lora.ops.torch_ops.lora_ops``) pick each token's
    adapter weights by its slot index, and a token without an adapter (a base-model request's) has index -1, which
    indexing takes for the LAST slot: in a step that also runs a request with an adapter, the base model's tokens
    had the last slot's adapter applied (SmolLM2 answered another sentence). Wrapped, the ops leave those tokens'
    rows as they were. Patched in ``lora_ops`` (its sgmv ops call these) and ``punica_cpu`` (which imported them);
    idempotent."""
    global _lora_ops_fixed
    if _lora_ops_fixed:
        return
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    lora_ops.bgmv_shrink = punica_cpu.bgmv_shrink = _skip_rows_without_adapter(lora_ops.bgmv_shrink)
    lora_ops.bgmv_expand = punica_cpu.bgmv_expand = _skip_rows_without_adapter(lora_ops.bgmv_expand)
    lora_ops.bgmv_expand_slice = punica_cpu.bgmv_expand_slice = _skip_rows_without_adapter(lora_ops.bgmv_expand_slice)
    _lora_ops_fixed = True


def _skip_rows_without_adapter(op):
    """``op(inputs, weights, output, indices, ...)`` with the rows of ``output`` whose index is -1 kept as they were."""
    def op_for_adapted_rows(inputs, weights, output, indices, *args, **kwargs):
        none = indices < 0
        if none.shape[0] != output.shape[0] or not bool(none.any()):
            return op(inputs, weights, output, indices, *args, **kwargs)
        kept = output[none]  # (a copy)
        op(inputs, weights, output, indices.clamp(min=0), *args, **kwargs)
        output[none] = kept

    return op_for_adapted_rows


def lora_args(lora: LoraConfig | None) -> dict:
    """vLLM's LoRA arguments. On (lora.slots > 0): as many adapters in a batch as held (max_loras), and room for
    one more held (max_cpu_loras): a new one loads before the one it replaces goes (daemons/engine/vllm_lora.py),
    so vLLM's own LRU never unloads one behind daemons/engine/adapters.py's back."""
    if lora is None or not lora.slots:
        return {}
    return {"enable_lora": True, "max_loras": lora.slots, "max_cpu_loras": lora.slots + 1,
            "max_lora_rank": lora.max_rank}


class VllmLoraCalls:
    """vLLM's LoRA verbs (``EngineCore.add_lora``, ``remove_lora``: the worker loads and activates the weights)
    and its ``LoRARequest``."""

    def __init__(self, core):
        self.core = core

    @staticmethod
    def request(name: str, lora_id: int, path: str):
        from vllm.lora.request import LoRARequest

        return LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path)

    def add(self, name: str, lora_id: int, path: str) -> None:
        """Load and activate; raises what vLLM raises (its LoRA checks: rank, target modules, shapes)."""
        self.core.add_lora(self.request(name, lora_id, path))

    def remove(self, lora_id: int) -> None:
        self.core.remove_lora(lora_id)


def apply_workarounds(vllm: VllmConfig | None = None) -> None:
    """What VllmEngine does to vLLM before it starts (environment, kernel choice), for code that builds
    vLLM's own ``LLM`` in the same process and wants the same kernels (tests comparing against it)."""
    set_env(vllm or VllmConfig())
    VllmInternals.workarounds()


def lower_this_thread(to_nice: int) -> None:
    """Run the calling thread at niceness ``to_nice`` or lower in priority (Linux: niceness is per thread)."""
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < to_nice:
            os.setpriority(os.PRIO_PROCESS, tid, min(to_nice, 19))
    except OSError as exc:
        log.warning("could not lower the step thread's priority to niceness %d: %s", to_nice, exc)


def set_num_threads(n: int) -> None:
    """torch's own set_num_threads (vLLM replaces it with a no-op once its CPU worker starts)."""
    if _set_num_threads is not None:
        _set_num_threads(n)
